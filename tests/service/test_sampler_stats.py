"""Seeded statistical checks of the samplers, through the table's public API.

Frequencies are compared with their expected values by a chi-square statistic; its bounds
are the chi-square quantiles at z = -/+ 4.75 (two-sided p of about 2e-6) by the
Wilson-Hilferty approximation, so a correct sampler practically never fails, while a biased
one (or one that is too regular to be random) does. The seeds make every run identical.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.segments import Segment, pack
from millpond.service.table import Table
from millpond.testing import sample_in_parts, stored_segments

Z = 4.75


def chi2_bounds(df: int, z: float = Z) -> tuple[float, float]:
    """Lower and upper chi-square quantiles at -z and +z (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1 - c - z * math.sqrt(c)) ** 3, df * (1 - c + z * math.sqrt(c)) ** 3


def assert_frequencies(counts: np.ndarray, probs: np.ndarray) -> None:
    """``counts`` (draws per cell) agree with ``probs`` by a chi-square test."""
    n = counts.sum()
    expected = n * probs
    assert expected.min() >= 5, "too few draws per cell for a chi-square test"
    stat = float(((counts - expected) ** 2 / expected).sum())
    lo, hi = chi2_bounds(len(counts) - 1)
    assert lo < stat < hi, f"chi-square {stat:.1f} outside [{lo:.1f}, {hi:.1f}]"


def test_wilson_hilferty_bounds_are_sane():
    # Tabulated chi-square quantiles: df=100 at p=0.999 is 149.45; df=10 at p=0.999, 29.59.
    assert chi2_bounds(100, 3.0902)[1] == pytest.approx(149.45, rel=5e-3)
    assert chi2_bounds(10, 3.0902)[1] == pytest.approx(29.59, rel=2e-2)


def segment(ep: int, first: int, length: int) -> Segment:
    steps = torch.arange(first, first + length, dtype=torch.float32)
    td = TensorDict(
        {
            "observation": torch.stack([torch.full_like(steps, ep), steps], 1),
            "action": torch.zeros(length, dtype=torch.int64),
            "next": {
                "reward": torch.zeros(length, 1),
                "terminated": torch.zeros(length, 1, dtype=torch.bool),
                "truncated": torch.zeros(length, 1, dtype=torch.bool),
            },
        },
        batch_size=[length],
    )
    tail = TensorDict({"observation": torch.tensor([ep, first + length], dtype=torch.float32)}, [])
    return Segment(td, tail, ep, first)


def fill(table: Table, rng: np.random.Generator, n_segments: int, first_ep: int = 0) -> None:
    for i in range(n_segments):
        s = segment(first_ep + i, int(rng.integers(0, 100)), int(rng.integers(1, 12)))
        table.insert(s.steps, s.tail, s.episode_id, s.first_step)


def live_steps(table: Table) -> tuple[np.ndarray, np.ndarray]:
    """Slots and generations of every stored step."""
    segs = stored_segments(table)
    slots = np.concatenate([np.arange(s[3], s[3] + s[2]) for s in segs])
    gens = np.concatenate([np.full(s[2], g) for s, g in segs.items()])
    return slots, gens


