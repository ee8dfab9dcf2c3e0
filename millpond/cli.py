"""The ``millpond`` command line: a thin layer over the packages."""

from __future__ import annotations

import argparse
import logging
import sys

from millpond.errors import MillpondError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="millpond", description="Distributed actor-learner replay for reinforcement learning."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from millpond.service import server

    serve = sub.add_parser("serve", help="run the replay service (one shard or several)")
    server.build_parser(serve)

    demo = sub.add_parser("demo", help="collect CartPole experience compactly and report savings")
    from millpond.deploy import storage_demo

    storage_demo.build_parser(demo)

    launch = sub.add_parser("launch", help="run a training job: replay, env actors, learner")
    from millpond.deploy import launch as launcher

    launcher.build_parser(launch)

    from millpond.deploy import dataset_cli

    export = sub.add_parser("export", help="a table to TED (memmap), HDF5 or a Minari dataset")
    dataset_cli.build_export_parser(export)
    import_ = sub.add_parser("import", help="store an export or Minari dataset into a table")
    dataset_cli.build_import_parser(import_)

    from millpond.deploy import status_cli

    status = sub.add_parser("status", help="one screen of every shard and table of a service")
    status_cli.build_parser(status)
    from millpond.deploy import table_cli

    table = sub.add_parser("table", help="change a running table's live settings")
    table_cli.build_parser(table)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            return server.serve(args)
        if args.command == "launch":
            return launcher.run(args)
        if args.command == "demo":
            return storage_demo.run(args)
        if args.command == "export":
            return dataset_cli.run_export(args)
        if args.command == "import":
            return dataset_cli.run_import(args)
        if args.command == "status":
            return status_cli.run(args)
        if args.command == "table":
            return table_cli.run(args)
    except MillpondError as e:
        print(f"millpond: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
