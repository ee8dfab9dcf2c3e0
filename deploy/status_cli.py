"""``millpond status ADDRESSES``: one screen of every shard and table of a running service.

Two ``Info`` snapshots ``--interval`` seconds apart give each table's insert and sample
rates; the rest is what the shards report now: size and fill, samples per insert achieved
against configured, who the rate limiter holds back and what for (in steps), the Insert
streams open, the last weights version. ``--watch`` refreshes the screen until Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from millpond.deploy.service_args import add_service_args, connect
from millpond.learner.client import ReplayClient
from millpond.service.rate_limiter import RateLimiter

_COLUMNS = (
    "shard",
    "table",
    "sampler",
    "size / capacity",
    "fill",
    "insert/s",
    "sample/s",
    "spi (target)",
    "writers",
    "held back",
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond status", description=__doc__)
    add_service_args(p, "bearer token for a service with tokens")
    p.add_argument("--table", help="only this table")
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between the two snapshots (rates)"
    )
    p.add_argument("--watch", action="store_true", help="refresh every --interval until Ctrl-C")
    return p


def run(args: argparse.Namespace, out=None) -> int:
    """Print the status screen (once, or refreshed with ``--watch``); returns an exit code."""
    out = out or sys.stdout
    if args.interval <= 0:
        print("millpond: error: --interval must be positive", file=sys.stderr)
        return 2
    with connect(args, timeout_s=10) as client:
        before, t0 = _snapshot(client, args.table), time.monotonic()
        try:
            while True:
                time.sleep(args.interval)
                now, t1 = _snapshot(client, args.table), time.monotonic()
                screen = render(before, now, t1 - t0)
                if args.watch:
                    out.write("\x1b[2J\x1b[H")  # clear the terminal, cursor home
                out.write(screen + "\n")
                out.flush()
                if not args.watch:
                    return 0
                before, t0 = now, t1
        except KeyboardInterrupt:
            return 0


def _snapshot(client: ReplayClient, table: str | None) -> dict[str, Any]:
    return client.info(table) if table is None else {"tables": {table: client.info(table)}}


def render(before: dict[str, Any], now: dict[str, Any], seconds: float) -> str:
    """The status table of snapshot ``now`` (``ReplayClient.info()`` form), with rates
    against ``before``, taken ``seconds`` earlier."""
    rows = []
    for name, table in sorted(now["tables"].items()):
        old = {s["shard"]: s for s in before["tables"].get(name, {}).get("shards", [])}
        for shard in table["shards"]:
            rows.append(_row(name, shard, old.get(shard["shard"]), seconds))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    weights = now.get("weights_version")
    published = weights is not None and weights >= 0  # -1: none published yet
    lines.append(f"weights version: {weights if published else 'none published'}")
    return "\n".join(lines)


def _row(table: str, shard: dict[str, Any], old: dict[str, Any] | None, seconds: float):
    address = shard["address"]
    if not shard.get("available", True) or "config" not in shard:
        why = shard.get("error") or "no answer"
        return [address, table, "-", "-", "-", "-", "-", "-", "-", f"unavailable: {why}"]
    config = shard["config"]
    size, capacity = shard["size"], config.capacity

    def rate(key: str) -> str:
        if old is None or "config" not in old or shard[key] < old[key]:
            return "-"  # no earlier count (or the table was reset meanwhile)
        return f"{(shard[key] - old[key]) / seconds:,.0f}"

    spi = config.samples_per_insert
    achieved = shard["samples"] / shard["inserts"] if shard["inserts"] else 0.0
    target = "none" if spi is None else f"{spi:g}"
    return [
        address,
        table,
        config.sampler,
        f"{size:,} / {capacity:,}",
        f"{size / capacity:.0%}" if capacity else "-",
        rate("inserts"),
        rate("samples"),
        f"{achieved:.2f} ({target})",
        str(shard.get("writers", 0)),
        held_back(shard),
    ]


def held_back(shard: dict[str, Any]) -> str:
    """Who the table holds back now, and what each side waits for."""
    config = shard["config"]
    limiter = RateLimiter(
        config.min_size,
        config.samples_per_insert,
        config.effective_error_buffer,
        counters=np.array([shard["inserts"], shard["samples"]], dtype=np.int64),
    )
    parts = []
    if shard.get("blocked_samples"):
        why = limiter.why_sample_waits(shard["size"]) or "a batch larger than what is stored"
        parts.append(f"{shard['blocked_samples']} sample(s) wait: {why}")
    if shard.get("blocked_inserts"):
        why = limiter.why_insert_waits(shard["size"]) or "a full queue (steps not yet delivered)"
        parts.append(f"{shard['blocked_inserts']} insert(s) wait: {why}")
    return "; ".join(parts) or "nobody"
