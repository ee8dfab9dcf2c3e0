"""A shard and its clients on two hosts, across a slow, lossy, partitioned or vanished link.

Each test builds the hosts (``net_hosts``, network namespaces), starts a real
``millpond serve`` on the server host, and runs the client on the client host
(``_netclient.py``). Bounds asserted are the documented ones (docs/service.md, "Across a
network"), with margins for a loaded machine; they are behaviour, not speed.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
import torch

from millpond.learner.client._channels import (
    CONNECT_TIMEOUT_MS,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    RECONNECT_BACKOFF_MS,
)
from millpond.learner.client._shard_calls import SAMPLE_SLACK_S
from millpond.service.table import Table
from millpond.testing import pattern, stored_segments

pytestmark = pytest.mark.slow

OBS = [16]
L = 8


def finish(proc, out, timeout: float = 120.0) -> dict:
    """Wait for a client scenario to end; its report."""
    try:
        proc.wait(timeout)
    except Exception:
        proc.kill()
        raise
    assert proc.returncode == 0, f"the client failed ({proc.returncode})"
    return json.loads(out.read_text())


def check_rows(rows: dict, episodes: int) -> int:
    """Assert every sampled row is the one written for its (episode, step); returns the count."""
    eps, steps = rows["episode_id"].reshape(-1), rows["step"].reshape(-1)
    assert ((eps >= 0) & (eps < episodes) & (steps >= 0) & (steps < L)).all()
    assert torch.equal(rows["observation"], pattern(eps, steps, OBS))
    assert torch.equal(rows["next/observation"], pattern(eps, steps + 1, OBS))
    assert torch.equal(rows["action"], torch.stack([eps, steps], 1))
    assert torch.equal(rows["next/reward"], steps.to(torch.float32)[:, None])
    return len(eps)


def test_new_client_connects_and_stays_exact_at_100ms_round_trip_with_loss(net_hosts, tmp_path):
    net_hosts.serve()
    net_hosts.delay(50, jitter_ms=10)
    net_hosts.loss(0.01)
    out = tmp_path / "exact.json"
    episodes = 300
    proc = net_hosts.client(
        "exact", table="exact", out=str(out), episodes=episodes, L=L, obs=OBS,
        batches=8, batch_size=256,
    )  # fmt: skip
    report = finish(proc, out)
    assert "connect_error" not in report, report["connect_error"]
    assert report["colocated_shards"] == [], "the client took the shard for its own host"
    assert report["size"] == episodes * L
    rows = torch.load(str(out) + ".pt")
    assert check_rows(rows, episodes) == 8 * 256
    print(f"100 ms round trip, 1% loss: connected in {report['connect_s']:.2f} s")


#: How long the partition lasts (the issue's 20 s; shorter proves the same where the
#: environment sets it, as long as it outlasts the keepalive bound several times over).
PARTITION_S = float(os.environ.get("MILLPOND_TEST_PARTITION_S", "20"))
#: The documented bounds (docs/service.md, "Across a network"): a silent link is noticed
#: within the keepalive time plus its timeout; a healed link is found again within a
#: connection attempt plus the longest reconnect backoff.
DETECT_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
RECONNECT_S = (CONNECT_TIMEOUT_MS + RECONNECT_BACKOFF_MS[1]) / 1000
#: Room for a loaded 2-core machine on top of a bound.
MARGIN_S = 4.0


def stored_episodes(hosts, table: str) -> Counter:
    """How many times each episode is stored on the (stopped) shard, read from its files."""
    opened = Table.open(hosts.workdir / "shard" / "tables" / table)
    try:
        return Counter(ep for (ep, _first, _length, _start) in stored_segments(opened))
    finally:
        opened.close()


def first(items, predicate):
    return next((x for x in items if predicate(x)), None)


def stream_through(hosts, tmp_path, table: str, fault, **params) -> dict:
    """The ``stream`` scenario: once it writes and samples, ``fault()`` runs (returning when
    the client is to stop); the client's report."""
    out = tmp_path / f"{table}.json"
    proc = hosts.client(
        "stream", table=table, out=str(out), L=L, obs=OBS, batch_size=64, join_s=60, **params
    )
    assert proc.stdout.readline().startswith("READY")
    fault()
    proc.stdin.write("STOP\n")
    proc.stdin.flush()
    return finish(proc, out)


