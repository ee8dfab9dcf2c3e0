"""Damaged table files: a segment whose bytes changed on disk is dropped, counted, never served.

A real table is written and closed, its directory copied, and bytes flipped in the copy: in
a column file, in ``segments.bin`` (a record's episode id) or in ``slots.bin`` (a slot's
pointer). Reopened, the copy must return only rows equal to the inserted ones (each row
encodes its episode and step), lack exactly the damaged segment and count it; an untouched
copy recovers everything; a format-2 directory without ``checksums.bin`` (written before
checksums) opens and gets its checksums.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch

from millpond.config import TableConfig
from millpond.segments import Segment
from millpond.service.storage import CHECKSUMS_FILE, RECORD_WIDTH, RecordField, SlotColumn
from millpond.service.table import Table
from millpond.testing import pattern, pattern_segment, stored_segments

OBS_SHAPE = (4, 16, 16)  # 1 KiB rows
EPISODES = range(10, 22)


def make_segment(ep: int) -> Segment:
    return pattern_segment(ep, 3 * ep, 5 + ep % 7, OBS_SHAPE)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A closed table holding one segment per episode; ``{episode: (start slot, length)}``."""
    path = tmp_path_factory.mktemp("checksums") / "orig"
    table = Table.create(path, TableConfig.uniform("t", capacity=400, seed=0))
    for ep in EPISODES:
        table.insert_many([make_segment(ep)])
    where = {ep: (start, length) for (ep, _, length, start) in stored_segments(table)}
    table.close()
    return path, where


@pytest.fixture
def copy(original, tmp_path):
    path, _ = original
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    return dst


def flip(file, offset: int, mask: int = 0x5A) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def check_exact(table: Table) -> set[int]:
    """Every published row (read directly and sampled) equals the inserted one; the
    episodes held."""
    s = table.storage
    slots = s.published_step_slots()
    rows = s.slot_info(slots)
    ep = torch.from_numpy(rows[:, SlotColumn.EPISODE_ID])
    step = torch.from_numpy(rows[:, SlotColumn.STEP])
    now, nxt = s.gather(slots)
    assert torch.equal(now[("observation",)], pattern(ep, step, OBS_SHAPE))
    assert torch.equal(nxt[("observation",)], pattern(ep, step + 1, OBS_SHAPE))
    assert torch.equal(now[("action",)], torch.stack([ep, step], 1))
    assert torch.equal(now[("next", "reward")], step.to(torch.float32)[:, None])
    assert torch.equal(step - ep * 3, torch.from_numpy(slots - rows[:, SlotColumn.SEGMENT_START]))
    batch = table.sample(256)
    bep, bstep = batch["episode_id"], batch["step"]
    assert torch.equal(batch["observation"], pattern(bep, bstep, OBS_SHAPE))
    assert torch.equal(batch["next", "observation"], pattern(bep, bstep + 1, OBS_SHAPE))
    assert torch.equal(batch["action"], torch.stack([bep, bstep], 1))
    return set(ep.tolist())


def reopen(path, damaged_ep=None, where=None):
    table = Table.open(path)
    try:
        # The open checks records and pointers; the data's checksums are checked after it
        # (test_lazy_verification.py): check_exact reads the storage directly, past the
        # checks of samples, so every segment is checked first.
        table.verify_all()
        held = check_exact(table)
        expected = set(EPISODES) - ({damaged_ep} if damaged_ep is not None else set())
        assert held == expected
        if damaged_ep is None:
            assert table.storage.corrupted == []
        else:
            start, length = where[damaged_ep]
            # (The episode id is the damaged record's, maybe not the one inserted.)
            assert [c[1:] for c in table.storage.corrupted] == [(start, length)]
            assert table.size == sum(5 + e % 7 for e in expected)
        # Inserting afterwards works, and the table reopens the same.
        table.insert_many([make_segment(99)])
    finally:
        table.close()
    table = Table.open(path)
    try:
        assert check_exact(table) == expected | {99}
        assert table.storage.corrupted == []
    finally:
        table.close()


def test_an_untouched_copy_recovers_everything(copy, original):
    reopen(copy)


