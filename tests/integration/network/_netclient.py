"""What the client host does in the network tests: ``python _netclient.py SCENARIO PARAMS``.

Runs inside the client's network namespace (``NetHosts.client``). ``PARAMS`` is JSON with
``address``, ``table``, ``out`` (where the report goes, JSON) and the scenario's own keys.
Times in the report are ``time.monotonic()``, the same clock as the test's.

- ``exact``: connect, write ``episodes`` pattern segments, sample ``batches`` batches; the
  sampled rows go to ``out + ".pt"`` for the test to compare with the reference.
- ``stream``: a writer writes pattern episodes, a learner iterates (and, with ``probes``,
  a third thread calls ``sample`` and ``info`` in turn), recording every call that failed
  or took long, the client's log and its metrics, until ``STOP`` arrives on stdin; then the
  writer is closed and the report written.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

import torch

from millpond import ReplayClient, TableConfig
from millpond.errors import MillpondError
from millpond.testing import pattern, pattern_segment

#: A call that took longer than this is recorded even when it succeeded.
SLOW_S = 1.0


class Recorder(logging.Handler):
    """The client's log records, with the time each was made."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.records.append(
                {"t": time.monotonic(), "level": record.levelname, "msg": record.getMessage()}
            )


def failure(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "msg": str(e)}


