"""Writers' regions: an episode sent a step at a time is stored one slot a step, exactly.

Every value of a :func:`~millpond.testing.pattern_segment` encodes its ``(episode, step)``,
so a sampled row is checked against that independent reference; :func:`stored_segments`
checks the slot layout on disk (whole segments; a tail shared only with its continuation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from millpond.config import TableConfig
from millpond.segments import pack
from millpond.service.table import Table
from millpond.testing import (
    actor_chunks,
    pattern,
    pattern_segment,
    ring_ages,
    stored_segments,
)

OBS = (3,)


def _per_step(lanes: int, steps: int, episode_len: int, *, first_seq: int = 1, base: int = 0):
    """Inserts as an actor with ``lanes`` lanes sends them at ``chunk_len: 1``: one
    one-step segment per lane per insert, each with the next sequence number."""
    seq = first_seq
    for t in range(steps):
        batch = []
        for lane in range(lanes):
            ep, first = base + lane * 10_000 + t // episode_len, t % episode_len
            s = pattern_segment(ep, first, 1, OBS, terminated=first == episode_len - 1)
            s.sequence = seq
            seq += 1
            batch.append(s)
        yield batch


def _published_slots(table: Table) -> int:
    return int(np.count_nonzero(table.storage.slot_records))


def _check_samples(table: Table, n: int = 512) -> None:
    td = table.sample(n)
    ep, st = td["episode_id"], td["step"]
    assert torch.equal(td["observation"], pattern(ep, st, OBS))
    assert torch.equal(td["next", "observation"], pattern(ep, st + 1, OBS))
    assert torch.equal(td["action"], torch.stack([ep, st], 1))


def test_one_step_segments_take_one_slot_a_step_and_sample_exactly(tmp_path):
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    for batch in _per_step(lanes=4, steps=400, episode_len=50):
        table.insert_many(batch, writer_id="actor-0")
    steps = 4 * 400
    assert table.size == steps
    segments = stored_segments(table)  # whole segments, tails shared only with continuations
    assert len(segments) == steps
    # One slot a step, plus a tail per episode and per region a lane moved on from: 1,600
    # steps in 32 episodes. (Without regions: 3,200 slots.)
    assert _published_slots(table) <= steps * 1.05
    _check_samples(table)
    before = segments
    table.close()
    table = Table.open(tmp_path / "t")
    assert table.storage.corrupted == []
    assert stored_segments(table) == before
    _check_samples(table)
    table.close()


def test_anonymous_inserts_keep_a_tail_slot_per_segment(tmp_path):
    """Without a writer id, inserts may run at once: no regions, L + 1 slots a segment."""
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    for batch in _per_step(lanes=4, steps=50, episode_len=50):
        for s in batch:
            s.sequence = None
        table.insert_many(batch)
    assert _published_slots(table) == 2 * 200
    _check_samples(table)
    table.close()


def test_a_lanes_chunks_in_one_insert_share_their_tails_in_a_new_region(tmp_path):
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    segs = []
    for first in range(0, 12, 3):  # four chunks of episode 7, all in one insert
        s = pattern_segment(7, first, 3, OBS, terminated=first == 9)
        s.sequence = first + 1
        segs.append(s)
    table.insert_many(segs, writer_id="w")
    starts = sorted(start for (_, _, _, start) in stored_segments(table))
    assert np.diff(starts).tolist() == [3, 3, 3]  # each starts on the previous one's tail
    assert _published_slots(table) == 12 + 1
    _check_samples(table)
    table.close()


def test_the_ring_wraps_many_times_through_regions(tmp_path):
    capacity = 2048
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", capacity, seed=0))
    # Three lanes: regions of 10 slots (1/64 of the ring over the lanes), 9 steps each.
    for batch in _per_step(lanes=3, steps=4000, episode_len=37):
        table.insert_many(batch, writer_id="actor-0")
    segments = stored_segments(table)
    assert table.size == sum(k[2] for k in segments) > capacity // 2
    _check_samples(table)
    table.close()
    table = Table.open(tmp_path / "t")
    assert table.storage.corrupted == []
    assert stored_segments(table) == segments
    _check_samples(table)
    table.close()


def test_a_continuation_whose_first_observation_differs_is_never_joined(tmp_path):
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    a = pattern_segment(3, 0, 4, OBS, terminated=False)
    a.sequence = 1
    table.insert_many([a], writer_id="w")
    b = pattern_segment(3, 4, 4, OBS)
    b.steps["observation"][0] += 1  # not the tail the first segment stored
    b.sequence = 2
    table.insert_many([b], writer_id="w")
    (sa, sb) = sorted(start for (_, _, _, start) in stored_segments(table))
    assert sb != sa + 4  # its own first slot: the first segment's tail is kept as it was
    td = table.sample(256)
    first = td["step"] == 3
    assert first.any()
    nxt = pattern(td["episode_id"][first], td["step"][first] + 1, OBS)
    assert torch.equal(td["next", "observation"][first], nxt)
    table.close()


def test_a_damaged_continuation_leaves_its_predecessor_whole(tmp_path):
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    for first, seq in ((0, 1), (4, 2)):
        s = pattern_segment(5, first, 4, OBS, terminated=first == 4)
        s.sequence = seq
        table.insert_many([s], writer_id="w")
    (sa, sb) = sorted(start for (_, _, _, start) in stored_segments(table))
    assert sb == sa + 4
    table.close()
    column = tmp_path / "t" / "data" / "columns"
    files = [f for f in column.iterdir() if f.name.startswith("action")]
    with open(files[0], "r+b") as f:  # the continuation's last action
        f.seek((sb + 3) * 16)
        f.write(b"\xff" * 16)
    table = Table.open(tmp_path / "t")
    table.verify_all()  # the data's checksums are checked after the open
    assert [c[0] for c in table.storage.corrupted] == [5]
    assert list(stored_segments(table)) == [(5, 0, 4, sa)]  # whole: its tail is its own
    _check_samples(table, 64)
    table.close()


def test_slices_run_across_shared_tails(tmp_path):
    table = Table.create(tmp_path / "t", TableConfig.slices("t", 1 << 14, 5, seed=0))
    for batch in _per_step(lanes=3, steps=120, episode_len=40):
        table.insert_many(batch, writer_id="w")
    td = table.sample(256)
    ep, st = td["episode_id"], td["step"]
    assert torch.all(ep == ep[:, :1]) and torch.all(st == st[:, :1] + torch.arange(5))
    nxt = pattern(ep.reshape(-1), st.reshape(-1) + 1, OBS)
    assert torch.equal(td["next", "observation"].reshape(nxt.shape), nxt)
    table.close()


@pytest.mark.parametrize("capacity", [1000, 1001])
def test_a_table_made_with_half_the_records_opens_without_regions(tmp_path, capacity):
    """Tables written before regions have a record per two slots: they open as they are
    and keep a tail slot per segment."""
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", capacity, seed=0))
    s = pattern_segment(1, 0, 4, OBS)
    table.insert_many([s])
    before = stored_segments(table)
    table.close()
    for name, width in (("segments.bin", 64), ("checksums.bin", 8)):
        with open(tmp_path / "t" / "data" / name, "r+b") as f:
            f.truncate(width * (capacity // 2 + 1))
    table = Table.open(tmp_path / "t")
    assert not table.storage.continuations
    assert stored_segments(table) == before
    for batch in _per_step(lanes=2, steps=20, episode_len=10, base=100):
        table.insert_many(batch, writer_id="w")
    assert _published_slots(table) == 5 + 2 * 40
    _check_samples(table, 64)
    table.close()


def test_a_region_whose_episode_goes_on_in_a_long_segment_takes_the_next_episode(tmp_path):
    """A lane's episode that continues in a segment too long for regions leaves its region
    to the lane's next episode: the region's room is not lost to a lane that moved on."""
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    seq = iter(range(1, 100))

    def insert(ep: int, first: int, length: int, terminated: bool) -> None:
        s = pattern_segment(ep, first, length, OBS, terminated=terminated)
        s.sequence = next(seq)
        table.insert_many([s], writer_id="w")

    for first in range(3):
        insert(1, first, 1, False)
    insert(1, 3, 100, True)  # a plain block of its own
    insert(2, 0, 1, False)  # goes into episode 1's region, after its tail
    starts = {(ep, first): start for (ep, first, _, start) in stored_segments(table)}
    assert starts[(1, 1)] == starts[(1, 0)] + 1 and starts[(1, 2)] == starts[(1, 0)] + 2
    assert starts[(2, 0)] == starts[(1, 2)] + 2  # episode 1's short part, its tail, then this
    _check_samples(table, 64)
    table.close()


def test_a_reopened_table_goes_on_where_its_ring_stopped(tmp_path):
    """The newest segment lies in an old region, behind the ring's cursor: a reopened table
    must not start again from there and overwrite what was stored after it."""
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 1 << 14, seed=0))
    # One long episode in lane 0 (its region was made first), short ones in lane 1.
    seq = iter(range(1, 10_000))
    for t in range(120):
        batch = [pattern_segment(7, t, 1, OBS, terminated=False)]
        batch.append(pattern_segment(100 + t // 10, t % 10, 1, OBS, terminated=t % 10 == 9))
        for s in batch:
            s.sequence = next(seq)
        table.insert_many(batch, writer_id="w")
    before = stored_segments(table)
    cursor = table.storage.cursor
    newest = max(before, key=before.get)
    assert newest[3] + 2 < cursor  # the newest segment is not at the cursor
    table.close()
    table = Table.open(tmp_path / "t")
    assert table.storage.cursor == cursor
    for batch in _per_step(lanes=2, steps=30, episode_len=10, base=50_000):
        table.insert_many(batch, writer_id="w2")
    after = stored_segments(table)
    assert set(before) <= set(after), "a reopened table overwrote stored segments"
    _check_samples(table, 128)
    table.close()


@pytest.mark.parametrize("sampler", ["uniform", "queue"])
def test_an_insert_as_large_as_the_ring_with_short_segments_still_fits(tmp_path, sampler):
    """An insert split to fit the ring (its steps and tails) must fit as placed: a new
    region for a short segment would make its block longer than the ring, so such an
    insert is laid out plainly instead (seen: ``millpond launch`` with a 1,024-slot queue
    and 64-segment inserts, an IndexError in the shard)."""
    capacity = 1024  # regions of 16 slots: segments of up to 3 steps go into them
    table = Table.create(tmp_path / "t", getattr(TableConfig, sampler)("t", capacity, seed=0))
    segs = [pattern_segment(100, 0, 1, OBS, terminated=False)]  # 2 slots, and 30 x 34
    segs += [pattern_segment(lane, 0, 33, OBS, terminated=False) for lane in range(30)]
    for seq, s in enumerate(segs, 1):
        s.sequence = seq
    table.insert_packed(pack(segs), writer_id="w")
    expected = stored_segments(table)
    assert sum(length for _, _, length, _ in expected) == 30 * 33 + 1
    table.close()
    table = Table.open(tmp_path / "t")
    assert table.storage.corrupted == []
    assert stored_segments(table) == expected
    _check_samples(table, 64)
    table.close()


def test_regions_set_aside_never_stop_inserts_and_samples_at_once(tmp_path):
    """A writer's regions are set aside, so after the ring wraps the table holds fewer
    steps at times than it did. With ``min_size`` within that dip and actors ahead of the
    ratio, that used to stop both sides for good: no sample below ``min_size``, no insert
    past the ratio (a 16-lane DQN launch stalled at its first wrap, when its lanes had
    regions). Single-threaded here: a learner that samples whenever the ratio lets it, then
    an insert."""
    # Two lanes of 4-step chunks: regions of 17 slots (1/64 of the ring over two lanes).
    # This ring holds up to 1,769 steps before it first wraps, then as few as 1,748 while
    # the lanes' regions move on.
    min_size = 1760
    config = TableConfig.uniform(
        "t", 2200, min_size=min_size, samples_per_insert=12.8, error_buffer=800.0, seed=0
    )
    table = Table.create(tmp_path / "t", config)
    limiter = table.rate_limiter
    lanes, chunk, episode_len = 2, 4, 40
    steps = [7 * lane for lane in range(lanes)]  # each lane's next step, out of phase
    seq, shrunk_past_the_ratio = 1, 0
    for _ in range(1600):  # 12,800 steps: the ring wraps ~7 times
        batch = []
        for lane in range(lanes):
            ep, first = divmod(steps[lane], episode_len)
            length = min(chunk, episode_len - first)
            s = pattern_segment(
                lane * 10_000 + ep, first, length, OBS, terminated=first + length == episode_len
            )
            s.sequence, seq = seq, seq + 1
            batch.append(s)
            steps[lane] += length
        shrunk_past_the_ratio += table.size < min_size <= limiter.inserts and (
            limiter.diff > limiter.max_diff
        )
        if table.size >= min_size:  # the learner keeps up, as far as it can sample
            while limiter.diff > limiter.max_diff:
                td = table.sample(128, timeout=1.0)
                assert torch.equal(td["observation"], pattern(td["episode_id"], td["step"], OBS))
        # Before the fix: a RateLimiterTimeoutError here, with the table below min_size.
        table.insert_many(batch, timeout=2.0, writer_id="actor-0")
    assert shrunk_past_the_ratio > 0  # the case was reached, and inserts went on
    table.close()


def _ring_order(tmp_path, writer_id: str | None, lanes: int, capacity: int):
    """After the ring wrapped twice, over 16 snapshots 10 inserts apart (~4 passes of the
    ring): of the steps it holds, the share a
    FIFO ring holding as many would have evicted (its steps are exactly the newest); and
    the oldest step's age in steps inserted since, over the steps it holds (below 1 in a
    FIFO ring, but for the insert in which the oldest came)."""
    table = Table.create(tmp_path / str(writer_id), TableConfig.uniform("t", capacity, seed=0))
    inserted, total, shares, oldest = {}, 0, [], 0.0
    for k, batch in enumerate(actor_chunks(lanes, 16, (10, 40), obs_shape=OBS)):
        for seg in batch:
            inserted[(seg.episode_id, seg.first_step)] = total
            total += len(seg.steps)
            seg.sequence = seg.sequence if writer_id else None
        table.insert_many(batch, writer_id=writer_id)
        if total >= 2 * capacity and k % 10 == 0:
            ages = ring_ages(table, inserted, total)
            shares.append(float(np.mean(ages >= len(ages))))
            oldest = max(oldest, float(ages.max()) / len(ages))
            if len(shares) == 16:
                break
    _check_samples(table)
    table.close()
    return float(np.mean(shares)), oldest


def test_a_writer_of_many_lanes_keeps_the_ring_fifo(tmp_path):
    """A DQN actor's 16 lanes of 16-step chunks on an 11,000-slot ring: each lane's region
    would be filled over ~10 inserts, and 16 of them held a quarter of the ring out of its
    order (5% of the steps stored were older than a FIFO ring keeps). The regions of every
    lane together take at most 1/64 of the ring, so here there are none: as FIFO as
    anonymous inserts, to within that share."""
    plain, _ = _ring_order(tmp_path, None, lanes=16, capacity=11_000)
    writer, _ = _ring_order(tmp_path, "actor-0", lanes=16, capacity=11_000)
    assert writer <= plain + 1 / 64, (writer, plain)
    # Few lanes on a large ring still get regions, and stay within that share too.
    few, _ = _ring_order(tmp_path / "few", "actor-0", lanes=2, capacity=32_768)
    assert few <= 1 / 64, few


def test_the_rings_end_keeps_no_step_past_a_pass(tmp_path):
    """A block that does not fit before the ring's end lays the segments that do there and
    the rest from slot 0. It used to start at slot 0 whole, and the slots it left at the
    end kept their steps until a later pass's block happened to reach them (steps ~1.9
    passes old in this ring)."""
    for writer_id in (None, "actor-0"):
        _, oldest = _ring_order(tmp_path, writer_id, lanes=16, capacity=11_000)
        assert oldest < 1.05, (writer_id, oldest)  # the steps held are the newest
