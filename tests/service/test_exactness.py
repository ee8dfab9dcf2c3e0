"""Every sampled row equals the step the environment really produced, bit for bit.

The reference is an independent rollout (``millpond.testing.rollout``) that records each
step's observation and its TRUE next observation. The rollout is cut into chunks at random
points, each chunk into compact segments (tail = the true next observation of the last
step), and inserted into tables of every sampler kind, with a capacity that holds it all
and with a small one that forces the ring to wrap and evict. Sampled rows are looked up in
the reference by ``(episode_id, step)`` and compared key by key, ``("next", obs)`` included.
"""

from __future__ import annotations

import threading
import time
import zlib

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.config import TableConfig
from millpond.errors import RateLimiterTimeoutError
from millpond.service.table import Table
from millpond.testing import (
    CountingDictEnv,
    SegmentRecord,
    chunk_segments,
    observation_keys,
    reference_index,
    rollout,
    stored_steps,
)

STEPS_PER_LANE = 400
LARGE, SMALL = 4096, 64
SLICE_LEN = 4

# env name -> (factory(first episode id), end kinds its rollout must contain)
ENVS = {
    "cartpole": (lambda first: gym.make("CartPole-v1"), {"terminated", "cut"}),
    "cartpole-trunc15": (
        lambda first: gym.make("CartPole-v1", max_episode_steps=15),
        {"terminated", "truncated", "cut"},
    ),
    "dict-obs": (
        lambda first: CountingDictEnv(pixel_shape=(3, 16, 16), episode_offset=first),
        {"terminated", "truncated", "cut"},
    ),
}


class Reference:
    """Two lanes of rollouts of one env, their segments, and lookups by (episode, step)."""

    def __init__(self, env_name: str) -> None:
        factory, self.expected_kinds = ENVS[env_name]
        rng = np.random.default_rng(zlib.crc32(env_name.encode()))
        lanes = []
        for lane in range(2):
            first = 1000 * lane + 7
            env = factory(first)
            td = rollout(env, STEPS_PER_LANE, seed=100 + lane, episode_offset=first)
            env.close()
            lanes.append(td)
        self.ted = torch.cat(lanes)
        self.index = reference_index(self.ted)
        self.obs_keys = observation_keys(self.ted)
        # An actor's insert calls: lane 0's chunk i and lane 1's chunk i together; lane 1
        # sends ("next", "done") too.
        per_lane = [
            chunk_segments(td, rng, max_chunk=30, with_done=lane == 1)
            for lane, td in enumerate(lanes)
        ]
        self.calls: list[list] = []
        for i in range(max(len(c) for c in per_lane)):
            call = []
            for chunks in per_lane:
                if i < len(chunks):
                    call.extend(chunks[i])
            self.calls.append(call)
        # (episode, step) -> "terminated" / "truncated" / "cut" / "mid"
        self.kind: dict[tuple[int, int], str] = {}
        self.records: list[SegmentRecord] = []
        for call in self.calls:
            for _, rec in call:
                self.records.append(rec)
                for s in range(rec.first_step, rec.first_step + rec.length):
                    self.kind[(rec.episode_id, s)] = "mid"
                self.kind[(rec.episode_id, rec.first_step + rec.length - 1)] = rec.end
        assert len(self.kind) == 2 * STEPS_PER_LANE
        assert {r.end for r in self.records} >= self.expected_kinds, (
            "the rollout lacks an episode-end kind this test must cover"
        )

    def rows_of(self, sample: TensorDictBase) -> torch.Tensor:
        eps = sample["episode_id"].reshape(-1).tolist()
        steps = sample["step"].reshape(-1).tolist()
        return torch.tensor([self.index[(e, s)] for e, s in zip(eps, steps)], dtype=torch.int64)


_REFS: dict[str, Reference] = {}