def exact(p: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {"start": time.monotonic()}
    client = ReplayClient(p["address"], timeout_s=30)
    try:
        client.create_table(TableConfig.uniform(p["table"], capacity=100_000, seed=3))
    except MillpondError as e:
        report["connect_error"] = failure(e)
        report["connect_s"] = time.monotonic() - report["start"]
        return report
    report["connect_s"] = time.monotonic() - report["start"]
    shape, length = p["obs"], p["L"]
    with client.writer(p["table"], writer_id="net-exact") as writer:
        for ep in range(p["episodes"]):
            seg = pattern_segment(ep, 0, length, shape)
            writer.write_segment(seg.steps, seg.tail, ep, 0)
    report["written"] = p["episodes"]
    rows = [client.sample(p["table"], p["batch_size"]) for _ in range(p["batches"])]
    batch = torch.cat(rows)
    keep = ["observation", ("next", "observation"), "action", ("next", "reward")]
    keep += ["episode_id", "step"]
    torch.save({k if isinstance(k, str) else "/".join(k): batch[k] for k in keep}, p["out"] + ".pt")
    report["colocated_shards"] = client.colocated_shards(p["table"])
    report["size"] = client.info(p["table"])["size"]
    report["end"] = time.monotonic()
    client.close()
    return report


def slow(p: dict[str, Any]) -> dict[str, Any]:
    """Fill a table, wait for ``GO`` (the link is slowed meanwhile), then time samples of
    each size in ``sizes`` with ``timeout_s``; the sampled rows are checked here."""
    client = ReplayClient(p["address"], timeout_s=30)
    table, shape, length = p["table"], p["obs"], p["L"]
    client.create_table(TableConfig.uniform(table, capacity=p["capacity"], seed=7))
    with client.writer(table, writer_id="net-slow") as writer:
        for ep in range(p["episodes"]):
            seg = pattern_segment(ep, 0, length, shape)
            writer.write_segment(seg.steps, seg.tail, ep, 0)
    before = client.info(table)["samples"]
    print("WRITTEN", flush=True)
    sys.stdin.readline()  # GO
    calls, rows, wrong = [], 0, 0
    for n in p["sizes"]:
        start = time.monotonic()
        try:
            batch = client.sample(table, n, timeout_s=p["timeout_s"])
            record = {"type": None}
            rows += batch.numel()
            wrong += wrong_rows(batch, shape)
        except MillpondError as e:
            record = failure(e)
        calls.append({"n": n, "start": start, "end": time.monotonic(), **record})
    time.sleep(2.0)  # a cancelled answer's steps are given back by then
    counted = client.info(table)["samples"] - before
    client.close()
    return {"calls": calls, "rows": rows, "wrong_rows": wrong, "counted": counted}


def throughput(p: dict[str, Any]) -> dict[str, Any]:
    """Steps per second a writer gets acknowledged, writing chunks of 16 segments of ``L``
    steps as fast as it can for ``seconds`` (after a second to warm up)."""
    from millpond.segments import Segment

    client = ReplayClient(p["address"], timeout_s=30)
    table, shape, length = p["table"], p["obs"], p["L"]
    client.create_table(TableConfig.uniform(table, capacity=1_000_000, seed=1))
    window = {k: p[k] for k in ("max_in_flight", "max_in_flight_bytes") if k in p}
    writer = client.writer(table, **window)
    chunk = [pattern_segment(ep, 0, length, shape) for ep in range(16)]
    segments = [Segment(s.steps, s.tail, s.episode_id, 0) for s in chunk]
    marks: list[tuple[float, int]] = []
    start = time.monotonic()
    while time.monotonic() - start < p["seconds"] + 1.0:
        writer.write_segments(segments)
        now = time.monotonic()
        if not marks and now - start >= 1.0:
            marks.append((now, writer.acked))
    marks.append((time.monotonic(), writer.acked))
    writer.close()
    client.close()
    (t0, a0), (t1, a1) = marks
    return {"steps_per_s": (a1 - a0) * length / (t1 - t0)}


def wrong_rows(batch, shape: list[int]) -> int:
    """Rows of ``batch`` whose observations are not those of their ``(episode, step)``."""
    eps, steps = batch["episode_id"].reshape(-1), batch["step"].reshape(-1)
    obs = batch["observation"].reshape(len(eps), *shape)
    nxt = batch["next", "observation"].reshape(len(eps), *shape)
    bad = (obs != pattern(eps, steps, shape)).flatten(1).any(1)
    bad |= (nxt != pattern(eps, steps + 1, shape)).flatten(1).any(1)
    return int(bad.sum())


def stream(p: dict[str, Any]) -> dict[str, Any]:
    recorder = Recorder()
    logging.getLogger("millpond").addHandler(recorder)
    logging.getLogger("millpond").setLevel(logging.INFO)
    table, shape, length = p["table"], p["obs"], p["L"]
    client = ReplayClient(p["address"], timeout_s=p["timeout_s"])
    client.create_table(TableConfig.uniform(table, capacity=p.get("capacity", 200_000), seed=5))
    window = {"max_in_flight": p["max_in_flight"]} if "max_in_flight" in p else {}
    writer = client.writer(table, writer_id="net-stream", timeout_s=p["writer_timeout_s"], **window)
    stop = threading.Event()
    events: dict[str, list[dict[str, Any]]] = {"write": [], "iterate": [], "probe": []}
    batches: list[float] = []
    wrong = [0]
    metrics: list[dict[str, Any]] = []
    written = [0]

    def write() -> None:
        ep = 0
        while not stop.is_set():
            seg = pattern_segment(ep, 0, length, shape)
            start = time.monotonic()
            try:
                writer.write_segment(seg.steps, seg.tail, ep, 0)
            except MillpondError as e:
                events["write"].append({"start": start, "end": time.monotonic(), **failure(e)})
                return
            took = time.monotonic() - start
            if took > SLOW_S:
                events["write"].append({"start": start, "end": start + took, "type": None})
            ep += 1
            written[0] = ep
            time.sleep(p.get("write_pause_s", 0.005))

    def learn() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                it = client.iterate(table, p["batch_size"], prefetch=2)
                for batch in it:
                    now = time.monotonic()
                    if now - start > SLOW_S:
                        events["iterate"].append({"start": start, "end": now, "type": None})
                    batches.append(now)
                    wrong[0] += wrong_rows(batch, shape)
                    if stop.is_set():
                        it.close()
                        return
                    start = time.monotonic()
            except MillpondError as e:
                events["iterate"].append({"start": start, "end": time.monotonic(), **failure(e)})
                time.sleep(0.5)

    def probe() -> None:
        calls = [
            ("sample", lambda: client.sample(table, p["batch_size"])),
            ("info", lambda: client.info(table)),
        ]
        while not stop.is_set():
            for name, call in calls:
                start = time.monotonic()
                try:
                    call()
                    record = {"type": None}
                except MillpondError as e:
                    record = failure(e)
                end = time.monotonic()
                if record["type"] is not None or end - start > SLOW_S:
                    events["probe"].append({"call": name, "start": start, "end": end, **record})
                time.sleep(0.2)

    def watch() -> None:
        while not stop.is_set():
            metrics.append(
                {
                    "t": time.monotonic(),
                    "acked": writer.acked,
                    "pending": writer.pending,
                    "writer_unavailable_s": writer.unavailable_s,
                    "unavailable_shards": client.unavailable_shards,
                }
            )
            time.sleep(0.25)

    threads = [threading.Thread(target=f, daemon=True) for f in (write, learn, watch)]
    if p.get("probes"):
        threads.append(threading.Thread(target=probe, daemon=True))
    for thread in threads:
        thread.start()
    while not (writer.acked >= 20 and len(batches) >= 5):
        time.sleep(0.05)
    print("READY", time.monotonic(), flush=True)
    sys.stdin.readline()  # STOP
    stop.set()
    for thread in threads:
        thread.join(p["join_s"])
    report: dict[str, Any] = {"hung": [t.name for t in threads if t.is_alive()]}
    start = time.monotonic()
    try:
        writer.close(timeout_s=p["close_s"])
        report["close"] = {"type": None}
    except MillpondError as e:
        report["close"] = failure(e)
    report["close"].update(start=start, end=time.monotonic())
    report.update(
        written=written[0],
        acked=writer.acked,
        outages=writer.outages,
        unavailable_total_s=writer.unavailable_total_s,
        batches=batches,
        wrong_rows=wrong[0],
        events=events,
        metrics=metrics,
        log=recorder.records,
    )
    return report


def main() -> int:
    scenario, params = sys.argv[1], json.loads(sys.argv[2])
    report = {"exact": exact, "stream": stream, "slow": slow, "throughput": throughput}[scenario](
        params
    )
    with open(params["out"], "w") as f:
        json.dump(report, f)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
