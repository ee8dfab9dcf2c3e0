"""The compact slot metadata (table format 2): a 4-byte record pointer per slot, one record
per segment, records reused after eviction; recovery from torn metadata; values that do not
fit refused; older formats refused; every file of a table directory counted."""

import json

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import Table, TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError, StorageCorruptedError
from millpond.segments import Segment
from millpond.service.storage import (
    MAX_CAPACITY,
    RECORD_WIDTH,
    SLOT_EMPTY,
    SLOT_STEP,
    SLOT_TAIL,
    SegmentStorage,
    SlotColumn,
)
from millpond.service.table_files import DISK_PARTS, FORMAT, disk_usage
from millpond.testing import stored_segments


def segment(n=3, ep=0, first=0, obs_dim=4):
    """Observations encode (episode, step), so a row read from the wrong slot shows."""
    steps_idx = torch.arange(first, first + n + 1, dtype=torch.float64)
    obs = (steps_idx + 1000.0 * ep)[:, None].expand(n + 1, obs_dim).to(torch.float32)
    term = torch.zeros(n, 1, dtype=torch.bool)
    term[-1] = True
    steps = TensorDict(
        {
            "observation": obs[:-1],
            "action": torch.arange(n, dtype=torch.int64),
            "next": {
                "reward": torch.ones(n, 1),
                "terminated": term,
                "truncated": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        [n],
    )
    return steps, TensorDict({"observation": obs[-1]}, [])


def test_metadata_is_four_bytes_per_slot_plus_a_record_per_segment(tmp_path):
    capacity = 1000
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", capacity, seed=0))
    t.insert_many([Segment(*segment(n=4, ep=e), episode_id=e) for e in range(10)])
    data = tmp_path / "t" / "data"
    assert (data / "slots.bin").stat().st_size == 4 * capacity
    assert RECORD_WIDTH * 8 == 64
    # Room for the most segments the ring can hold (a segment that continues another on its
    # tail slot takes one slot of its own), plus record 0 (zero: what pointer 0 reads).
    assert (data / "segments.bin").stat().st_size == 64 * (capacity + 1)
    # The records file has room for capacity segments but only its written pages count.
    assert (data / "segments.bin").stat().st_blocks * 512 <= 8192
    t.close()


def test_slot_info_decodes_steps_tails_and_empty_slots(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", 20, seed=0))
    t.insert_many(
        [Segment(*segment(n=3, ep=7, first=10), episode_id=7, first_step=10, sequence=5)],
        writer_id="w",
    )
    rows = t.storage.slot_info(np.arange(6))
    gen = int(rows[0, SlotColumn.GENERATION])
    assert gen > 0
    assert rows[:4, SlotColumn.GENERATION].tolist() == [gen] * 4
    assert rows[:4, SlotColumn.EPISODE_ID].tolist() == [7] * 4
    assert rows[:4, SlotColumn.STEP].tolist() == [10, 11, 12, 13]
    assert rows[:4, SlotColumn.KIND].tolist() == [SLOT_STEP] * 3 + [SLOT_TAIL]
    assert rows[:4, SlotColumn.SEGMENT_START].tolist() == [0] * 4
    assert rows[:4, SlotColumn.SEGMENT_LENGTH].tolist() == [3] * 4
    assert rows[:4, SlotColumn.SEQUENCE].tolist() == [5] * 4
    assert (rows[:4, SlotColumn.WRITER] != 0).all()
    assert (rows[4:] == 0).all() and rows[4, SlotColumn.KIND] == SLOT_EMPTY
    # Any shape of slots, as slices tables sample them.
    assert t.storage.slot_info(np.array([[0, 1], [2, 3]])).shape == (2, 2, len(SlotColumn))
    assert t.storage.generations(np.array([0, 3, 4])).tolist() == [gen, gen, 0]
    t.close()


def test_records_are_reused_so_few_are_ever_written(tmp_path):
    """A ring that wraps many times writes no more records than it holds segments at once."""
    capacity = 400
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", capacity, seed=0))
    rng = np.random.default_rng(0)
    for e in range(600):
        t.insert(*segment(n=int(rng.integers(1, 8)), ep=e), episode_id=e)
    live_most = capacity // 2  # length-1 segments would be 2 slots each
    written = t.storage._next_record - 1  # records 1 .. next - 1 were ever handed out
    assert written < live_most
    # Segments of 1-7 steps (2-8 slots, 5 on average): about 80 live, never many more.
    assert written <= 2 * len(stored_segments(t))
    assert len(t.storage._free) == written - len(stored_segments(t))
    # Every sampled row is its own (episode, step), read through the reused records.
    s = t.sample(256)
    want = s["step"].to(torch.float32) + 1000.0 * s["episode_id"].to(torch.float32)
    assert torch.equal(s["observation"][:, 0], want)
    assert torch.equal(s["next", "observation"][:, 0], want + 1)
    before = stored_segments(t)
    t.close()
    t = Table.open(tmp_path / "t")
    assert stored_segments(t) == before
    t.close()


def test_restart_rebuilds_everything_from_the_metadata_files(tmp_path):
    """A table that was never closed (no writers.json, no meta.json counters) reopens from
    its slot pointers and segment records: segments, writer marks, open episodes, cursor."""
    path = tmp_path / "t"
    t = Table.create(path, TableConfig.uniform("t", 200, seed=0))
    segs = [Segment(*segment(n=3, ep=e), episode_id=e, sequence=e + 1) for e in range(5)]
    t.insert_many(segs, writer_id="actor-0")
    steps, tail = segment(n=2, ep=9)
    steps["next", "terminated"][:] = False  # episode 9 goes on
    t.insert(steps, tail, episode_id=9, first_step=0)
    before = stored_segments(t)
    cursor = t.storage.cursor
    t.storage.flush()  # as a killed process leaves it: the page cache holds the writes
    u = Table.open(path)
    assert stored_segments(u) == before
    assert u.storage.cursor == cursor
    assert u.writer_sequence("actor-0") == 5
    # Episode 9 is open, its next step 2 (table.extend may keep more per open episode;
    # a reopened table reads them from its data, once verified, when extend needs them).
    episodes = u._open_episodes()
    assert list(episodes) == [9]
    state = episodes[9]
    assert (state[0] if isinstance(state, tuple) else state) == 2
    gens = u.insert_many(segs, writer_id="actor-0")  # re-sent: nothing stored twice
    assert (gens == 0).all() and stored_segments(u) == before
    u.close()
    t.storage.close()


def _commit(storage: SegmentStorage, record: int, start: int, length: int, gen: int) -> None:
    storage.records[record] = [0, 1, -start, start, length, start + length, 0, 0]
    storage.slot_records[start : start + length + 1] = record
    storage.records[record, 0] = gen


def test_recovery_drops_torn_segments_and_stale_pointers(tmp_path):
    path = tmp_path / "t"
    t = Table.create(path, TableConfig.uniform("t", 100, seed=0))
    for e in range(4):
        t.insert(*segment(n=3, ep=e), episode_id=e)  # slots 0-3, 4-7, 8-11, 12-15
    s = t.storage
    recs = s.slot_records[[0, 4, 8, 12]]
    # A later segment's publication interrupted after its pointers, before its marker:
    s.slot_records[20:24] = 9
    # A segment whose slots were half taken over by another record (a torn overwrite):
    s.slot_records[5] = 9
    # A record marked published whose range runs past the ring:
    s.records[7] = [99, 1, -98, 98, 5, 103, 0, 0]
    s.flush()
    u = Table.open(path)
    kept = stored_segments(u)
    assert sorted(k[3] for k in kept) == [0, 8, 12]
    assert u.size == 9
    assert (u.storage.slot_records[4:8] == 0).all() and (u.storage.slot_records[20:24] == 0).all()
    assert u.storage.records[recs[1], 0] == 0 and u.storage.records[7, 0] == 0
    # Freed records are handed out again, and nothing else is lost.
    u.insert(*segment(n=2, ep=50), episode_id=50)
    assert len(stored_segments(u)) == 4
    u.close()
    t.storage.close()


def test_recovery_of_a_bare_storage(tmp_path):
    s = SegmentStorage(tmp_path / "d", 50, None)
    _commit(s, 3, 10, 4, gen=7)
    _commit(s, 1, 20, 2, gen=9)
    s.slot_records[21] = 0  # torn
    s.close()
    s = SegmentStorage(tmp_path / "d", 50, None)
    got = s.recover()
    assert got.starts.tolist() == [10] and got.generations.tolist() == [7]
    assert s.cursor == 15
    assert s._next_record == 4 and sorted(s._free) == [1, 2]
    s.close()


def test_steps_past_the_int64_range_are_refused_not_wrapped(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", 100, seed=0))
    t.insert(*segment(n=3, ep=1), episode_id=1)
    top = 2**63 - 1
    with pytest.raises(InvalidDataError, match=f"first_step {top - 2} of episode 2"):
        t.insert(*segment(n=3, ep=2), episode_id=2, first_step=top - 2)
    assert t.size == 3 and len(stored_segments(t)) == 1
    # The largest first step that fits: the tail's step is 2**63 - 1, exactly.
    t.insert(*segment(n=3, ep=3), episode_id=3, first_step=top - 3)
    ((start,),) = [k[3:] for k in stored_segments(t) if k[0] == 3]
    rows = t.storage.slot_info(np.arange(start, start + 4))
    assert rows[:, SlotColumn.STEP].tolist() == [top - 3, top - 2, top - 1, top]
    s = t.sample(64)
    assert set(s["step"][s["episode_id"] == 3].tolist()) <= {top - 3, top - 2, top - 1}
    t.close()


def test_capacity_beyond_int32_pointers_is_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match=f"capacity \\({MAX_CAPACITY + 1}\\)"):
        SegmentStorage(tmp_path / "d", MAX_CAPACITY + 1, None)
    assert not (tmp_path / "d").exists()


def test_older_format_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "t"
    Table.create(path, TableConfig.uniform("t", 100)).close()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == FORMAT == 2
    meta["format"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StorageCorruptedError, match="format 1.*format 2 only.*format changed"):
        Table.open(path)
    meta["format"] = 99
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StorageCorruptedError, match="unknown format 99"):
        Table.open(path)


def test_missing_or_resized_metadata_files_are_refused(tmp_path):
    path = tmp_path / "t"
    t = Table.create(path, TableConfig.uniform("t", 100))
    t.insert(*segment(), episode_id=0)
    t.close()
    records = path / "data" / "segments.bin"
    good = records.read_bytes()
    records.write_bytes(good[:-64])
    with pytest.raises(StorageCorruptedError, match="segments.bin has"):
        Table.open(path)
    records.unlink()
    with pytest.raises(StorageCorruptedError, match="segments.bin is missing"):
        Table.open(path)


def test_disk_usage_counts_every_file_of_the_table(tmp_path):
    path = tmp_path / "t"
    t = Table.create(path, TableConfig.prioritized("t", 300, seed=0))
    for e in range(20):
        t.insert(*segment(n=5, ep=e), episode_id=e)
    t.checkpoint()
    usage = disk_usage(path, t.spec)
    assert set(usage) == set(DISK_PARTS)
    every_file = sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())
    assert sum(usage.values()) == every_file
    assert usage["observations"] > 0 and usage["step fields"] > 0
    assert usage["slot pointers"] > 0 and usage["segment records"] > 0
    assert usage["sampler"] > 0  # priorities.bin
    assert usage["table files"] > 0  # meta.json, writers.json, counters.bin, index.json
    t.close()
