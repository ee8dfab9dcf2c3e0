"""``millpond table configure ADDRESSES TABLE ...``: change a running table's live settings.

The rate limiter (``--min-size``, ``--samples-per-insert``, ``--error-buffer``,
``--no-samples-per-insert``) and a prioritized table's ``--alpha`` / ``--beta``, on every
shard, at once and for good (``ReplayClient.configure_table``). Typical use: prefill from a
dataset with no ratio, then switch it on.
"""

from __future__ import annotations

import argparse
import os
import sys

from millpond.learner.client import ReplayClient


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond table", description=__doc__)
    sub = p.add_subparsers(dest="table_command", required=True)
    c = sub.add_parser("configure", help="change a running table's live settings")
    c.add_argument("addresses", help="the service's shards: host:port[,host:port...]")
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
    c.add_argument(
        "--token",
        default=os.environ.get("MILLPOND_TOKEN"),
        help="an admin token, for a service with tokens (default: $MILLPOND_TOKEN)",
    )
    c.add_argument("--tls-ca", help="PEM root certificate of a TLS service")
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
    with ReplayClient(args.addresses, token=args.token, tls=args.tls_ca, timeout_s=30) as client:
        config = client.configure_table(args.table, **settings)
    ratio = config.samples_per_insert
    print(
        f"millpond: table {config.name!r}: min_size {config.min_size}, samples_per_insert "
        f"{'none' if ratio is None else f'{ratio:g}'}"
        + (f", error_buffer {config.effective_error_buffer:g}" if ratio is not None else "")
        + (
            f", alpha {config.alpha:g}, beta {config.beta:g}"
            if config.sampler == "prioritized"
            else ""
        )
    )
    return 0
