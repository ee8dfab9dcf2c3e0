"""The ``millpond launch`` command line: its arguments, and the job they describe run to its
end (:class:`~millpond.deploy.launch.Launch`).

The job is checked and its run directory claimed before Ray starts (:meth:`Launch.prepare`),
so that a job that cannot run is refused before any Ray process or run directory exists;
Ray then starts while the job's other modules import
(:func:`~millpond.deploy.ray_start.start_ray_while_importing`). Errors end the command as
millpond errors, one line each (``--verbose``: with their tracebacks and the actors' output).
This module imports neither Ray nor torch at its top: the command line imports it first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from millpond.deploy.launch import Launch
from millpond.deploy.ray_start import (
    command_start,
    start_ray_while_importing,
    token_auth_on_quietly,
)
from millpond.errors import InvalidConfigError, MillpondError

__all__ = ["build_parser", "run"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``millpond launch`` command line, added to ``parser`` (or a parser of its own)."""
    p = parser or argparse.ArgumentParser(prog="millpond launch", description=__doc__)
    p.add_argument(
        "config",
        nargs="?",
        help="YAML job config, e.g. deploy/configs/cartpole-ppo.yaml (with --resume: "
        "optional, the run's own config.yaml by default)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set run.frames=50000 (repeatable)",
    )
    p.add_argument("--address", help="join a Ray cluster: 'auto' or 'ray://host:port'")
    p.add_argument("--replay", help="use running shards 'host:port,...' instead of starting them")
    p.add_argument(
        "--run-dir",
        help="write the run here (a new or empty directory) instead of a new "
        "run.dir/NAME-TIMESTAMP-XXXX",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the stopped job of RUN_DIR: its config (--set changes it, e.g. "
        "run.frames), learner checkpoint, shards and counters",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --run-dir name an earlier run's directory, and replace that run (its "
        "files are deleted first); without it such a directory is refused",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the actors' own output (their log lines, their errors' tracebacks) and, "
        "on an error, its whole traceback besides its message",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Run the job of the command line ``args``; the process's exit status.

    The config and the env are checked and the run directory claimed before Ray starts
    (:meth:`Launch.prepare`): a job that cannot run is refused before any Ray process or
    run directory exists. Ray then starts while the job's other modules import.
    """
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"ray.address={args.address}")
    if args.resume is None and args.config is None:
        raise InvalidConfigError("launch: give a CONFIG file, or --resume RUN_DIR")
    try:
        launch = _launch(args, overrides)
        ray_section = launch.config.ray
        token_auth_on_quietly(ray_section.address)
        launch.prepare()
        try:
            # The actors' own output (an error's traceback among it) only when asked for:
            # the job reports their errors itself, as millpond errors.
            launch.plan_cores()
            launch.owns_ray = start_ray_while_importing(
                ray_section.address, ray_section.num_cpus, log_to_driver=args.verbose
            )
        except BaseException:
            launch.abandon()
            raise
        summary = launch.run()
    except Exception as e:
        told = _as_told(e, args.verbose)
        if told is e:
            raise
        raise told from e
    return {"frames": 0, "return": 0, "interrupted": 130}.get(summary["stopped_by"], 1)


def _as_told(error: Exception, verbose: bool) -> Exception:
    """The error a job ended with, as the user reads it: a millpond error, its message
    without Ray's traceback (an error of Ray's own, raised where the job did not expect it,
    too); with ``verbose`` its whole traceback printed first."""
    if verbose:
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    if isinstance(error, MillpondError) or not type(error).__module__.startswith("ray"):
        return error
    from millpond.actors.remote_errors import from_remote  # deferred: imports torch

    return from_remote(error, "Ray")


def _launch(args: argparse.Namespace, overrides: list[str]) -> Launch:
    """The job of the command line, its config checked (nothing started)."""
    # Deferred: imports torch (see the module docstring).
    from millpond.deploy.launch_config import load_config, resume_config

    started_at = command_start()
    common = {"replay": args.replay, "started_at": started_at}
    if args.resume is None:
        config = load_config(args.config, overrides)
        return Launch(config, run_dir=args.run_dir, overwrite=args.overwrite, **common)
    if args.run_dir is not None and Path(args.run_dir).resolve() != Path(args.resume).resolve():
        raise InvalidConfigError(
            f"--run-dir {args.run_dir} and --resume {args.resume}: a resumed job writes "
            "into the run directory it continues"
        )
    config, changes = resume_config(args.resume, args.config, overrides)
    for change in changes:
        print(f"resume: {change}", flush=True)
    return Launch(config, run_dir=args.resume, resume=True, overwrite=args.overwrite, **common)
