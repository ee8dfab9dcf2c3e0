"""Ray for a ``millpond launch`` job: started in the main thread while another imports the
job's modules, or joined when a cluster is named; and the process start that the job's
startup times count from.

Ray's start is mostly waiting for its own processes, the job's imports (torch and
tensordict among them) mostly Python: side by side they take ~1.5 s less than one after the
other. So the command line imports this module and not Ray: ``ray`` is imported in the
functions that start it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import threading
import time
from pathlib import Path

from millpond.deploy.algorithms import action_space_of, check_action_space
from millpond.deploy.config_files import read_config_doc
from millpond.errors import InvalidConfigError, MillpondError

__all__ = ["init_ray", "process_start", "start_ray_while_importing"]

_IMPORTED_AT = time.time()

#: What the driver imports before its job starts (torch and tensordict among them, ~2 s of
#: CPU): imported in a thread while Ray starts.
_JOB_MODULES = (
    "millpond.deploy.launch_config",
    "millpond.actors.envs",
    "millpond.actors.fleet",
    "millpond.deploy.replay_actor",
    "millpond.deploy.learner_actor",
    "millpond.learner.client",
    "millpond.learner.networks",
    "millpond.deploy.shard_supervisor",
    "millpond.deploy.learner_group",
    "millpond.deploy.env_fleet",
)


def process_start() -> float:
    """This process's start (wall clock), so that startup times include the imports."""
    try:
        import psutil  # a Ray dependency: a process without it counts from this import

        return psutil.Process().create_time()
    except Exception:  # pragma: no cover - without psutil: from this module's import
        return _IMPORTED_AT


def init_ray(address: str | None, num_cpus: int | None) -> None:
    """``ray.init`` as a job starts it: its own local instance unless ``address`` names a
    cluster."""
    import ray  # this module is the command line's: Ray imports while it starts

    ray.init(
        # "local" and not None: None joins whatever RAY_ADDRESS or the last `ray start` on
        # this machine names, and a job must join a cluster only when told to.
        address=address or "local",
        num_cpus=num_cpus if address is None else None,
        include_dashboard=False,
        logging_level=logging.WARNING,
        configure_logging=True,
    )


def start_ray_while_importing(args: argparse.Namespace, overrides: list[str]) -> bool:
    """Start Ray in this (the main) thread while another imports the job's modules; whether
    Ray was started.

    The ``ray`` section is read from the file as it stands (the whole config is checked
    after, and a bad one stops Ray again); where it cannot be read plainly, or Ray runs
    already, nothing starts here. Nor does it where the learner's algorithm does not fit
    the env's action space (:mod:`millpond.deploy.algorithms`, checked with gymnasium
    while Ray imports): the job's own check then refuses the config before Ray.
    """
    try:
        path = args.config if args.config is not None else Path(args.resume) / "config.yaml"
        doc = read_config_doc(path, overrides)
        section = doc.get("ray", {})
    except (MillpondError, OSError):
        return False
    section = {} if section is None else section
    address = section.get("address") if isinstance(section, dict) else None
    num_cpus = section.get("num_cpus") if isinstance(section, dict) else None
    plain = (
        isinstance(section, dict)
        and set(section) <= {"address", "num_cpus"}
        and (address is None or (isinstance(address, str) and address.strip() != ""))
        and (num_cpus is None or (type(num_cpus) is int and num_cpus >= 1))
    )
    if not plain:
        return False

    misfit: list[InvalidConfigError] = []
    checked = threading.Event()

    def load() -> None:
        try:
            found = action_space_of(doc)
            if found is not None:
                check_action_space(*found)
        except InvalidConfigError as e:
            misfit.append(e)
        except Exception:  # anything else: the job's own check decides
            pass
        finally:
            checked.set()
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
        checked.wait()
        if misfit:  # refused by the job's check, with nothing started
            return False
        init_ray(address, num_cpus)
    finally:
        importer.join()
    return True
