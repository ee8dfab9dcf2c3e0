"""A ``millpond launch`` job on the client host, its shard served on the server host
(``--replay``), through a partition of the link between them.

The job (driver, a local Ray instance, env actor and learner) runs in the client's
namespace; the shard is a ``millpond serve`` in the server's. Once the job collects, the
link is cut for ``MILLPOND_TEST_PARTITION_S`` seconds (20 by default), then healed: the job
goes on to its frame budget, its progress lines and ``summary.json`` say what happened, and
every segment the actor saw acknowledged is stored, once.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from millpond.service.table import Table
from millpond.testing import stored_segments

from .test_network_faults import DETECT_S, MARGIN_S, PARTITION_S, RECONNECT_S

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "configs" / "cartpole-dqn.yaml"
FRAMES = 12_000
#: A progress line, and one that names the unreachable shard.
PROGRESS = re.compile(r"^\[\s*[\d.]+s\] frames.*$", re.M)
UNAVAILABLE = re.compile(r"^\[.*UNAVAILABLE shard 0 for \d+s$", re.M)


def watch(log: Path, proc, until: float, seen) -> float | None:
    """Poll the job's output until ``until`` (monotonic) for ``seen(text)``; when it was
    first true, or ``None``."""
    while time.monotonic() < until:
        if seen(log.read_text()):
            return time.monotonic()
        assert proc.poll() is None, f"the job ended early: {log.read_text()[-4000:]}"
        time.sleep(0.1)
    return None


def test_launch_survives_a_partition_between_its_actors_and_its_shard(net_hosts, tmp_path):
    address = net_hosts.serve()
    run_dir = tmp_path / "run"
    launch = [
        sys.executable, "-m", "millpond.cli", "launch", str(CONFIG),
        "--replay", address, "--run-dir", str(run_dir),
        "--set", f"run.frames={FRAMES}", "--set", "run.status_every_s=1",
        "--set", "run.stop_at_return=null", "--set", "ray.num_cpus=2",
        "--set", "actors.num_actors=1", "--set", "replay.table.min_size=1000",
        "--set", "replay.table.capacity=20000",  # nothing evicted: every segment is counted
    ]  # fmt: skip
    proc = net_hosts.on_client("launch", *launch)
    log = net_hosts.workdir / "launch.out"
    started = watch(
        log, proc, time.monotonic() + 240, lambda t: re.search(r"frames +[1-9]\d{3,} ", t)
    )
    assert started is not None, f"the job did not collect: {log.read_text()[-4000:]}"

    cut = time.monotonic()
    net_hosts.partition()
    shown = watch(log, proc, cut + PARTITION_S, lambda t: UNAVAILABLE.search(t))
    time.sleep(max(0.0, cut + PARTITION_S - time.monotonic()))
    net_hosts.heal()
    healed = time.monotonic()
    lines_at_heal = len(PROGRESS.findall(log.read_text()))

    def cleared(text: str) -> bool:  # a progress line after the heal names no shard
        return any("UNAVAILABLE" not in line for line in PROGRESS.findall(text)[lines_at_heal:])

    back = watch(log, proc, healed + RECONNECT_S + 2 * MARGIN_S, cleared)
    proc.wait(300)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]

    # The job went on to its budget.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "frames" and summary["frames"] >= FRAMES
    assert summary["actor_restarts"] == summary["learner_restarts"] == 0

    # The progress line named the shard within the keepalive bound (and a first Info call
    # that waits it out), and stopped naming it within a reconnect of the heal.
    assert shown is not None, text[-4000:]
    assert shown - cut <= DETECT_S + RECONNECT_S + MARGIN_S, shown - cut
    assert back is not None, text[-4000:]
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert any(r["shards_unavailable"] == "1" for r in rows)
    assert rows[-1]["shards_unavailable"] == "0"

    # summary.json records the outage as the actor's writer, the learner and the rows saw it.
    assert summary["actors_shard_outages"] >= 1
    writer_s = summary["actors_shard_unavailable_s"]
    assert PARTITION_S - DETECT_S - MARGIN_S <= writer_s <= PARTITION_S + RECONNECT_S + MARGIN_S
    assert 0 < summary["learner_shard_unavailable_s"] <= PARTITION_S + RECONNECT_S + MARGIN_S
    assert 0 < summary["shard_unavailable_s"] <= PARTITION_S + RECONNECT_S + MARGIN_S

    # Nothing acknowledged is lost, nothing stored twice: the shard's segments, read from
    # its files once stopped, are those the actor's writer saw acknowledged.
    assert net_hosts.stop_server() == 0, net_hosts.server_log[-3000:]
    table = Table.open(net_hosts.workdir / "shard" / "tables" / "replay")
    try:
        stored = Counter((ep, first) for (ep, first, _n, _s) in stored_segments(table))
    finally:
        table.close()
    assert max(stored.values()) == 1, "a segment is stored twice"
    assert sum(stored.values()) == summary["actors_segments_acked"] > 0
    print(
        f"partition {PARTITION_S:.0f} s: shown after {shown - cut:.1f} s, cleared "
        f"{back - healed:.1f} s after the heal; writer unavailable "
        f"{summary['actors_shard_unavailable_s']} s ({summary['actors_shard_outages']} "
        f"outage), learner {summary['learner_shard_unavailable_s']} s, rows "
        f"{summary['shard_unavailable_s']} s; {summary['actors_segments_acked']} segments "
        f"acknowledged and stored, 0 lost, 0 duplicated; job {summary['wall_s']} s"
    )
