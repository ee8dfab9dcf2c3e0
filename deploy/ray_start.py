"""Ray for a ``millpond launch`` job: started in the main thread while another imports the
job's modules, or joined when a cluster is named; and the command start that the job's
startup times count from.

Ray's start is mostly waiting for its own processes, the job's remaining imports (Ray's own,
the actors', the shards') mostly Python: side by side they take less than one after the
other. The job's config and env are checked before (:mod:`~millpond.deploy.preflight`),
so that a bad one is refused before any Ray process exists; ``ray`` is imported in the
functions that start it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import time

__all__ = [
    "command_start",
    "descendants",
    "init_ray",
    "start_ray_while_importing",
    "stop_processes",
    "token_auth_on_quietly",
]

_IMPORTED_AT = time.time()

#: What the driver imports after its config is checked and before its job starts (Ray, the
#: actors', learners' and shards' rooms): imported in a thread while Ray starts.
_JOB_MODULES = (
    "millpond.actors.fleet",
    "millpond.deploy.replay_actor",
    "millpond.deploy.learner_actor",
    "millpond.learner.client",
    "millpond.learner.networks",
    "millpond.deploy.shard_supervisor",
    "millpond.deploy.learner_group",
    "millpond.deploy.env_fleet",
)


#: Ray waits 30 s (its default) for a new local instance's GCS to bind its port, and fails
#: the start after it. A small machine starting the job's imports (and perhaps a running
#: serve's shards) beside Ray has taken longer; a job waits up to this, unless the user's
#: environment says otherwise (Ray's own setting, kept as it is).
GCS_PORT_WAIT_VAR, GCS_PORT_WAIT_S = "RAY_gcs_server_port_wait_time_s", "120"


def local_ray_waits_for_its_gcs() -> None:
    """Give a local Ray's GCS :data:`GCS_PORT_WAIT_S` seconds to start, unless the
    environment sets Ray's wait already."""
    os.environ.setdefault(GCS_PORT_WAIT_VAR, GCS_PORT_WAIT_S)


def command_start() -> float:
    """When this ``millpond`` command began (wall clock): the import of its command line, or
    of this module in a program that runs a job without it.

    Not the process's start: ``pip install ... && millpond launch`` runs the command in the
    process of the shell that ran pip first, and that clock would count the install.
    """
    cli = sys.modules.get("millpond.cli")
    return min(getattr(cli, "STARTED_AT", _IMPORTED_AT), _IMPORTED_AT)


#: Ray's words when a new local instance's raylet has not registered with its GCS within the
#: 30 s Ray waits for it (a wait Ray fixes in its code: no setting changes it).
RAYLET_TIMEOUT_WORDS = "timed out during startup"
#: Starts of a local instance a job makes before it gives up on Ray's raylet registration.
LOCAL_START_ATTEMPTS = 2

log = logging.getLogger("millpond.deploy")


def init_ray(address: str | None, num_cpus: int | None, log_to_driver: bool = True) -> None:
    """``ray.init`` as a job starts it: its own local instance unless ``address`` names a
    cluster; ``log_to_driver``: the actors' output (their log lines, the tracebacks of
    their errors) printed here too, besides Ray's session logs.

    A local instance whose raylet did not register in time is stopped (the processes Ray
    started for it) and started once more: on a loaded small machine the registration has
    missed Ray's fixed 30 s once in many starts, and the next start went through."""
    import ray  # this module is the command line's: Ray imports while it starts

    def start() -> None:
        ray.init(
            # "local" and not None: None joins whatever RAY_ADDRESS or the last `ray start` on
            # this machine names, and a job must join a cluster only when told to.
            address=address or "local",
            num_cpus=num_cpus if address is None else None,
            include_dashboard=False,
            logging_level=logging.WARNING,
            configure_logging=True,
            log_to_driver=log_to_driver,
        )

    if address is not None:
        start()
        return
    local_ray_waits_for_its_gcs()
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = descendants(os.getpid())
        try:
            start()
            return
        except Exception as err:
            if RAYLET_TIMEOUT_WORDS not in str(err) or attempt == LOCAL_START_ATTEMPTS:
                raise
            stopped = stop_processes(descendants(os.getpid()) - before)
            log.warning(
                "Ray's local instance did not start (%s); stopped its %d processes, "
                "starting it again",
                err,
                stopped,
            )


def descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (children, theirs, ...), from ``/proc``; empty where the
    system has none."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def stop_processes(pids: set[int], wait_s: float = 5.0) -> int:
    """SIGKILL ``pids`` and reap those that are this process's children; how many were
    signalled."""
    signalled = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            signalled += 1
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours to reap (a grandchild), or reaped
                break
            if done:
                break
            time.sleep(0.01)
    return signalled


def token_auth_on_quietly(address: str | None) -> None:
    """Token authentication for the local Ray instance a job starts, said plainly.

    Ray turns it on for a new local instance when ``RAY_AUTH_MODE`` is unset, and then warns
    so on every start; set to ``token`` it does the same without the warning. Only for a
    local instance (``address`` ``None``), before Ray is imported, and only when unset: a
    cluster joined keeps its own mode, and a user's setting is kept.
    """
    if address is None and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def start_ray_while_importing(
    address: str | None, num_cpus: int | None, log_to_driver: bool = True
) -> bool:
    """Start Ray in this (the main) thread while another imports the job's modules; whether
    Ray was started (not when this program runs Ray already: the job joins it)."""

    def load() -> None:
        for name in _JOB_MODULES:
            # An import that fails here fails again, with its traceback, where it is used.
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    importer = threading.Thread(target=load, name="millpond-imports", daemon=True)
    importer.start()
    try:
        import ray  # here, side by side with the job's imports

        if ray.is_initialized():  # a program's own Ray: Launch joins it
            return False
        init_ray(address, num_cpus, log_to_driver)
    finally:
        importer.join()
    return True
