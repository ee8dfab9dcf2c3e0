"""``millpond table configure ADDRESSES TABLE ...``: change a running table's live settings.

The rate limiter (``--min-size``, ``--samples-per-insert``, ``--error-buffer``,
``--no-samples-per-insert``) and a prioritized table's ``--alpha`` / ``--beta``, on every
shard, at once and for good (``ReplayClient.configure_table``). Typical use: prefill from a
dataset with no ratio, then switch it on.
"""

from __future__ import annotations

import argparse
import sys

from millpond.deploy.service_args import add_service_args, connect


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond table", description=__doc__)
    sub = p.add_subparsers(dest="table_command", required=True)
    c = sub.add_parser("configure", help="change a running table's live settings")
    add_service_args(c, "an admin token, for a service with tokens")
    c.add_argument("table")
    c.add_argument("--min-size", type=int)
    ratio = c.add_mutually_exclusive_group()
    ratio.add_argument("--samples-per-insert", type=float)
    ratio.add_argument(
        "--no-samples-per-insert", action="store_true", help="drop the ratio (min_size alone)"
    )
    c.add_argument("--error-buffer", type=float)
    c.add_argument("--alpha", type=float, help="prioritized tables")
    c.add_argument("--beta", type=float, help="prioritized tables")
    return p


def run(args: argparse.Namespace) -> int:
    settings = {
        name: getattr(args, name)
        for name in ("min_size", "samples_per_insert", "error_buffer", "alpha", "beta")
        if getattr(args, name) is not None
    }
    if args.no_samples_per_insert:
        settings["samples_per_insert"] = None
    if not settings:
        print("millpond: error: nothing to configure (see --help)", file=sys.stderr)
        return 2
    with connect(args, timeout_s=30) as client:
        config = client.configure_table(args.table, **settings)
    ratio = config.samples_per_insert
    print(
        f"millpond: table {config.name!r}: min_size {config.min_size}, samples_per_insert "
        f"{'none' if ratio is None else f'{ratio:g}'}"
        + (f", error_buffer {config.effective_error_buffer:g}" if ratio is not None else "")
        + (f", alpha {config.alpha:g}, beta {config.beta:g}" if config.has_priorities else "")
    )
    return 0
