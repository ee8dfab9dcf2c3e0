"""Many writers and samplers on one table: no sampled row is ever torn or mismatched.

Every element of every stored row encodes its ``(episode, step)``: the float observation
is ``episode * 1e6 + step`` repeated over 16 elements, an int observation holds
``[episode, step]``, the action ``[episode, step, episode + step]`` and the reward the same
code as the observation. A sampled row must agree with its ``episode_id``/``step`` in every
element, and its next observation must encode ``step + 1``. With a small capacity the
writers overwrite slots the samplers are reading all the time.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.errors import RateLimiterTimeoutError
from millpond.segments import Segment
from millpond.service.table import Table
from millpond.testing import stored_segments

N_WRITERS, N_SAMPLERS = 8, 4
DURATION = 2.5  # seconds, prolonged (up to MAX_DURATION) until each minimum below is met
MAX_DURATION = 20.0
MIN_BATCHES, MIN_SEGMENTS = 100, 200
DIM = 16
VEC, IDS = ("observation", "vec"), ("observation", "ids")


def _code(ep: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return ep.to(torch.float64) * 1e6 + step.to(torch.float64)


def make_segment(ep: int, first: int, length: int, end: str | None) -> Segment:
    steps = torch.arange(first, first + length, dtype=torch.int64)
    eps = torch.full((length,), ep, dtype=torch.int64)
    code = _code(eps, steps)
    last = torch.zeros(length, 1, dtype=torch.bool)
    last[-1] = True
    td = TensorDict(
        {
            "observation": {
                "vec": code[:, None].expand(length, DIM).clone(),
                "ids": torch.stack([eps, steps], dim=1),
            },
            "action": torch.stack([eps, steps, eps + steps], dim=1),
            "next": {
                "reward": code[:, None].clone(),
                "terminated": last & (end == "terminated"),
                "truncated": last & (end == "truncated"),
            },
        },
        batch_size=[length],
    )
    t = first + length
    tail = TensorDict(
        {
            "observation": {
                "vec": torch.full((DIM,), float(ep) * 1e6 + t, dtype=torch.float64),
                "ids": torch.tensor([ep, t], dtype=torch.int64),
            }
        },
        batch_size=[],
    )
    return Segment(td, tail, ep, first)


def check_rows(td: TensorDict) -> None:
    """Every element of every row agrees with the row's episode_id and step."""
    td = td.reshape(-1)
    ep, st = td["episode_id"], td["step"]
    code = _code(ep, st)[:, None]
    problems = {
        "obs": (td[VEC] != code).any(1),
        "next obs": (td[("next", *VEC)] != code + 1).any(1),
        "ids": (td[IDS] != torch.stack([ep, st], 1)).any(1),
        "next ids": (td[("next", *IDS)] != torch.stack([ep, st + 1], 1)).any(1),
        "action": (td["action"] != torch.stack([ep, st, ep + st], 1)).any(1),
        "reward": (td["next", "reward"] != code).any(1),
        "flags": (td["next", "terminated"] & td["next", "truncated"]).any(1),
    }
    for what, bad in problems.items():
        assert not bad.any(), (
            f"{what} of {int(bad.sum())} sampled row(s) disagree with (episode, step), "
            f"e.g. {(int(ep[bad][0]), int(st[bad][0]))}"
        )


def check_storage(table: Table) -> int:
    """Every published slot on disk holds its own (episode, step); returns the step count."""
    segments = stored_segments(table)  # also checks that only whole segments are published
    if not segments:
        return 0
    slots = np.concatenate([np.arange(s[3], s[3] + s[2] + 1) for s in segments])
    ep = torch.from_numpy(np.concatenate([np.full(s[2] + 1, s[0]) for s in segments]))
    st = torch.from_numpy(np.concatenate([np.arange(s[1], s[1] + s[2] + 1) for s in segments]))
    idx = torch.from_numpy(slots)
    assert torch.equal(table.storage.columns[VEC][idx], _code(ep, st)[:, None].expand(-1, DIM))
    assert torch.equal(table.storage.columns[IDS][idx], torch.stack([ep, st], 1))
    return sum(s[2] for s in segments)