def draw_slots(table: Table, draws: int, batch: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    slots, weights = [], []
    for _ in range(draws // batch):
        td = sample_in_parts(table, batch, timeout=10)
        slots.append(td["index", "slot"].numpy())
        if td.get("weight", None) is not None:
            weights.append(td["weight"].numpy())
    return np.concatenate(slots), (np.concatenate(weights) if weights else np.empty(0))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("wrapped", [False, True], ids=["fresh", "wrapped"])
def test_uniform_frequencies(make_table, seed, wrapped):
    capacity = 128 if wrapped else 1024
    table = make_table(TableConfig.uniform("t", capacity, seed=seed))
    rng = np.random.default_rng(seed)
    fill(table, rng, 60 if wrapped else 25)  # wrapped: the ring turns several times
    slots, _ = live_steps(table)
    assert table.size == len(slots)
    drawn, _ = draw_slots(table, 200 * len(slots))
    assert np.isin(drawn, slots).all(), "sampled a slot that holds no stored step"
    counts = np.bincount(drawn, minlength=capacity)[slots]
    assert_frequencies(counts, np.full(len(slots), 1 / len(slots)))


@pytest.mark.parametrize("alpha, beta", [(0.6, 0.4), (1.0, 1.0), (0.0, 0.5)])
def test_prioritized_frequencies_and_weights(make_table, alpha, beta):
    table = make_table(TableConfig.prioritized("t", 1024, alpha=alpha, beta=beta, seed=3))
    rng = np.random.default_rng(3)
    fill(table, rng, 20)
    slots, gens = live_steps(table)
    priorities = rng.uniform(0.05, 4.0, len(slots))
    assert table.update_priorities(slots, gens, priorities) == len(slots)
    drawn, weights = draw_slots(table, 60_000)
    assert np.isin(drawn, slots).all()
    p = priorities**alpha
    probs = p / p.sum()
    counts = np.bincount(drawn, minlength=1024)[slots]
    assert_frequencies(counts, probs)
    # w_i = (N P(i))^-beta / max_j (N P(j))^-beta
    n = len(slots)
    prob_of = dict(zip(slots.tolist(), probs))
    expected = (n * np.array([prob_of[s] for s in drawn.tolist()])) ** -beta
    expected /= (n * probs.min()) ** -beta
    np.testing.assert_allclose(weights, expected, rtol=1e-5)
    assert table.info()["mass"] == pytest.approx(p.sum(), rel=1e-9)


@pytest.mark.parametrize("beta", [0.4, 1.0])
def test_priorities_given_at_insert_are_what_the_sampler_draws_with(make_table, beta):
    # Ape-X: each step starts with the priority its writer computed, not the max priority.
    table = make_table(TableConfig.prioritized("t", 1024, alpha=1.0, beta=beta, seed=7))
    rng = np.random.default_rng(7)
    given: dict[int, float] = {}  # slot -> priority
    for ep in range(20):
        s = segment(ep, 0, int(rng.integers(1, 12)))
        p = rng.uniform(0.05, 4.0, s.steps.batch_size[0])
        (gen,) = table.insert_packed(pack([Segment(s.steps, s.tail, ep, 0, None, p)]))
        seg = next(k for k, g in stored_segments(table).items() if g == gen)
        given.update(zip(range(seg[3], seg[3] + seg[2]), p.tolist()))
    slots, _ = live_steps(table)
    priorities = np.array([given[s] for s in slots.tolist()])
    np.testing.assert_array_equal(np.asarray(table.sampler.priorities)[slots], priorities)
    assert table.sampler.max_priority == pytest.approx(max(priorities.max(), 1.0))
    drawn, weights = draw_slots(table, 60_000)
    assert np.isin(drawn, slots).all()
    probs = priorities / priorities.sum()  # alpha = 1: P(i) = p_i / sum p
    assert_frequencies(np.bincount(drawn, minlength=1024)[slots], probs)
    n = len(slots)
    prob_of = dict(zip(slots.tolist(), probs))
    expected = (n * np.array([prob_of[s] for s in drawn.tolist()])) ** -beta
    expected /= (n * probs.min()) ** -beta
    np.testing.assert_allclose(weights, expected, rtol=1e-5)


def test_zero_priority_is_never_sampled(make_table):
    table = make_table(TableConfig.prioritized("t", 512, seed=4))
    fill(table, np.random.default_rng(4), 15)
    slots, gens = live_steps(table)
    priorities = np.where(np.arange(len(slots)) % 3 == 0, 0.0, 1.0)
    table.update_priorities(slots, gens, priorities)
    drawn, weights = draw_slots(table, 20_000)
    assert not np.isin(drawn, slots[priorities == 0]).any()
    np.testing.assert_allclose(weights, 1.0, rtol=1e-6)  # equal non-zero priorities


def test_stale_updates_are_ignored_and_new_steps_get_the_max_priority(make_table):
    alpha = 0.7
    capacity = 64
    table = make_table(TableConfig.prioritized("t", capacity, alpha=alpha, seed=5))
    rng = np.random.default_rng(5)
    fill(table, rng, 4)
    old_slots, old_gens = live_steps(table)
    # Known priorities with a known maximum.
    prios = rng.uniform(0.1, 2.0, len(old_slots))
    prios[len(prios) // 2] = 7.5
    assert table.update_priorities(old_slots, old_gens, prios) == len(old_slots)

    # New steps enter with the largest priority so far.
    fill(table, rng, 1, first_ep=100)
    slots, gens = live_steps(table)
    new = ~np.isin(slots, old_slots)
    assert new.any()
    np.testing.assert_array_equal(np.asarray(table.sampler.priorities)[slots[new]], 7.5)

    # Overwrite everything: the old indexes now name other steps, or tails, or nothing.
    fill(table, rng, 30, first_ep=200)
    slots, gens = live_steps(table)
    assert not set(zip(slots.tolist(), gens.tolist())) & set(
        zip(old_slots.tolist(), old_gens.tolist())
    )
    before = np.asarray(table.sampler.priorities).copy()
    mass = table.info()["mass"]
    assert table.update_priorities(old_slots, old_gens, np.full(len(old_slots), 1000.0)) == 0
    np.testing.assert_array_equal(np.asarray(table.sampler.priorities), before)
    assert table.info()["mass"] == mass
    # A tail slot with its segment's generation is no step either.
    seg, gen = next(iter(stored_segments(table).items()))
    tail_slot = seg[3] + seg[2]
    assert table.update_priorities([tail_slot], [gen], [1000.0]) == 0
    # Every live step has the max priority (all were inserted after it was set) ...
    np.testing.assert_array_equal(np.asarray(table.sampler.priorities)[slots], 7.5)
    # ... so sampling is uniform, and a fresh update takes effect.
    k = slots[: len(slots) // 2]
    assert table.update_priorities(k, gens[: len(k)], np.full(len(k), 0.5)) == len(k)
    p = np.where(np.isin(slots, k), 0.5, 7.5) ** alpha
    drawn, _ = draw_slots(table, 50_000)
    assert_frequencies(np.bincount(drawn, minlength=capacity)[slots], p / p.sum())


def fill_episodes(table: Table, rng: np.random.Generator, episodes: int, first_ep: int = 0):
    """Episodes sent as several segments each (so that slices cross segment boundaries);
    returns each episode's number of steps."""
    ep_steps: dict[int, int] = {}
    for ep in range(first_ep, first_ep + episodes):
        step = 0
        for _ in range(int(rng.integers(1, 5))):
            length = int(rng.integers(1, 9))
            s = segment(ep, step, length)
            table.insert(s.steps, s.tail, ep, step)
            step += length
        ep_steps[ep] = step
    return ep_steps


def slice_start_counts(table: Table, starts: list, batches: int) -> np.ndarray:
    """How often each of ``starts`` ((episode, step) pairs) began a slice in ``batches``
    batches of 500; a slice beginning anywhere else fails the lookup."""
    index = {v: i for i, v in enumerate(starts)}
    counts = np.zeros(len(starts), dtype=np.int64)
    for _ in range(batches):
        td = sample_in_parts(table, 500, timeout=10)
        first = zip(td["episode_id"][:, 0].tolist(), td["step"][:, 0].tolist())
        np.add.at(counts, [index[v] for v in first], 1)
    return counts


def test_slice_starts_are_uniform_over_valid_starts(make_table):
    k = 4
    table = make_table(TableConfig.slices("t", 2048, k, seed=6))
    rng = np.random.default_rng(6)
    ep_steps = fill_episodes(table, rng, 12)
    valid = [(e, s) for e, n in ep_steps.items() for s in range(n - k + 1)]
    assert table.info()["mass"] == len(valid)
    counts = slice_start_counts(table, valid, 60)
    assert_frequencies(counts, np.full(len(valid), 1 / len(valid)))


def step_slots(table: Table) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
    """Every stored step's ``(episode, step)``, and their slots and generations."""
    keys, slots, gens = [], [], []
    for (ep, first, length, start), gen in stored_segments(table).items():
        keys += [(ep, first + i) for i in range(length)]
        slots += range(start, start + length)
        gens += [gen] * length
    return keys, np.array(slots), np.array(gens)


@pytest.mark.parametrize("strict_length", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("alpha, beta", [(0.6, 0.4), (1.0, 1.0)])
def test_prioritized_slice_frequencies_and_weights(make_table, strict_length, alpha, beta):
    k = 3
    table = make_table(
        TableConfig.prioritized_slices(
            "t", 2048, k, alpha=alpha, beta=beta, seed=7, strict_length=strict_length
        )
    )
    rng = np.random.default_rng(7)
    ep_steps = fill_episodes(table, rng, 12)
    keys, slots, gens = step_slots(table)
    priorities = rng.uniform(0.05, 4.0, len(keys))
    assert table.update_priorities(slots, gens, priorities) == len(keys)
    # Every stored step has a priority; only the valid starts are drawn.
    least = k if strict_length else 1
    valid = [(e, s) for e, n in ep_steps.items() for s in range(n - least + 1)]
    prio_of = dict(zip(keys, priorities.tolist()))
    p = np.array([prio_of[v] for v in valid]) ** alpha
    probs = p / p.sum()
    assert table.info()["mass"] == pytest.approx(p.sum(), rel=1e-9)
    index = {v: i for i, v in enumerate(valid)}
    counts = np.zeros(len(valid), dtype=np.int64)
    expected_weights, weights = [], []
    n = len(valid)
    for _ in range(100):
        td = sample_in_parts(table, 500, timeout=10)
        episode, step = td["episode_id"].numpy(), td["step"].numpy()
        mask = td["collector", "mask"].numpy() if not strict_length else np.ones_like(step, bool)
        # Each slice: one episode's consecutive steps (never across episodes).
        assert (episode == episode[:, :1]).all()
        last = mask.sum(1)[:, None] - 1  # a short slice repeats its last real step
        assert (step == step[:, :1] + np.minimum(np.arange(k)[None, :], last)).all()
        starts = list(zip(episode[:, 0].tolist(), step[:, 0].tolist()))
        assert all(s in index for s in starts), "a slice began at no valid start"
        np.add.at(counts, [index[s] for s in starts], 1)
        w = td["weight"].numpy()
        assert w.shape == (500, k) and (w == w[:, :1]).all()
        weights.append(w[:, 0])
        # w_i = (N P(i))^-beta / max_j (N P(j))^-beta, in plain Python
        for s in starts:
            expected_weights.append((n * probs[index[s]]) ** -beta / (n * probs.min()) ** -beta)
    assert_frequencies(counts, probs)
    np.testing.assert_allclose(np.concatenate(weights), expected_weights, rtol=1e-5)


def test_priorities_given_at_insert_start_slices_with_them(make_table):
    # Ape-X with n-step targets: a prioritized slices table takes each step's priority from
    # its writer, and a slice is drawn by its first step's (alpha = 1: P(i) = p_i / sum p).
    table = make_table(
        TableConfig.prioritized_slices("t", 1024, 3, alpha=1.0, seed=7, strict_length=False)
    )
    rng = np.random.default_rng(7)
    given: dict[tuple[int, int], float] = {}  # (episode, step) -> priority
    for ep in range(20):
        s = segment(ep, 0, int(rng.integers(1, 12)))
        p = rng.uniform(0.05, 4.0, s.steps.batch_size[0])
        table.insert_packed(pack([Segment(s.steps, s.tail, ep, 0, None, p)]))
        given.update({(ep, i): float(q) for i, q in enumerate(p)})
    starts = sorted(given)  # loose slices: every stored step begins one
    probs = np.array([given[v] for v in starts])
    probs /= probs.sum()
    assert_frequencies(slice_start_counts(table, starts, 120), probs)
    assert table.sampler.max_priority == pytest.approx(max(max(given.values()), 1.0))


def test_prioritized_slice_update_of_an_overwritten_slot_is_dropped(make_table):
    capacity = 96
    table = make_table(TableConfig.prioritized_slices("t", capacity, 2, seed=8))
    rng = np.random.default_rng(8)
    fill_episodes(table, rng, 3)
    old = table.sample(16, timeout=10)["index"][:, 0]
    assert table.update_priorities(old["slot"], old["generation"], np.full(16, 3.0)) > 0
    fill_episodes(table, rng, 40, first_ep=100)  # the ring turns: every old step is gone
    before = np.asarray(table.sampler.priorities).copy()
    mass = table.info()["mass"]
    assert table.update_priorities(old["slot"], old["generation"], np.full(16, 99.0)) == 0
    np.testing.assert_array_equal(np.asarray(table.sampler.priorities), before)
    assert table.info()["mass"] == mass
    # A fresh index applies.
    new = table.sample(4, timeout=10)["index"][:, 0]
    assert table.update_priorities(new["slot"], new["generation"], np.full(4, 99.0)) == 4
    assert table.sampler.max_priority == 99.0


def test_prioritized_slices_keep_their_priorities_across_a_restart(tmp_path):
    k, alpha, beta = 3, 0.7, 0.5
    config = TableConfig.prioritized_slices("t", 1024, k, alpha=alpha, beta=beta, seed=9)
    table = Table.create(tmp_path / "t", config)
    rng = np.random.default_rng(9)
    ep_steps = fill_episodes(table, rng, 10)
    keys, slots, gens = step_slots(table)
    priorities = rng.uniform(0.1, 5.0, len(keys))
    priorities[0] = 8.0  # the largest: what new steps get after the restart too
    table.update_priorities(slots, gens, priorities)
    mass = table.info()["mass"]
    table.close()

    table = Table.open(tmp_path / "t")
    try:
        assert table.config.sampler == "prioritized_slices"
        np.testing.assert_array_equal(np.asarray(table.sampler.priorities)[slots], priorities)
        assert table.info()["mass"] == pytest.approx(mass, rel=1e-12)
        assert table.sampler.max_priority == 8.0
        valid = [(e, s) for e, n in ep_steps.items() for s in range(n - k + 1)]
        prio_of = dict(zip(keys, priorities.tolist()))
        p = np.array([prio_of[v] for v in valid]) ** alpha
        probs = p / p.sum()
        index = {v: i for i, v in enumerate(valid)}
        counts = np.zeros(len(valid), dtype=np.int64)
        for _ in range(60):
            td = sample_in_parts(table, 500, timeout=10)
            starts = list(zip(td["episode_id"][:, 0].tolist(), td["step"][:, 0].tolist()))
            np.add.at(counts, [index[s] for s in starts], 1)
            expected = [(len(valid) * probs[index[s]]) ** -beta for s in starts]
            expected = np.array(expected) / (len(valid) * probs.min()) ** -beta
            np.testing.assert_allclose(td["weight"][:, 0].numpy(), expected, rtol=1e-5)
        assert_frequencies(counts, probs)
        fill_episodes(table, rng, 1, first_ep=500)
        keys, slots, _ = step_slots(table)
        new = slots[[ep == 500 for ep, _ in keys]]
        assert len(new) and (np.asarray(table.sampler.priorities)[new] == 8.0).all()
    finally:
        table.close()