@pytest.fixture(params=list(ENVS))
def ref(request) -> Reference:
    if request.param not in _REFS:
        _REFS[request.param] = Reference(request.param)
    return _REFS[request.param]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_rows_equal(
    sample: TensorDictBase, ref: Reference, stops: torch.Tensor, with_weight: bool = False
) -> None:
    """Each sampled row equals its reference row (by episode_id/step), bit for bit.

    ``stops`` (bool, one per row) says where the batch's trajectory stops: there, a step
    that did not terminate is marked truncated, so that value estimators stop too.
    """
    flat = sample.reshape(-1)
    expected = ref.ted[ref.rows_of(flat)]
    stops = stops.reshape(-1, 1)
    want_term = expected["next", "terminated"]
    want_trunc = expected["next", "truncated"] | (stops & ~want_term)
    want_flags = {"terminated": want_term, "truncated": want_trunc, "done": want_term | want_trunc}
    keys: list[tuple[str, ...]] = [("action",), ("next", "reward")]
    for k in ref.obs_keys:
        keys += [k, ("next", *k)]
    for key in keys:
        got, want = flat[key], expected[key]
        assert got.dtype == want.dtype and got.shape == want.shape, (key, got.shape, want.shape)
        bad = (_bits(got) != _bits(want)).reshape(len(flat), -1).any(dim=1)
        assert not bad.any(), (
            f"{key} differs from the reference at (episode, step) "
            f"{list(zip(flat['episode_id'][bad].tolist(), flat['step'][bad].tolist()))[:5]}"
        )
    for f in ("terminated", "truncated", "done"):
        assert torch.equal(flat["next", f], want_flags[f]), f
        assert flat["next", f].shape == (len(flat), 1)
        assert not flat[f].any(), f"root {f} must be False for a stored step"
    want_keys = set(keys) | {("next", f) for f in ("terminated", "truncated", "done")}
    want_keys |= {("done",), ("terminated",), ("truncated",), ("episode_id",), ("step",)}
    want_keys |= {("index", "slot"), ("index", "generation")}
    if with_weight:
        want_keys.add(("weight",))
        w = flat["weight"]
        assert torch.all((w > 0) & (w <= 1.0 + 1e-6)), w
    got_keys = {
        (k,) if isinstance(k, str) else tuple(k)
        for k in flat.keys(include_nested=True, leaves_only=True)
    }
    assert got_keys == want_keys


def _insert(table: Table, call: list) -> None:
    segments = [seg for seg, _ in call]
    if len(segments) == 1:
        s = segments[0]
        table.insert(s.steps, s.tail, s.episode_id, s.first_step, timeout=10)
    else:
        table.insert_many(segments, timeout=10)


def _make(make_table, kind: str, capacity: int) -> Table:
    if kind == "uniform":
        cfg = TableConfig.uniform("t", capacity, seed=1)
    elif kind == "prioritized":
        cfg = TableConfig.prioritized("t", capacity, alpha=0.7, beta=0.5, seed=1)
    elif kind == "queue":
        cfg = TableConfig.queue("t", capacity, seed=1)
    else:
        cfg = TableConfig.slices("t", capacity, SLICE_LEN, seed=1)
    return make_table(cfg)


@pytest.mark.parametrize("capacity", [LARGE, SMALL], ids=["large", "small"])
@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_sampled_rows_equal_reference(make_table, ref: Reference, kind: str, capacity: int):
    table = _make(make_table, kind, capacity)
    rng = np.random.default_rng(5)
    sampled_kinds: set[str] = set()
    stored_kinds: set[str] = set()

    def check(batch: int) -> None:
        td = table.sample(batch, timeout=5)
        assert td.batch_size == (batch,)
        # A sampled transition stands alone: every row stops.
        stops = torch.ones(batch, dtype=torch.bool)
        assert_rows_equal(td, ref, stops, with_weight=kind == "prioritized")
        eps, steps = td["episode_id"].tolist(), td["step"].tolist()
        sampled_kinds.update(ref.kind[(e, s)] for e, s in zip(eps, steps))
        if kind == "prioritized":
            table.update_priorities(
                td["index", "slot"], td["index", "generation"], rng.uniform(0.1, 5.0, batch)
            )

    for call in ref.calls:
        _insert(table, call)
        stored = stored_steps(table)
        assert table.size == len(stored)
        stored_kinds.update(ref.kind[k] for k in stored)
        if capacity == SMALL:
            assert len(stored) < capacity
            check(32)
    assert table.info()["inserts"] == 2 * STEPS_PER_LANE
    if capacity == LARGE:
        assert stored_steps(table) == set(ref.kind)
    else:
        # Oldest first: the newest segment is always there.
        last = ref.calls[-1][-1][1]
        assert (last.episode_id, last.first_step) in stored_steps(table)
    for _ in range(40):  # at most the table's capacity: a larger batch is refused
        check(int(rng.integers(1, min(128, capacity) + 1)))
    assert stored_kinds >= ref.expected_kinds | {"mid"}
    assert sampled_kinds == stored_kinds, "some kind of step (episode end, chunk cut) never sampled"


