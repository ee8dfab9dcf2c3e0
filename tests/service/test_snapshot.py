"""A table's snapshot (what ReadTable streams), read group by group while inserts overwrite
part of it: no segment torn, what was overwritten left out and counted, and an episode that
lost a segment after sending one cut there, so every episode stays one unbroken run."""

import itertools

import numpy as np
import pytest
import torch

from millpond.config import TableConfig
from millpond.errors import ResourceExhaustedError
from millpond.segments import pack
from millpond.service.snapshot import GROUP_BYTES, pin
from millpond.testing import pattern, pattern_segment

OBS = (4,)


def segment(episode: int, index: int):
    """Segment ``index`` of ``episode``: 5 steps, 10 apart, so that no segment continues
    another (its first observation is never its predecessor's tail)."""
    return pattern_segment(episode, 10 * index, 5, OBS, terminated=False)


def insert(table, *segments) -> None:
    for s in segments:
        table.insert_packed(pack([s]), timeout=0)


def keys(packed) -> list[tuple[int, int]]:
    """``(episode, first step)`` of each segment, each checked bit for bit on the way."""
    out = []
    rows = np.cumsum(packed.lengths) - packed.lengths
    for k in range(len(packed)):
        e, f = int(packed.episode_ids[k]), int(packed.first_steps[k])
        steps = torch.arange(f, f + 5)
        assert torch.equal(
            packed.steps[("observation",)][rows[k] : rows[k] + 5], pattern(e, steps, OBS)
        )
        assert torch.equal(packed.steps[("action",)][rows[k] : rows[k] + 5][:, 1], steps)
        assert torch.equal(packed.tails[("observation",)][k], pattern(e, f + 5, OBS))
        out.append((e, f))
    return out


def test_overwritten_segments_are_left_out_and_a_gap_cuts_the_rest_of_its_episode(make_table):
    # 8 segments of 6 slots fill the 48 slots; episodes A (1) and B (2) interleaved.
    table = make_table(TableConfig.uniform("ring", 48))
    a, b = 1, 2
    insert(table, *(segment(e, i) for i in range(4) for e in (a, b)))
    snapshot = pin(table)
    assert snapshot.num_segments == 8 and snapshot.num_steps == 40
    assert keys(snapshot.read(table, 0, 1)) == [(a, 0)]  # A sent its first segment
    # Three new segments take the ring's oldest 18 slots: A0 (sent), B0 and A1 (not yet).
    insert(table, segment(9, 0), segment(9, 1), segment(9, 2))
    rest = keys(snapshot.read(table, 1, 8))
    # B lost its beginning, as a ring evicts: the rest of B goes. A lost a segment after
    # sending one: a gap, so the rest of A is cut.
    assert rest == [(b, 10), (b, 20), (b, 30)]
    assert (snapshot.overwritten_segments, snapshot.overwritten_steps) == (2, 10)
    assert (snapshot.cut_segments, snapshot.cut_steps) == (2, 10)
    assert (snapshot.sent_segments, snapshot.sent_steps) == (4, 20)


def test_a_group_of_overwritten_segments_reads_as_none(make_table):
    table = make_table(TableConfig.uniform("ring", 24))
    insert(table, *(segment(1, i) for i in range(4)))
    snapshot = pin(table)
    insert(table, *(segment(2, i) for i in range(2)))
    assert snapshot.read(table, 0, 2) is None
    assert keys(snapshot.read(table, 2, 4)) == [(1, 20), (1, 30)]
    assert (snapshot.overwritten_segments, snapshot.cut_segments) == (2, 0)


def test_groups_hold_whole_segments_within_the_limits(make_table):
    table = make_table(TableConfig.uniform("big", 4000))
    # 30 segments of about 600 kB: 5 steps and a tail of 100 kB observations
    insert(table, *(pattern_segment(e, 0, 5, (100_000,)) for e in range(30)))
    snapshot = pin(table)
    groups = snapshot.groups(2 << 20)
    assert groups[0][0] == 0 and groups[-1][1] == 30
    assert all(j == k for (_, j), (k, _) in itertools.pairwise(groups))  # consecutive
    assert all(j - i == 3 for i, j in groups)  # 3 x 600 kB in 2 MiB, 4 would not fit
    # A large limit: groups of GROUP_BYTES (13 x 600 kB), so the lock is held for little.
    assert [j - i for i, j in snapshot.groups(1 << 30)] == [13, 13, 4]
    assert 13 * 600_000 < GROUP_BYTES < 14 * 600_000
    with pytest.raises(ResourceExhaustedError, match=r"more than the message limit \(400000"):
        snapshot.groups(400_000)


def test_an_empty_table_pins_nothing(make_table):
    snapshot = pin(make_table(TableConfig.uniform("empty", 10)))
    assert (snapshot.num_segments, snapshot.spec, snapshot.groups(1 << 20)) == (0, None, [])
