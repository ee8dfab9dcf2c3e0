"""The arguments of the CLI commands that talk to a running service, and the client they
open (``millpond status``, ``millpond table``)."""

from __future__ import annotations

import argparse
import os

from millpond.learner.client import ReplayClient


def add_service_args(parser: argparse.ArgumentParser, token_help: str) -> None:
    """``ADDRESSES``, ``--token`` (default ``$MILLPOND_TOKEN``) and ``--tls-ca``."""
    parser.add_argument("addresses", help="the service's shards: host:port[,host:port...]")
    parser.add_argument(
        "--token",
        default=os.environ.get("MILLPOND_TOKEN"),
        help=f"{token_help} (default: $MILLPOND_TOKEN)",
    )
    parser.add_argument("--tls-ca", help="PEM root certificate of a TLS service")


def connect(args: argparse.Namespace, timeout_s: float) -> ReplayClient:
    """A client of the service ``args`` names (on the wire: it reads no files)."""
    return ReplayClient(
        args.addresses, token=args.token, tls=args.tls_ca, colocated=False, timeout_s=timeout_s
    )