@pytest.mark.parametrize("capacity", [LARGE, SMALL], ids=["large", "small"])
def test_queue_delivers_each_step_once_in_order(make_table, ref: Reference, capacity: int):
    table = _make(make_table, "queue", capacity)
    rng = np.random.default_rng(9)
    delivered: list[TensorDict] = []
    batch_sizes: list[int] = []
    finished = threading.Event()
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            while True:
                size = table.size
                if size == 0:
                    if finished.is_set() and table.size == 0:
                        return
                    time.sleep(0.0005)
                    continue
                b = min(int(rng.integers(1, 40)), size)
                batch_sizes.append(b)
                delivered.append(table.sample(b, timeout=10))
        except BaseException as e:
            errors.append(e)

    if capacity == SMALL:
        # The ring is smaller than the data: the writer waits for the learner to read.
        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        try:
            for call in ref.calls:
                _insert(table, call)
        finally:
            finished.set()
        drainer.join(30)
        assert not drainer.is_alive()
    else:
        for call in ref.calls:
            _insert(table, call)
        finished.set()
        drain()
    assert not errors, errors

    # FIFO: the concatenation of every batch is exactly the inserted steps, in order.
    inserted = [
        (rec.episode_id, s)
        for rec in ref.records
        for s in range(rec.first_step, rec.first_step + rec.length)
    ]
    got = [
        (e, s) for td in delivered for e, s in zip(td["episode_id"].tolist(), td["step"].tolist())
    ]
    assert len(got) == len(inserted) and got == inserted
    # Whole segments per batch: each batch starts and ends at a segment boundary and holds
    # at most the batch size, unless it is one segment longer than that.
    boundaries = set(np.cumsum([0] + [rec.length for rec in ref.records]).tolist())
    seg_len_at = {}
    pos = 0
    for rec in ref.records:
        seg_len_at[pos] = rec.length
        pos += rec.length
    pos = 0
    for td, b in zip(delivered, batch_sizes):
        n = td.batch_size[0]
        assert pos in boundaries and pos + n in boundaries
        assert n <= b or n == seg_len_at[pos], (n, b)
        # A queue batch's trajectories are its segments: each stops at its last step.
        keys = zip(td["episode_id"].tolist(), td["step"].tolist())
        stops = torch.tensor([ref.kind[key] != "mid" for key in keys])
        assert_rows_equal(td, ref, stops)
        pos += n
    assert table.size == 0
    with pytest.raises(RateLimiterTimeoutError):
        table.sample(1, timeout=0.05)


@pytest.mark.parametrize("capacity", [LARGE, SMALL], ids=["large", "small"])
def test_slices_are_consecutive_steps_of_one_episode(make_table, ref: Reference, capacity: int):
    k = SLICE_LEN
    table = _make(make_table, "slices", capacity)
    rng = np.random.default_rng(13)
    crossings = 0
    sampled = 0

    def check(batch: int) -> None:
        nonlocal crossings, sampled
        td = table.sample(batch, timeout=5)
        assert td.batch_size == (batch, k)
        eps, steps, slots = td["episode_id"], td["step"], td["index", "slot"]
        assert torch.all(eps == eps[:, :1]), "a slice mixes episodes"
        assert torch.all(steps == steps[:, :1] + torch.arange(k)), "a slice skips steps"
        stops = torch.zeros(batch, k, dtype=torch.bool)
        stops[:, -1] = True  # a slice stops at its last step
        assert_rows_equal(td, ref, stops)
        for key in ref.obs_keys:
            assert torch.equal(td[("next", *key)][:, :-1], td[key][:, 1:])
        # No slice runs past an episode end before its last step.
        assert not td["next", "done"][:, :-1].any()
        crossings += int((slots[:, 1:] != slots[:, :-1] + 1).any(dim=1).sum())
        sampled += batch

    for call in ref.calls:
        _insert(table, call)
        if capacity == SMALL and table.info()["mass"] > 0:
            check(16)
    if capacity == LARGE:
        # Every step with k-1 more steps of its episode after it starts a slice.
        valid = {(e, s) for (e, s) in ref.kind if (e, s + k - 1) in ref.kind}
        assert table.info()["mass"] == len(valid)
    for _ in range(30):
        check(int(rng.integers(1, min(64, capacity // k) + 1)))
    assert crossings > 0, "no slice crossed from one segment into the next"
