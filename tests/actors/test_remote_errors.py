"""A Ray actor's error as the job's own: the actor's millpond error type and message, no Ray
traceback, no terminal colour codes; Ray's error kept as its cause."""

from __future__ import annotations

import ray.exceptions

from millpond.actors.remote_errors import first_line, from_remote
from millpond.errors import InvalidDataError, MillpondError, TableNotFoundError

_CYAN, _RESET = "\x1b[36m", "\x1b[39m"


def ray_task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    """What a driver's ``ray.get`` raises for a call whose actor raised ``cause``."""
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "learner_actor.py", line 261, in run\n'
        "    metrics = self.learner.step()\n"
        f"{type(cause).__module__}.{type(cause).__name__}: {cause}"
    )
    return ray.exceptions.RayTaskError(
        "LearnerActor.run", traceback, cause, proctitle="ray::LearnerActor.run"
    )


def test_a_millpond_error_keeps_its_type_and_message():
    cause = InvalidDataError("batch_size (4096) exceeds the capacity of table 'rollouts'")
    error = ray_task_error(cause)
    assert "\x1b[" in str(error) and "line 261" in str(error)  # what Ray would show
    out = from_remote(error, "learner 0")
    assert type(out) is InvalidDataError
    assert str(out) == "learner 0: batch_size (4096) exceeds the capacity of table 'rollouts'"
    assert out.__cause__ is error


def test_other_errors_name_their_type_and_nested_calls_reach_the_first_cause():
    out = from_remote(ray_task_error(ValueError("bad shape")), "env actor 3")
    assert type(out) is MillpondError and str(out) == "env actor 3: ValueError: bad shape"
    nested = ray_task_error(ray_task_error(TableNotFoundError("table 'x' does not exist")))
    out = from_remote(nested, "learner 1")
    assert type(out) is TableNotFoundError
    assert str(out) == "learner 1: table 'x' does not exist"  # unquoted, unlike a KeyError


def test_an_error_without_a_cause_gives_its_first_line_uncoloured():
    error = ray.exceptions.RayError(f"{_CYAN}The actor died{_RESET} unexpectedly\nmore lines")
    assert first_line(error) == "The actor died unexpectedly"
    assert str(from_remote(error, "a replay shard failed to start")) == (
        "a replay shard failed to start: The actor died unexpectedly"
    )