@pytest.mark.parametrize("column", ["observation.bin", "action.bin", "next.reward.bin"])
def test_a_flipped_byte_in_a_column_file_drops_its_segment(copy, original, column):
    _, where = original
    ep = 15
    start, length = where[ep]
    row_bytes = {"observation.bin": 1024, "action.bin": 16, "next.reward.bin": 4}[column]
    flip(copy / "data" / "columns" / column, (start + length // 2) * row_bytes + row_bytes - 1)
    reopen(copy, ep, where)


def test_a_flipped_tail_observation_drops_its_segment(copy, original):
    _, where = original
    start, length = where[12]
    flip(copy / "data" / "columns" / "observation.bin", (start + length) * 1024 + 600)
    reopen(copy, 12, where)


def _record_of(path, start: int) -> int:
    return int(np.fromfile(path / "data" / "slots.bin", dtype=np.int32)[start])


def test_a_flipped_episode_id_in_segments_bin_drops_its_segment(copy, original):
    _, where = original
    start, _ = where[17]
    record = _record_of(copy, start)
    flip(copy / "data" / "segments.bin", (record * RECORD_WIDTH + RecordField.EPISODE_ID) * 8, 1)
    reopen(copy, 17, where)


@pytest.mark.parametrize(
    "field", [RecordField.STEP_BASE, RecordField.WRITER], ids=["step_base", "writer"]
)
def test_other_flipped_record_fields_drop_their_segment(copy, original, field):
    _, where = original
    start, _ = where[13]
    record = _record_of(copy, start)
    flip(copy / "data" / "segments.bin", (record * RECORD_WIDTH + field) * 8 + 1, 4)
    reopen(copy, 13, where)


def test_a_flipped_slot_pointer_drops_its_segment(copy, original):
    _, where = original
    start = where[18][0]
    other = _record_of(copy, where[19][0])
    pointers = np.memmap(copy / "data" / "slots.bin", dtype=np.int32, mode="r+")
    pointers[start + 1] = other  # a slot of episode 18 now claims episode 19's record
    pointers.flush()
    del pointers
    reopen(copy, 18, where)


def test_a_flipped_checksum_drops_its_segment(copy, original):
    _, where = original
    record = _record_of(copy, where[11][0])
    flip(copy / "data" / CHECKSUMS_FILE, record * 8 + 3)
    reopen(copy, 11, where)


def test_a_table_without_checksums_gets_them_on_open(copy, original, caplog):
    _, where = original
    (copy / "data" / CHECKSUMS_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        table = Table.open(copy)
    try:
        assert check_exact(table) == set(EPISODES)
        assert table.storage.corrupted == []
        assert (copy / "data" / CHECKSUMS_FILE).exists()
        assert any("computed the checksums" in r.getMessage() for r in caplog.records)
    finally:
        table.close()
    # From now on the checksums guard the data.
    start = where[20][0]
    flip(copy / "data" / "columns" / "observation.bin", (start + 1) * 1024 + 5)
    reopen(copy, 20, where)


def test_verify_finds_the_damaged_segments_of_a_sample(copy, original):
    _, where = original
    table = Table.open(copy)
    try:
        slots = np.array([[where[ep][0], where[ep][0] + 1] for ep in EPISODES])
        assert table.storage.verify(slots).all()
        start = where[14][0]
        # A flip under a running table: the file's pages are the map's pages.
        flip(copy / "data" / "columns" / "action.bin", (start + 2) * 16)
        ok = table.storage.verify(slots)
        assert ok.shape == slots.shape
        assert ok.tolist() == [[ep != 14] * 2 for ep in EPISODES]
        assert not table.storage.verify(np.array([399])).any()  # no segment there
    finally:
        table.close()


def _damaged_live_table(tmp_path, config: TableConfig) -> tuple[Table, int]:
    """A table holding one segment per episode, one of them damaged on disk while it is
    open (the file's pages are the map's pages); returns it and the damaged episode."""
    table = Table.create(tmp_path / "live", config)
    for ep in EPISODES:
        table.insert_many([make_segment(ep)])
    where = {ep: start for (ep, _, _, start) in stored_segments(table)}
    damaged = 17
    flip(tmp_path / "live" / "data" / "columns" / "observation.bin", (where[damaged] + 1) * 1024)
    return table, damaged


def _assert_exact(batch) -> None:
    batch = batch.reshape(-1)
    ep, step = batch["episode_id"], batch["step"]
    assert torch.equal(batch["observation"], pattern(ep, step, OBS_SHAPE))
    assert torch.equal(batch["next", "observation"], pattern(ep, step + 1, OBS_SHAPE))
    assert torch.equal(batch["action"], torch.stack([ep, step], 1))


@pytest.mark.parametrize(
    "config",
    [
        TableConfig.uniform("t", 400, seed=0, verify_reads=True),
        TableConfig.prioritized("t", 400, seed=0, verify_reads=True),
        TableConfig.slices("t", 400, slice_len=3, seed=0, verify_reads=True),
    ],
    ids=["uniform", "prioritized", "slices"],
)
def test_verify_reads_never_serves_a_segment_damaged_while_the_table_runs(tmp_path, config):
    table, damaged = _damaged_live_table(tmp_path, config)
    try:
        for _ in range(20):
            batch = table.sample(64)
            _assert_exact(batch)  # the damaged rows would differ from the pattern
            assert damaged not in batch["episode_id"].unique().tolist()
        info = table.info()
        assert info["dropped_segments"] == 1
        assert info["size"] == sum(5 + e % 7 for e in EPISODES if e != damaged)
    finally:
        table.close()


def test_verify_reads_drops_a_damaged_segment_from_a_queue_batch(tmp_path):
    table, damaged = _damaged_live_table(tmp_path, TableConfig.queue("t", 400, verify_reads=True))
    try:
        delivered = []
        while table.size:
            batch = table.sample(min(30, table.size))
            _assert_exact(batch)
            delivered += batch["episode_id"].unique().tolist()
        # Every other segment is delivered once, in order; the damaged one never.
        assert delivered == [e for e in EPISODES if e != damaged]
        assert table.info()["dropped_segments"] == 1
    finally:
        table.close()


def test_without_verify_reads_a_damaged_live_segment_is_served_as_it_is(tmp_path):
    """What ``verify_reads`` is for: without it the damage reaches the learner until the
    table is reopened (recovery drops it then)."""
    table, damaged = _damaged_live_table(tmp_path, TableConfig.uniform("t", 400, seed=0))
    try:
        seen = torch.cat([table.sample(256)["episode_id"] for _ in range(4)])
        assert damaged in seen.tolist()
    finally:
        table.close()