def _run(
    table: Table, *, sample, update_priorities: bool = False, min_inserted_steps: int = 0
) -> dict:
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = collections.Counter()
    lock = threading.Lock()
    recent: collections.deque = collections.deque(maxlen=64)  # sampled indexes

    def guard(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:
                errors.append(e)
                stop.set()

        return run

    @guard
    def writer(w: int) -> None:
        rng = np.random.default_rng(w)
        ep, step, ep_len = w * 100_000, 0, int(rng.integers(5, 60))
        while not stop.is_set():
            segs = []
            for _ in range(int(rng.integers(1, 4))):
                length = min(int(rng.integers(1, 21)), ep_len - step)
                end = None
                if step + length == ep_len:
                    end = "terminated" if rng.random() < 0.5 else "truncated"
                segs.append(make_segment(ep, step, length, end))
                if end is None:
                    step += length
                else:
                    ep, step, ep_len = ep + 1, 0, int(rng.integers(5, 60))
            if len(segs) == 1:
                s = segs[0]
                table.insert(s.steps, s.tail, s.episode_id, s.first_step, timeout=10)
            else:
                table.insert_many(segs, timeout=10)
            with lock:
                counts["inserted_steps"] += sum(s.steps.batch_size[0] for s in segs)
                counts["inserted_segments"] += len(segs)

    @guard
    def sampler(i: int) -> None:
        rng = np.random.default_rng(1000 + i)
        while not stop.is_set():
            try:
                td = sample(int(rng.integers(1, 65)))
            except RateLimiterTimeoutError:
                continue
            check_rows(td)
            with lock:
                counts["sampled_rows"] += td.numel()
                counts["sampled_batches"] += 1
            if update_priorities:
                recent.append((td["index", "slot"].clone(), td["index", "generation"].clone()))

    @guard
    def prioritizer() -> None:
        rng = np.random.default_rng(7)
        while not stop.is_set():
            if not recent:
                time.sleep(0.001)
                continue
            # The newest indexes (mostly still live) and the oldest (often overwritten).
            for slots, gens in (recent[-1], recent[0]):
                applied = table.update_priorities(slots, gens, rng.uniform(0.01, 10, len(slots)))
                with lock:
                    counts["priorities_offered"] += len(slots)
                    counts["priorities_applied"] += applied
            # An index that can never be live: right slot, a generation not yet issued.
            assert table.update_priorities(slots, gens + 10**9, np.ones(len(slots))) == 0

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(N_WRITERS)]
    threads += [threading.Thread(target=sampler, args=(i,)) for i in range(N_SAMPLERS)]
    if update_priorities:
        threads.append(threading.Thread(target=prioritizer))
    for t in threads:
        t.daemon = True
        t.start()
    start = time.monotonic()
    while not stop.wait(0.05):
        elapsed = time.monotonic() - start
        with lock:
            enough = (
                counts["sampled_batches"] >= MIN_BATCHES
                and counts["inserted_segments"] >= MIN_SEGMENTS
                and counts["inserted_steps"] >= min_inserted_steps
            )
        if (elapsed >= DURATION and enough) or elapsed >= MAX_DURATION:
            break
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not errors, errors
    info = table.info()
    assert info["inserts"] == counts["inserted_steps"]
    assert info["samples"] == counts["sampled_rows"]
    assert check_storage(table) == table.size
    assert counts["sampled_batches"] >= MIN_BATCHES, counts
    assert counts["inserted_segments"] >= MIN_SEGMENTS, counts
    assert counts["inserted_steps"] >= min_inserted_steps, counts
    return dict(counts)


@pytest.mark.parametrize("capacity", [1 << 16, 256], ids=["large", "small-overwriting"])
@pytest.mark.parametrize("form", ["ted", "slots"])
def test_uniform_writers_and_samplers(make_table, capacity, form):
    table = make_table(TableConfig.uniform("t", capacity, seed=0))
    # "slots": what the servicer sends, whose redraws re-read the distinct slots
    if form == "ted":
        sample = lambda b: table.sample(b, timeout=0.5)  # noqa: E731
    else:
        sample = lambda b: table.sample_slots(b, timeout=0.5).to_ted()  # noqa: E731
    # With the small capacity, the ring wraps at least 10 times.
    _run(
        table,
        sample=sample,
        min_inserted_steps=10 * capacity if capacity == 256 else 0,
    )


@pytest.mark.parametrize("form", ["ted", "slots"])
def test_a_slow_eviction_never_lets_a_redrawn_batch_through_torn(make_table, form):
    """A writer counts an eviction, then unpublishes (both under the table's lock), then
    copies. A sampler that read the count between the two (it used to, without the lock)
    took that eviction as already checked: its re-read after a redraw could catch the copy
    and be returned torn. Slowing the unpublish makes that window wide (it failed every run
    before the count was read under the lock)."""
    table = make_table(TableConfig.uniform("t", 256, seed=0))
    unpublish = table.storage.unpublish

    def slow_unpublish(segments):
        time.sleep(0.0005)
        unpublish(segments)

    table.storage.unpublish = slow_unpublish
    if form == "ted":
        sample = lambda b: table.sample(b, timeout=0.5)  # noqa: E731
    else:
        sample = lambda b: table.sample_slots(b, timeout=0.5).to_ted()  # noqa: E731
    _run(table, sample=sample, min_inserted_steps=10 * 256)


def test_prioritized_with_concurrent_priority_updates(make_table):
    alpha = 0.6
    table = make_table(TableConfig.prioritized("t", 256, alpha=alpha, beta=0.4, seed=0))

    def sample(b):
        td = table.sample(b, timeout=0.5)
        w = td["weight"]
        assert torch.all((w > 0) & (w <= 1 + 1e-6)), w
        return td

    counts = _run(table, sample=sample, update_priorities=True, min_inserted_steps=10 * 256)
    # Stale indexes were offered and ignored, fresh ones applied.
    assert 0 < counts["priorities_applied"] < counts["priorities_offered"], counts
    # The sum-tree agrees with the stored priorities of the live steps.
    live = np.concatenate([np.arange(s[3], s[3] + s[2]) for s in stored_segments(table)])
    p = np.asarray(table.sampler.priorities)[live]
    assert table.info()["mass"] == pytest.approx(float(np.sum(p**alpha)), rel=1e-9)


def test_slices_writers_and_samplers(make_table):
    k = 3
    table = make_table(TableConfig.slices("t", 256, k, seed=0))

    def sample(b):
        td = table.sample(b, timeout=0.5)
        assert td.batch_size == (b, k)
        assert torch.all(td["episode_id"] == td["episode_id"][:, :1])
        assert torch.all(td["step"] == td["step"][:, :1] + torch.arange(k))
        assert torch.equal(td[("next", *VEC)][:, :-1], td[VEC][:, 1:])
        return td

    _run(table, sample=sample, min_inserted_steps=10 * 256)
