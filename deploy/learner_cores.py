"""Cores held for the learners on a machine the job has to itself.

On a small machine the learner's update is what paces an off-policy job, and three busy
processes on two cores (learner, env actor, shard) take turns on both: the learner's main
thread waited for a core 13-17% of the time, preempted 500-700 times a second, and each
preemption costs it its caches as well (docs/training.md). With ``learner.pin_cores``, a
job that starts its own local Ray instance gives each learner process cores of its own
(``learner.threads`` each, the machine's last ones) and keeps every other process of the
job on the rest: each learner moves itself onto its cores when its process starts, and
once the job is up the driver moves its own thread and every process below it but the
learners (Ray's, the env actors', the shards') onto the rest. Processes Ray forks later
(a restarted actor) inherit that from the raylet. The startup itself (Ray, the shards,
the actors' imports) runs on every core: pinned from the start it took ~4 s longer.

Linux only (``os.sched_setaffinity``); elsewhere ``"auto"`` leaves the cores shared.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from millpond.deploy.ray_start import descendants
from millpond.errors import InvalidConfigError


@dataclass(frozen=True)
class CorePlan:
    """Which cores each learner rank runs on, and which the job's other processes share."""

    learners: tuple[tuple[int, ...], ...]
    rest: tuple[int, ...]


def plan_cores(available: Sequence[int], num_learners: int, cores_each: int) -> CorePlan | None:
    """``cores_each`` cores for each of ``num_learners`` learners, the last of
    ``available``; ``None`` when that would leave no core for the rest of the job."""
    cores = sorted(available)
    held = num_learners * cores_each
    if held >= len(cores):
        return None
    blocks = tuple(
        tuple(cores[len(cores) - held + i * cores_each : len(cores) - held + (i + 1) * cores_each])
        for i in range(num_learners)
    )
    return CorePlan(learners=blocks, rest=tuple(cores[: len(cores) - held]))


def job_plan(
    pin_cores: bool | str, num_learners: int, threads: int, local: bool
) -> CorePlan | None:
    """The plan of a job's ``learner.pin_cores``, or ``None`` where it leaves cores shared.

    ``local``: the job starts a Ray instance of its own on this machine. ``True`` refuses
    what it cannot do (a cluster, a machine with too few cores); ``"auto"`` then shares.
    """
    if pin_cores is False:
        return None
    explicit = pin_cores is True
    if not local:
        if explicit:
            raise InvalidConfigError(
                "learner.pin_cores: true holds cores of a machine the job has to itself, "
                "which a job that joins a cluster (ray.address) or a Ray instance already "
                "running in this process does not; use 'auto' or false"
            )
        return None
    if not hasattr(os, "sched_setaffinity"):
        if explicit:
            raise InvalidConfigError(
                "learner.pin_cores: true needs os.sched_setaffinity (Linux); use 'auto'"
            )
        return None
    available = sorted(os.sched_getaffinity(0))
    plan = plan_cores(available, num_learners, threads)
    if plan is None and explicit:
        raise InvalidConfigError(
            f"learner.pin_cores: {num_learners} learner(s) of learner.threads={threads} "
            f"would hold all {len(available)} cores this process may run on "
            f"({available}), none left for the actors and shards; use 'auto' or false"
        )
    return plan


def pin_this_process(cores: Sequence[int]) -> None:
    """Every thread of this process onto ``cores``; the threads they start inherit it."""
    pin_processes([os.getpid()], cores)


def pin_processes(pids: Iterable[int], cores: Sequence[int]) -> int:
    """Every thread of each process in ``pids`` onto ``cores``; how many processes were
    moved (those that ended meanwhile are passed over)."""
    moved = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:  # ended meanwhile
            continue
        for task in tasks:
            with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                os.sched_setaffinity(int(task), cores)
        moved += 1
    return moved


def pin_this_thread(cores: Sequence[int] | None) -> frozenset[int]:
    """The calling thread onto ``cores`` (``None``: left as it is); returns the cores it
    ran on before, for :func:`os.sched_setaffinity` to put back."""
    before = frozenset(os.sched_getaffinity(0))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return before


def cores_of_this_process() -> list[int]:
    """The cores this process's calling thread may run on (``[]`` off Linux)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


class JobCores:
    """``learner.pin_cores`` for the job this process drives: planned just before the
    job's own Ray starts, carried out once the job is up, undone when it ends."""

    def __init__(self) -> None:
        #: Each learner rank's cores and the rest's; ``None``: every core shared.
        self.plan: CorePlan | None = None
        self._children_before: set[int] = set()
        self._thread_before: frozenset[int] | None = None

    def plan_own_ray(
        self, pin_cores: bool | str, num_learners: int, threads: int, local: bool
    ) -> None:
        """The plan for a Ray instance this process is about to start (see :func:`job_plan`)."""
        self.plan = job_plan(pin_cores, num_learners, threads, local)
        # a program's own child processes (a server of its own, ...) are not the job's
        self._children_before = descendants(os.getpid()) if self.plan else set()

    def share(self, pin_cores: bool | str, num_learners: int, threads: int) -> None:
        """No plan: the job runs on a Ray instance someone else started (``True`` refused)."""
        self.plan = None
        job_plan(pin_cores, num_learners, threads, local=False)

    def pin_the_rest(self, learner_pids: set[int]) -> int | None:
        """This thread and every process started below it since the plan but the learners
        (Ray's, the shards', the env actors') onto the plan's rest; how many processes were
        moved (``None``: no plan)."""
        if self.plan is None:
            return None
        others = descendants(os.getpid()) - self._children_before - learner_pids
        self._thread_before = pin_this_thread(self.plan.rest)
        return pin_processes(others, self.plan.rest)

    def unpin(self) -> None:
        """This thread back on the cores it had before :meth:`pin_the_rest`."""
        if self._thread_before is not None:
            pin_this_thread(self._thread_before)
            self._thread_before = None
