"""What ``millpond launch`` checks before Ray starts, so that a job that cannot run is
refused within seconds and before any of its processes or files exist.

The config itself is checked as it is read (:func:`~millpond.deploy.launch_config.load_config`:
keys, types, values). :func:`check_job` adds what needs the env or the files the config names:
the env made once as every lane makes it (its id, kwargs and wrappers; the learner's networks
take its spaces, and its action space must fit the learner's algorithm), the learner's network family for its observations, the token file, and
TLS only where it applies. None of it imports or starts Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gymnasium as gym

from millpond.actors.envs import make_env
from millpond.deploy.algorithms import check_action_space
from millpond.errors import InvalidConfigError
from millpond.learner.networks import network_for

if TYPE_CHECKING:
    from millpond.deploy.launch_config import LaunchConfig

__all__ = ["CheckedJob", "check_job", "env_spaces"]


@dataclass(frozen=True)
class CheckedJob:
    """What the checks found: the env's spaces and the learner's network family."""

    observation_space: Any
    action_space: Any
    network: str


def env_spaces(config: LaunchConfig) -> tuple[Any, Any]:
    """The env's observation and action spaces, from one env made (and closed) as every
    lane makes it, so that the learner's networks see the actors' spaces; a wrong env id,
    or an action space the learner's algorithm cannot act in, is a config error."""
    c = config
    try:
        probe = make_env(c.env.id, c.env.kwargs, c.env.wrappers)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"env: {e}") from None
    except Exception as e:
        raise InvalidConfigError(f"env: cannot make {c.env.id!r}: {e}") from None
    spaces = probe.observation_space, probe.action_space
    probe.close()
    check_action_space(c.learner.algorithm, spaces[1], c.env.id)
    return spaces


def check_job(config: LaunchConfig, replay: str | None = None) -> CheckedJob:
    """Check what the config names before anything of the job starts (see the module
    docstring); ``replay``: the ``--replay`` addresses, if any. Raises
    :class:`InvalidConfigError` naming the key."""
    c = config
    obs_space, act_space = env_spaces(c)
    try:
        network = network_for(obs_space, c.learner.network)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"learner.network: {e}") from None
    normalizes = c.learner.algorithm == "ppo" and c.learner.ppo.normalize_observations
    if normalizes and (network != "mlp" or not isinstance(obs_space, gym.spaces.Box)):
        raise InvalidConfigError(
            "learner.ppo.normalize_observations: for the MLP on Box observations; env "
            f"{c.env.id!r} has {obs_space} (network {network!r})"
        )
    c.replay.tokens()  # an unreadable token file
    if c.replay.tls is not None and replay is None:
        raise InvalidConfigError(
            "replay.tls: applies to a service named with --replay; the shards this job "
            "starts serve plaintext"
        )
    return CheckedJob(obs_space, act_space, network)