def test_partition_is_noticed_in_seconds_and_loses_or_duplicates_nothing(net_hosts, tmp_path):
    address = net_hosts.serve()
    timeout_s = 10.0  # the learner's deadline (ReplayClient timeout_s)
    marks: dict[str, float] = {}

    def partition() -> None:
        marks["cut"] = time.monotonic()
        net_hosts.partition()
        time.sleep(PARTITION_S)
        net_hosts.heal()
        marks["healed"] = time.monotonic()
        time.sleep(RECONNECT_S + MARGIN_S)

    report = stream_through(
        net_hosts, tmp_path, "part", partition, timeout_s=timeout_s, writer_timeout_s=120,
        close_s=60,
    )  # fmt: skip
    cut, healed = marks["cut"], marks["healed"]
    assert net_hosts.stop_server() == 0, net_hosts.server_log[-3000:]

    # Nothing hung; every written segment acknowledged, stored once.
    assert report["hung"] == []
    assert report["close"]["type"] is None, report["close"]
    assert report["events"]["write"] == [] or all(
        e["type"] is None for e in report["events"]["write"]
    )
    assert report["acked"] == report["written"] > 0
    stored = stored_episodes(net_hosts, "part")
    assert sorted(stored) == list(range(report["written"])), "an acknowledged segment is lost"
    assert max(stored.values()) == 1, "a segment is stored twice"
    assert report["wrong_rows"] == 0

    # The writer noticed within the keepalive bound: its log and its metric.
    bound = cut + DETECT_S + MARGIN_S
    log = report["log"]
    warned = first(log, lambda r: r["t"] > cut and r["level"] == "WARNING" and "writer" in r["msg"])
    assert warned is not None and address in warned["msg"], log
    assert warned["t"] <= bound, (warned["t"] - cut, warned)
    metric = first(report["metrics"], lambda m: m["t"] > cut and m["writer_unavailable_s"])
    assert metric is not None and metric["t"] <= bound, metric and metric["t"] - cut

    # The learner: its calls ended within their deadline, the shard named, in the log and
    # the client's metric within the keepalive bound.
    sampled = first(
        log, lambda r: r["t"] > cut and r["level"] == "WARNING" and "writer" not in r["msg"]
    )
    assert sampled is not None and address in sampled["msg"] and sampled["t"] <= bound, log
    down = first(report["metrics"], lambda m: m["t"] > cut and m["unavailable_shards"] == [0])
    assert down is not None and down["t"] <= bound
    for event in report["events"]["iterate"]:
        assert event["end"] - event["start"] <= timeout_s + MARGIN_S, event
        if event["type"] is not None:
            assert event["type"] == "ShardUnavailableError" and address in event["msg"], event

    # Both resumed after the heal, within a reconnect.
    resumed = first(
        report["metrics"], lambda m: m["t"] > healed and m["writer_unavailable_s"] is None
    )
    assert resumed is not None and resumed["t"] <= healed + RECONNECT_S + MARGIN_S
    # One outage, lasting from its notice to the writer's return.
    assert report["outages"] == 1
    outage_s = resumed["t"] - metric["t"]
    assert abs(report["unavailable_total_s"] - outage_s) <= MARGIN_S, (
        report["unavailable_total_s"],
        outage_s,
    )
    batch = first(report["batches"], lambda t: t > healed)
    assert batch is not None and batch <= healed + RECONNECT_S + MARGIN_S
    print(
        f"partition {PARTITION_S:.0f} s: writer warned after {warned['t'] - cut:.2f} s, metric "
        f"{metric['t'] - cut:.2f} s; learner warned {sampled['t'] - cut:.2f} s; writer back "
        f"{resumed['t'] - healed:.2f} s and learner {batch - healed:.2f} s after the heal; "
        f"{report['written']} segments written, 0 lost, 0 duplicated"
    )


