"""Cutting a collector batch into segments, and TED <-> segments round trips."""

from __future__ import annotations

import pytest
import torch

from millpond.actors import Collector, cut_batch, ends_episode, from_ted, join, to_ted
from millpond.errors import InvalidDataError
from millpond.segmenting import pack_batch
from millpond.segments import pack, pack_columns


@pytest.fixture(scope="module")
def batch():
    with Collector(
        "CartPole-v1", None, num_envs=3, chunk_len=30, env_kwargs={"max_episode_steps": 9}, seed=0
    ) as c:
        c.collect()
        return c.collect()


def test_segments_cover_each_lane_in_order(batch):
    segments = cut_batch(batch)
    lanes, time_len = batch.shape
    assert sum(s.steps.shape[0] for s in segments) == lanes * time_len
    rows = torch.cat([to_ted(s) for s in segments]).reshape(lanes, time_len)
    for key in ["observation", ("next", "observation"), "action", ("next", "reward")]:
        assert torch.equal(rows[key], batch[key])
    assert torch.equal(rows["next", "done"], batch["next", "done"])
    for s in segments:
        first = s.steps["observation"][0]
        match = (batch["observation"] == first).all(-1).nonzero()
        p, t = match[0].tolist()
        assert s.episode_id == int(batch["collector", "traj_ids"][p, t])
        assert s.first_step == int(batch["collector", "step_count"][p, t])
        # A segment ends at an episode end or at the chunk end, nowhere else.
        end = t + s.steps.shape[0] - 1
        assert ends_episode(s) == bool(batch["next", "done"][p, end]) or end == time_len - 1
        assert not to_ted(s)["next", "done"][:-1].any()
    keys = set(segments[0].steps.keys(True, True))
    assert ("next", "observation") not in keys and ("collector", "traj_ids") not in keys
    assert ("next", "done") not in keys
    pack(segments)  # the segment layout's own validation


def test_from_ted_inverts_join(batch):
    segments = [s for s in cut_batch(batch) if s.episode_id == cut_batch(batch)[0].episode_id]
    ted = join(segments)
    again = from_ted(
        ted,
        [s.steps.shape[0] for s in segments],
        segments[0].episode_id,
        [s.first_step for s in segments],
    )
    for a, b in zip(segments, again):
        assert (a.episode_id, a.first_step) == (b.episode_id, b.first_step)
        assert (a.steps == b.steps).all() and (a.tail == b.tail).all()


def test_from_ted_rejects_bad_cuts(batch):
    ted = join([next(s for s in cut_batch(batch) if s.steps.shape[0] > 2)])
    n = ted.shape[0]
    with pytest.raises(InvalidDataError, match="lengths"):
        from_ted(ted, [n + 1], 0, [0])
    with pytest.raises(InvalidDataError, match="one entry each"):
        from_ted(ted, [n], [0, 1], [0])
    ted["next", "observation"][0] += 1
    with pytest.raises(InvalidDataError, match="next row"):
        from_ted(ted, [n], 0, [0])
    assert len(from_ted(ted, [1, n - 1], 0, [0, 1])) == 2  # a cut there is fine


def test_cut_batch_agrees_with_compact_ted(batch):
    """The loop's cutter and the service's TED importer cut a batch the same way."""
    from millpond.ted import compact_ted

    segments = cut_batch(batch)
    # One segment per episode in a chunk; compact_ted learns where episodes that started in
    # an earlier chunk stand from its state.
    state = {s.episode_id: (s.first_step, None) for s in segments}
    packed = compact_ted(batch, state)
    assert packed.lengths.tolist() == [s.steps.shape[0] for s in segments]
    assert packed.episode_ids.tolist() == [s.episode_id for s in segments]
    assert packed.first_steps.tolist() == [s.first_step for s in segments]
    tails = torch.stack([s.tail["observation"] for s in segments])
    assert torch.equal(packed.tails[("observation",)], tails)


def test_pack_batch_equals_packing_the_cut_segments(batch):
    """The collector's column path sends exactly what packing its segments would."""
    direct, via_segments = pack_batch(batch), pack(cut_batch(batch))
    assert direct.lengths.tolist() == via_segments.lengths.tolist()
    assert direct.episode_ids.tolist() == via_segments.episode_ids.tolist()
    assert direct.first_steps.tolist() == via_segments.first_steps.tolist()
    for mine, theirs in ((direct.steps, via_segments.steps), (direct.tails, via_segments.tails)):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key].dtype == theirs[key].dtype, key
            assert torch.equal(mine[key], theirs[key]), key


def test_pack_columns_rejects_what_pack_rejects(batch):
    packed = pack_batch(batch)
    steps, tails = dict(packed.steps), dict(packed.tails)
    args = (packed.lengths, packed.episode_ids, packed.first_steps)
    with pytest.raises(InvalidDataError, match=r"steps carry \('next', 'observation'\)"):
        pack_columns({**steps, ("next", "observation"): steps[("observation",)]}, tails, *args)
    with pytest.raises(InvalidDataError, match="reserved"):
        pack_columns({**steps, ("weight",): steps[("action",)]}, tails, *args)
    with pytest.raises(InvalidDataError, match="lack observation key"):
        pack_columns({k: v for k, v in steps.items() if k != ("observation",)}, tails, *args)
    with pytest.raises(InvalidDataError, match=r"'action': expected 90 rows"):
        pack_columns({**steps, ("action",): steps[("action",)][1:]}, tails, *args)
    with pytest.raises(InvalidDataError, match="one row per segment"):
        pack_columns(steps, {k: v[1:] for k, v in tails.items()}, *args)
    bad = steps[("next", "terminated")].clone()
    bad[0] = True  # an episode end inside a segment
    lengths = packed.lengths.copy()
    assert lengths[0] > 1
    with pytest.raises(InvalidDataError, match="must be a segment's last step"):
        pack_columns({**steps, ("next", "terminated"): bad}, tails, *args)
