"""The ``millpond`` command line: a thin layer over the packages."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from millpond.errors import MillpondError

#: When this command began (wall clock): what a job's startup times count from. Not the
#: process's start, which is a shell's when it runs other commands before exec'ing this one.
STARTED_AT = time.time()

#: name -> (help, module, its parser builder, its runner). A command's module is imported
#: only when that command runs (or ``--help`` lists them all): most import torch, and
#: ``launch`` starts Ray while it does.
_COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "serve": (
        "run the replay service (one shard or several)",
        "millpond.service.server",
        "build_parser",
        "serve",
    ),
    "demo": (
        "collect CartPole experience compactly and report savings",
        "millpond.deploy.storage_demo",
        "build_parser",
        "run",
    ),
    "launch": (
        "run a training job: replay, env actors, learner",
        "millpond.deploy.launch_cli",
        "build_parser",
        "run",
    ),
    "eval": (
        "play a run's trained policy, print its mean return",
        "millpond.deploy.eval_cli",
        "build_parser",
        "run",
    ),
    "export": (
        "a table to TED (memmap), HDF5 or a Minari dataset",
        "millpond.deploy.dataset_cli",
        "build_export_parser",
        "run_export",
    ),
    "import": (
        "store an export or Minari dataset into a table",
        "millpond.deploy.dataset_cli",
        "build_import_parser",
        "run_import",
    ),
    "status": (
        "one screen of every shard and table of a service",
        "millpond.deploy.status_cli",
        "build_parser",
        "run",
    ),
    "table": (
        "change a running table's live settings",
        "millpond.deploy.table_cli",
        "build_parser",
        "run",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="millpond", description="Distributed actor-learner replay for reinforcement learning."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_, module, build, _) in _COMMANDS.items():
        command = sub.add_parser(name, help=help_)
        if chosen not in _COMMANDS or chosen == name:  # unknown: argparse lists them all
            getattr(importlib.import_module(module), build)(command)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _, module, _, runner = _COMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(module), runner)(args) or 0)
    except MillpondError as e:
        print(f"millpond: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