def test_vanished_host_ends_every_call_with_an_error_naming_the_shard(net_hosts, tmp_path):
    address = net_hosts.serve()
    timeout_s, writer_timeout_s = 10.0, 12.0
    marks: dict[str, float] = {}

    def vanish() -> None:
        marks["gone"] = time.monotonic()
        net_hosts.vanish()
        time.sleep(writer_timeout_s + 2 * MARGIN_S)

    report = stream_through(
        net_hosts, tmp_path, "gone", vanish, timeout_s=timeout_s,
        writer_timeout_s=writer_timeout_s, close_s=5, probes=True,
        max_in_flight=64,  # a small window, full at once: the blocked write is the one timed
    )  # fmt: skip
    gone = marks["gone"]
    assert report["hung"] == []

    # Sample, info and iterate: each call ends within the keepalive bound and one
    # connection attempt (a call in flight learns of the dead link, then asks again once),
    # naming the shard.
    call_bound = DETECT_S + CONNECT_TIMEOUT_MS / 1000 + MARGIN_S
    events = report["events"]
    for kind in ("iterate", "probe"):
        failed = [e for e in events[kind] if e["end"] > gone and e["type"] is not None]
        assert failed, f"no {kind} call failed after the host vanished"
        for event in failed:
            assert event["type"] == "ShardUnavailableError", event
            assert address in event["msg"], event
        for event in events[kind]:
            assert event["end"] - event["start"] <= call_bound, event
    calls = {e["call"] for e in events["probe"] if e["type"] is not None}
    assert calls == {"sample", "info"}

    # The writer: its blocked write ends at its timeout, naming the shard and the writer;
    # close then ends at its own timeout.
    (write,) = events["write"]
    assert write["type"] == "DeadlineExceededError", write
    assert address in write["msg"] and "net-stream" in write["msg"], write
    assert write["end"] - max(write["start"], gone) <= writer_timeout_s + MARGIN_S, write
    close = report["close"]
    assert close["type"] == "DeadlineExceededError" and address in close["msg"], close
    assert close["end"] - close["start"] <= 5 + MARGIN_S
    first_failure = min(
        e["end"] for k in ("iterate", "probe") for e in events[k] if e["end"] > gone
    )
    print(
        f"vanished host: first sample/info/iterate error after {first_failure - gone:.2f} s, "
        f"longest call {max(e['end'] - e['start'] for k in ('iterate', 'probe') for e in events[k]):.2f} s; "
        f"write ended after {write['end'] - gone:.2f} s"
    )


def test_sample_timeout_bounds_the_call_on_a_slow_link(net_hosts, tmp_path):
    address = net_hosts.serve()
    out = tmp_path / "slow.json"
    timeout_s, obs = 3.0, [4096]  # rows of ~8 KiB with their next observations
    sizes = [128, 4096, 128]  # 1 MiB passes at 20 Mbit/s within 3 s; 32 MiB cannot
    proc = net_hosts.client(
        "slow", table="slow", out=str(out), L=L, obs=obs, capacity=20_000, episodes=600,
        timeout_s=timeout_s, sizes=sizes,
    )  # fmt: skip
    assert proc.stdout.readline().startswith("WRITTEN")
    net_hosts.rate(20)
    proc.stdin.write("GO\n")
    proc.stdin.flush()
    report = finish(proc, out)
    small, large, again = report["calls"]
    assert small["type"] is None and again["type"] is None, report["calls"]
    assert large["type"] == "DeadlineExceededError", large
    assert address in large["msg"] and "4096 rows" in large["msg"] and "MiB" in large["msg"]
    for call in report["calls"]:
        assert call["end"] - call["start"] <= timeout_s + SAMPLE_SLACK_S + MARGIN_S, call
    assert large["end"] - large["start"] >= timeout_s  # it was given its time
    assert report["wrong_rows"] == 0
    # The rate limiter counts what arrived: the answer cut off on the wire was given back.
    assert report["counted"] == report["rows"] == 256
    print(f"20 Mbit/s: {[round(c['end'] - c['start'], 2) for c in report['calls']]} s")
