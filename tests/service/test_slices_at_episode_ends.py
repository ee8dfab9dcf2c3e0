"""Slices without ``strict_length``: every stored step begins slices, episode ends included.

The reference is the written episodes themselves (lengths, how each ends, which segments
they were cut into), checked against a plain count: each stored step must be a slice start
about ``draws / steps`` times, a slice must hold exactly the steps left in its episode's
stored run (at most ``K``), repeat its last slot after them with the mask false there, and
stop (``done``) at its last real step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import Table, TableConfig
from millpond.errors import InvalidConfigError
from millpond.storage_format import SlotColumn
from millpond.testing import sample_in_parts

K = 4
# episode id -> (segment lengths in order, how the episode's stored run ends)
EPISODES = {
    1: ([1], "terminated"),  # shorter than K
    2: ([2], "truncated"),
    3: ([3, 2], "terminated"),  # crosses a segment boundary
    4: ([7], "truncated"),
    5: ([2, 3, 5], "terminated"),
    6: ([6], "cut"),  # still running: the run ends at a chunk cut
}


def segment(ep: int, first: int, n: int, end: str | None) -> tuple[TensorDict, TensorDict]:
    steps = torch.arange(first, first + n)
    obs = (ep * 100 + torch.arange(first, first + n + 1)).float().unsqueeze(-1)
    flags = {f: torch.zeros(n, 1, dtype=torch.bool) for f in ("terminated", "truncated")}
    if end in flags:
        flags[end][-1] = True
    td = TensorDict(
        {
            "observation": obs[:-1],
            "action": steps,
            "next": {"reward": (ep * 100 + steps).float().unsqueeze(-1), **flags},
        },
        [n],
    )
    return td, TensorDict({"observation": obs[-1]}, [])


def fill(table: Table) -> dict[tuple[int, int], str]:
    """Write :data:`EPISODES`; returns (episode, step) -> how its run ends there, or "mid"."""
    at: dict[tuple[int, int], str] = {}
    for ep, (lengths, end) in EPISODES.items():
        first = 0
        for i, n in enumerate(lengths):
            last = i == len(lengths) - 1
            table.insert(*segment(ep, first, n, end if last else None), ep, first)
            first += n
        for s in range(first):
            at[(ep, s)] = end if s == first - 1 else "mid"
    return at


def remaining(ep: int, step: int) -> int:
    return sum(EPISODES[ep][0]) - step


@pytest.fixture
def table(tmp_path):
    config = TableConfig.slices("s", 200, slice_len=K, seed=3, strict_length=False)
    t = Table.create(tmp_path / "s", config)
    yield t
    t.close()


def test_every_stored_step_begins_slices_uniformly(table) -> None:
    at = fill(table)
    draws = 20_000
    counts = dict.fromkeys(at, 0)
    for _ in range(draws // 500):
        batch = sample_in_parts(table, 500)
        assert batch.batch_size == (500, K)
        for key in zip(batch["episode_id"][:, 0].tolist(), batch["step"][:, 0].tolist()):
            counts[key] += 1
    mean = draws / len(at)
    sigma = (mean * (1 - 1 / len(at))) ** 0.5
    assert min(counts.values()) > 0, "a stored step never began a slice"
    off = {k: c for k, c in counts.items() if abs(c - mean) > 6 * sigma}
    assert not off, f"starts not uniform over stored steps (mean {mean:.0f}): {off}"
    ends = [k for k, end in at.items() if end != "mid"]
    assert all(counts[k] for k in ends), "an episode's last step never began a slice"


def test_short_slices_hold_the_steps_left_then_repeat_masked(table) -> None:
    at = fill(table)
    batch = sample_in_parts(table, 2_000)
    mask = batch["collector", "mask"]
    assert mask.dtype == torch.bool and mask.shape == (2_000, K)
    seen_short = 0
    for row in batch.unbind(0):
        ep, first = int(row["episode_id"][0]), int(row["step"][0])
        real = min(K, remaining(ep, first))
        seen_short += real < K
        assert row["collector", "mask"].tolist() == [True] * real + [False] * (K - real)
        assert row["step"][:real].tolist() == list(range(first, first + real))
        assert (row["episode_id"] == ep).all()
        # the repeats are copies of the last real step
        assert (row["index", "slot"][real:] == row["index", "slot"][real - 1]).all()
        assert (row["step"][real:] == first + real - 1).all()
        # the rows are the episode's own: observation encodes (episode, step)
        want_obs = (ep * 100 + row["step"]).float()
        assert torch.equal(row["observation"].squeeze(-1), want_obs)
        assert torch.equal(row["next", "observation"].squeeze(-1), want_obs + 1)
        # done until the last real step, then (from there on) done
        done = row["next", "done"].squeeze(-1)
        assert not done[: real - 1].any() and done[real - 1 :].all()
        end = at[(ep, first + real - 1)]
        terminated = row["next", "terminated"].squeeze(-1)
        assert bool(terminated[real - 1]) == (end == "terminated")
        assert not terminated[: real - 1].any()
    assert seen_short > 100


def test_strict_slices_never_begin_in_the_last_k_minus_1_steps(tmp_path) -> None:
    config = TableConfig.slices("s", 200, slice_len=K, seed=3)
    table = Table.create(tmp_path / "strict", config)
    try:
        fill(table)
        batch = sample_in_parts(table, 2_000)
    finally:
        table.close()
    assert ("collector", "mask") not in batch.keys(include_nested=True)
    starts = zip(batch["episode_id"][:, 0].tolist(), batch["step"][:, 0].tolist())
    assert all(remaining(ep, s) >= K for ep, s in starts)
    assert not (batch["episode_id"] == 1).any()  # shorter than K: never sampled


def test_strict_length_is_checked_and_kept_across_a_reopen(tmp_path) -> None:
    with pytest.raises(InvalidConfigError, match="strict_length"):
        TableConfig.uniform("u", 10, strict_length=False)
    with pytest.raises(InvalidConfigError, match="strict_length"):
        TableConfig.slices("s", 10, slice_len=2, strict_length="no")
    config = TableConfig.slices("s", 200, slice_len=K, seed=3, strict_length=False)
    Table.create(tmp_path / "s", config).close()
    table = Table.open(tmp_path / "s")
    try:
        assert table.config.strict_length is False
        fill(table)
        assert ("collector", "mask") in table.sample(8).keys(include_nested=True)
    finally:
        table.close()


@pytest.mark.parametrize("sampler", ["slices", "prioritized_slices"])
def test_a_redrawn_row_takes_its_new_slice_s_mask_and_ends(make_table, sampler) -> None:
    """A row overwritten during the gather is drawn again; its mask and ends must be the new
    slice's, or a short slice would keep a long one's marks (its repeated slot counted as a
    step, its end missed)."""
    preset = getattr(TableConfig, sampler)
    table = make_table(preset("s", capacity=256, slice_len=K, strict_length=False, seed=3))
    for ep in range(5):  # only short episodes: every slice repeats its last slot
        table.insert(*segment(ep, 0, 2, "terminated"), ep, 0)
    long_marks = np.ones((3, K), dtype=bool)
    selection = table.sampler.sample(3)
    selection.mask, selection.ends = long_marks.copy(), long_marks.copy()
    rows = table.storage.slot_info(selection.slots)
    table._redraw(np.ones(3, dtype=bool), selection, rows)

    steps = rows[..., SlotColumn.STEP]
    for r in range(3):
        first = int(steps[r, 0])
        real = 2 - first  # the steps left in the 2-step episode
        assert selection.mask[r].tolist() == [c < real for c in range(K)]
        assert selection.ends[r].tolist() == [c >= real - 1 for c in range(K)]  # repeats end too
