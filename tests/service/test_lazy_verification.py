"""A reopened table checks its segments' data after the open, never serving an unchecked row.

Real tables are written, closed, and a byte of one segment is flipped on disk. Reopened, the
table opens without reading the segments' data (every segment is left unverified, nothing is
dropped yet); then

* a sample that draws the damaged segment checks it first and drops it, exactly as the
  open used to (unpublished, counted in ``dropped_segments``, logged), in process and
  through a served shard;
* the background verifier finds it without any sample and leaves nothing unverified;
* a writer overwriting slots, samplers updating priorities and the verifier running at once
  serve only rows equal to those written (a plain-Python record of the writes);
* a ReadTable snapshot and an export leave it out.

Each would fail if the reopen skipped the checks: the damaged rows differ from the pattern
every row of these tables encodes (its episode and step).
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.errors import InvalidConfigError
from millpond.service import verifier
from millpond.service.export import export_ted
from millpond.service.server import ServerConfig, create_server
from millpond.service.snapshot import pin
from millpond.service.table import Table
from millpond.testing import pattern, pattern_segment, stored_segments

OBS = (4, 16, 16)  # 1 KiB rows
EPISODES = range(10, 40)
DAMAGED = 17
LOG = "millpond.service.storage"


def _length(ep: int) -> int:
    return 5 + ep % 7


CONFIGS = {
    "uniform": TableConfig.uniform("t", 600, seed=0),
    "prioritized": TableConfig.prioritized("t", 600, seed=0),
    "slices": TableConfig.slices("t", 600, slice_len=3, seed=0),
    "queue": TableConfig.queue("t", 600),
}


def _damaged_dir(path, config: TableConfig, damaged: int = DAMAGED):
    """A closed table of one segment per episode, one observation byte of ``damaged``
    flipped on disk; returns ``{episode: start slot}``."""
    table = Table.create(path, config)
    for ep in EPISODES:
        table.insert_many([pattern_segment(ep, 3 * ep, _length(ep), OBS)])
    where = {ep: start for (ep, _, _, start) in stored_segments(table)}
    table.close()
    with open(path / "data" / "columns" / "observation.bin", "r+b") as f:
        f.seek((where[damaged] + 2) * 1024 + 7)
        b = f.read(1)[0]
        f.seek((where[damaged] + 2) * 1024 + 7)
        f.write(bytes([b ^ 0x5A]))
    return where


def _assert_exact(batch, written: dict[int, tuple[int, int]] | None = None) -> None:
    """Every row is the one written: the pattern of its (episode, step), a step that was
    written (``written``: episode -> (first step, length), if given)."""
    batch = batch.reshape(-1)
    ep, step = batch["episode_id"], batch["step"]
    assert torch.equal(batch["observation"], pattern(ep, step, OBS))
    assert torch.equal(batch["next", "observation"], pattern(ep, step + 1, OBS))
    assert torch.equal(batch["action"], torch.stack([ep, step], 1))
    if written is not None:
        for e, s in zip(ep.tolist(), step.tolist()):
            first, n = written[e]
            assert first <= s < first + n, (e, s)


def _dropped_logged(caplog) -> bool:
    return any(
        r.name == LOG and f"episode {DAMAGED} in slots" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_sample_checks_an_unverified_segment_first_and_drops_it(tmp_path, kind, caplog):
    where = _damaged_dir(tmp_path / "t", CONFIGS[kind])
    table = Table.open(tmp_path / "t", verify="reads")
    try:
        # The open read no segment's data: all unverified, none dropped yet.
        info = table.info()
        assert info["unverified_segments"] == len(EPISODES)
        assert info["dropped_segments"] == 0 and table.storage.corrupted == []
        with caplog.at_level(logging.WARNING, logger=LOG):
            seen = set()
            while table.size and (kind != "queue" or len(seen) < len(EPISODES) - 1):
                batch = table.sample(min(64, table.size))
                _assert_exact(batch)
                seen |= set(batch["episode_id"].unique().tolist())
                if kind != "queue" and len(seen) == len(EPISODES) - 1:
                    break
        assert DAMAGED not in seen
        assert seen == set(EPISODES) - {DAMAGED}
        info = table.info()
        assert info["dropped_segments"] == 1
        assert [c[1:] for c in table.storage.corrupted] == [(where[DAMAGED], _length(DAMAGED))]
        assert _dropped_logged(caplog)
        if kind != "queue":
            assert info["size"] == sum(_length(e) for e in EPISODES if e != DAMAGED)
    finally:
        table.close()


def test_the_background_verifier_finds_the_damage_without_a_sample(tmp_path, caplog):
    where = _damaged_dir(tmp_path / "t", CONFIGS["uniform"])
    with caplog.at_level(logging.INFO):
        table = Table.open(tmp_path / "t")  # verify="background", the default
        try:
            deadline = time.monotonic() + 60  # a bound against a hang, not a speed target
            while table.info()["unverified_segments"] and time.monotonic() < deadline:
                time.sleep(0.01)
            info = table.info()
            assert info["unverified_segments"] == 0
            assert info["dropped_segments"] == 1
            assert [c[1:] for c in table.storage.corrupted] == [(where[DAMAGED], _length(DAMAGED))]
            assert info["size"] == sum(_length(e) for e in EPISODES if e != DAMAGED)
            assert _dropped_logged(caplog)
            assert info["samples"] == 0  # nothing was sampled: the thread found it
        finally:
            table.close()
    assert any("verified the 30 segments" in r.getMessage() for r in caplog.records)


def test_a_served_shard_never_returns_the_unverified_damaged_rows(tmp_path):
    shard = tmp_path / "shard"
    _damaged_dir(shard / "tables" / "t", CONFIGS["uniform"])
    server, port = create_server(ServerConfig(dir=str(shard), verify="reads"))
    try:
        assert server.shard.table("t").info()["unverified_segments"] == len(EPISODES)
        with ReplayClient([f"127.0.0.1:{port}"], colocated=False) as client:
            seen: set[int] = set()
            for _ in range(40):
                batch = client.sample("t", 64)
                _assert_exact(batch)
                seen |= set(batch["episode_id"].unique().tolist())
            assert DAMAGED not in seen and len(seen) == len(EPISODES) - 1
            assert client.info("t")["dropped_segments"] == 1
    finally:
        server.stop(grace=0)


def test_snapshots_and_exports_leave_an_unverified_damaged_segment_out(tmp_path):
    _damaged_dir(tmp_path / "t", CONFIGS["uniform"])
    for read in ("snapshot", "export"):
        shutil.rmtree(tmp_path / "copy", ignore_errors=True)
        shutil.rmtree(tmp_path / "export", ignore_errors=True)
        shutil.copytree(tmp_path / "t", tmp_path / "copy")
        table = Table.open(tmp_path / "copy", verify="reads")
        try:
            if read == "snapshot":
                snap = pin(table)
                eps = []
                for i, j in snap.groups(1 << 20):
                    packed = snap.read(table, i, j)
                    assert packed is not None
                    for k, ep in enumerate(packed.episode_ids.tolist()):
                        eps.append(ep)
                        first = int(packed.first_steps[k])
                        start = int(packed.lengths[:k].sum())
                        steps = torch.arange(first, first + int(packed.lengths[k]))
                        rows = packed.steps[("observation",)][start : start + len(steps)]
                        assert torch.equal(rows, pattern(torch.full_like(steps, ep), steps, OBS))
            else:
                ted = export_ted(table, tmp_path / f"export-{read}")
                _assert_exact(ted)
                eps = ted["episode_id"].unique().tolist()
            assert sorted(set(eps)) == [e for e in EPISODES if e != DAMAGED]
            assert table.info()["dropped_segments"] == 1
        finally:
            table.close()


def test_writer_samplers_and_verifier_at_once_serve_only_what_was_written(tmp_path, monkeypatch):
    """A writer overwriting the oldest segments, two samplers updating priorities and the
    background verifier (small chunks, slowed down, so that they overlap) run together."""
    monkeypatch.setattr(verifier, "CHUNK_BYTES", 16 << 10)
    config = TableConfig.prioritized("t", 600, seed=0)
    damaged = EPISODES[-1]  # the newest: the writer never reaches it
    _damaged_dir(tmp_path / "t", config, damaged)
    written = {ep: (3 * ep, _length(ep)) for ep in EPISODES if ep != damaged}
    table = Table.open(tmp_path / "t", verify_rate_mb=0.3)  # ~1.5 s for the table
    errors: list[BaseException] = []
    stop = threading.Event()
    served = [0]

    def sampler(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                batch = table.sample(32)
                for e, _s in zip(batch["episode_id"].tolist(), batch["step"].tolist()):
                    assert e != damaged
                _assert_exact(batch, dict(written))
                served[0] += 32
                table.update_priorities(
                    batch["index", "slot"],
                    batch["index", "generation"],
                    torch.tensor([rng.random() + 0.1 for _ in range(32)]),
                )
        except BaseException as e:
            errors.append(e)

    def writer() -> None:
        try:
            for ep in range(100, 160):  # wraps the ring: evicts the oldest, unverified
                n = _length(ep)
                written[ep] = (2 * ep, n)  # recorded before it can be sampled
                table.insert_many([pattern_segment(ep, 2 * ep, n, OBS)])
                time.sleep(0.03)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=sampler, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=writer))
    try:
        assert table.info()["unverified_segments"] > 0
        for t in threads:
            t.start()
        threads[-1].join()
        deadline = time.monotonic() + 60
        while table.info()["unverified_segments"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stop.set()
        for t in threads[:-1]:
            t.join()
        assert not errors, errors
        assert served[0] > 0
        info = table.info()
        assert info["unverified_segments"] == 0
        assert [c[0] for c in table.storage.corrupted] == [damaged]
        # What is stored afterwards is exactly what was written and not evicted.
        for ep, first, n, _start in stored_segments(table):
            assert written[ep] == (first, n)
        _assert_exact(table.sample(256), written)
    finally:
        stop.set()
        table.close()


def test_verify_open_checks_everything_before_the_open_returns(tmp_path):
    where = _damaged_dir(tmp_path / "t", CONFIGS["uniform"])
    table = Table.open(tmp_path / "t", verify="open")
    try:
        assert table.info()["unverified_segments"] == 0
        assert [c[1:] for c in table.storage.corrupted] == [(where[DAMAGED], _length(DAMAGED))]
    finally:
        table.close()


def test_unknown_verify_settings_are_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match="verify"):
        Table.open(tmp_path, verify="never")
    with pytest.raises(InvalidConfigError, match="verify_rate_mb"):
        ServerConfig(dir=str(tmp_path), verify_rate_mb=-1)
    assert np.isfinite(verifier.CHUNK_BYTES)
