"""Samplers: which step slots a sample returns.

A sampler sees segments as they are published and evicted (under the table's lock) and
picks slots when asked. It never reads or writes data: the table gathers the slots it picks
from the storage. This is TorchRL's storage/sampler split, which keeps checkpoints simple.
A sampler whose state must survive restarts (priorities, the queue's cursor) keeps it in
memory-mapped files of its own under the table's directory, and flushes them itself.
"""

from __future__ import annotations

import collections
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from millpond.errors import InvalidDataError
from millpond.service._sum_tree import SumMinTree
from millpond.service.disk_space import Reservation, create_sparse, reserve
from millpond.service.segment_batch import SegmentBatch, ranges
from millpond.service.table_counters import COUNTERS_FILE, Counter

#: Where a prioritized sampler keeps its raw priorities, under the table's directory.
PRIORITIES_FILE = "priorities.bin"


@dataclass
class Selection:
    """What a sampler picked.

    Attributes:
        slots: step slots, ``[B]`` (or ``[B, K]`` for slices).
        weights: importance weights ``[B]`` (prioritized tables), else ``None``.
        segment_lengths: for queue samples, the number of steps of each delivered segment.
        ends: bool, shaped like ``slots``: where the batch's trajectories stop along its
            last (time) axis, so that a value estimator's recursion stops there too. Single
            transitions stand alone (every row ends, the default); a queue batch's
            trajectories are its whole segments; a slice ends at its last step.
        mask: bool, shaped like ``slots``, false where a slice shorter than asked repeats
            its last slot (slices tables without ``strict_length``), else ``None``.
    """

    slots: np.ndarray
    weights: np.ndarray | None = None
    segment_lengths: np.ndarray | None = None
    ends: np.ndarray | None = None
    mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.ends is None:
            self.ends = np.ones(self.slots.shape, dtype=bool)


class Sampler:
    """Base class. Subclasses track sampleable slots and implement :meth:`sample`."""

    def __init__(self, capacity: int, seed: int | None = None) -> None:
        self.capacity = capacity
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    @property
    def size(self) -> int:
        """Steps that can currently be sampled."""
        raise NotImplementedError

    @property
    def mass(self) -> float:
        """Sampleable mass: the size, or the total priority for prioritized samplers."""
        return float(self.size)

    def on_publish(self, segments: SegmentBatch) -> None:
        raise NotImplementedError

    def on_evict(self, segments: SegmentBatch) -> None:
        raise NotImplementedError

    def recover(self, segments: SegmentBatch) -> None:
        """Take back the segments found on disk when the table reopens."""
        self.on_publish(segments)

    def reset(self, next_generation: int) -> None:
        """Forget every segment (the table dropped them) and restart the random stream.

        Segments published from now on carry ``next_generation`` or later.
        """
        self.rng = np.random.default_rng(self.seed)

    def flush(self) -> None:
        """Write this sampler's files to disk (a checkpoint); without files, nothing."""

    def reserve_space(self, end: int) -> None:
        """Reserve the disk blocks of this sampler's files for slots below ``end``, before an
        insert publishes there (:class:`ResourceExhaustedError` on a full disk); without
        files, nothing."""

    def blocks_eviction(self, segments: SegmentBatch) -> bool:
        """Whether overwriting ``segments`` must wait (a queue never drops unread steps)."""
        return False

    def can_sample(self, batch_size: int) -> bool:
        return self.size > 0

    def sample(self, batch_size: int) -> Selection:
        raise NotImplementedError

    def state(self) -> dict:
        return {"size": self.size}


class _SlotSet:
    """A set of slots with O(1) insert/remove and uniform sampling by rejection.

    Slots are drawn from ``[0, high)`` (the highest slot ever added) and kept when they
    are members; with segments laid out back to back, most draws are kept.
    """

    def __init__(self, capacity: int) -> None:
        self.member = np.zeros(capacity, dtype=bool)
        self.count = 0
        self.high = 0

    def add(self, slots: np.ndarray) -> None:
        if len(slots):
            self.count += int((~self.member[slots]).sum())
            self.member[slots] = True
            self.high = max(self.high, int(slots.max()) + 1)

    def remove(self, slots: np.ndarray) -> None:
        if len(slots):
            self.count -= int(self.member[slots].sum())
            self.member[slots] = False

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        assert self.count > 0
        if self.count * 16 < self.high:  # sparse: draw from the explicit list instead
            return rng.choice(np.flatnonzero(self.member[: self.high]), size=n)
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            need = n - filled
            draws = rng.integers(0, self.high, size=need + need // 2 + 8)
            kept = draws[self.member[draws]][:need]
            out[filled : filled + len(kept)] = kept
            filled += len(kept)
        return out


class UniformSampler(Sampler):
    """Every stored step equally likely, with replacement."""

    def __init__(self, capacity: int, seed: int | None = None) -> None:
        super().__init__(capacity, seed)
        self._slots = _SlotSet(capacity)

    def reset(self, next_generation: int) -> None:
        super().reset(next_generation)
        self._slots = _SlotSet(self.capacity)

    @property
    def size(self) -> int:
        return self._slots.count

    def on_publish(self, segments: SegmentBatch) -> None:
        self._slots.add(segments.step_slots())

    def on_evict(self, segments: SegmentBatch) -> None:
        self._slots.remove(segments.step_slots())

    def sample(self, batch_size: int) -> Selection:
        return Selection(self._slots.sample(batch_size, self.rng))


class _PriorityFile:
    """What the prioritized samplers share: raw priorities per slot, ``capacity + 1``
    float64 (the last holds the largest priority, 1 at first), memory-mapped from the
    table directory's ``priorities.bin`` (created sparse, its disk blocks reserved as slots
    fill) or, without a directory, in memory."""

    priorities: np.ndarray
    _file: np.ndarray
    _max: np.ndarray
    _space: Reservation | None = None

    def _open_priorities(self, capacity: int, directory: Path | None) -> None:
        if directory is None:
            self._file = np.zeros(capacity + 1, dtype=np.float64)
        else:
            path = directory / PRIORITIES_FILE
            size = (capacity + 1) * 8
            if not path.exists() or path.stat().st_size == 0:  # 0: its creation failed
                create_sparse(path, size, directory)
            self._file = np.memmap(path, dtype=np.float64, mode="r+", shape=(capacity + 1,))
            fd = os.open(path, os.O_RDWR)
            weakref.finalize(self, os.close, fd)  # the table has no close for its sampler
            # The largest priority, at the end, is written now: its block first.
            reserve(fd, capacity * 8, 8, directory, PRIORITIES_FILE)
            self._space = Reservation(directory, capacity, "slots")
            self._space.add(fd, 8, PRIORITIES_FILE)
            self._space.resume()
        self.priorities = self._file[:capacity]
        self._max = self._file[capacity : capacity + 1]
        if self._max[0] < 1.0:
            self._max[0] = 1.0

    @property
    def max_priority(self) -> float:
        """The largest priority ever set (1 at first): what new steps get."""
        return float(self._max[0])

    def _set_new(self, slots: np.ndarray, given: np.ndarray | None) -> np.ndarray:
        """Give new step ``slots`` their priorities: ``given`` (checked at insert) or, for
        none, :attr:`max_priority`; returns what was set."""
        p = np.full(len(slots), self.max_priority) if given is None else given
        self.priorities[slots] = p
        self._raise_max(p)
        return p

    def _set_updates(self, slots: np.ndarray, priorities: np.ndarray) -> bool:
        """Set the raw priorities of live ``slots`` (the table drops stale ones first);
        ``False`` if there were none."""
        if not np.all(np.isfinite(priorities)) or np.any(priorities < 0):
            raise InvalidDataError("priorities must be finite and >= 0")
        if len(slots) == 0:
            return False
        self.priorities[slots] = priorities
        self._raise_max(priorities)
        return True

    def _raise_max(self, p: np.ndarray) -> None:
        if len(p):
            self._max[0] = max(self.max_priority, float(np.max(p)))

    def flush(self) -> None:
        if isinstance(self._file, np.memmap):
            self._file.flush()

    def reserve_space(self, end: int) -> None:
        if self._space is not None:
            self._space.ensure(end)


class PrioritizedSampler(_PriorityFile, Sampler):
    """Proportional prioritized replay (Schaul et al., 2016) on a sum-tree.

    ``P(i) = p_i^alpha / sum_j p_j^alpha``; importance weights ``w_i = (N P(i))^-beta``
    normalised by their maximum. New steps get the priority their writer gave them (an
    Ape-X actor's initial TD error) or, without one, the largest priority seen so far.
    Raw priorities live in ``priorities``; with a ``directory`` they are memory-mapped from
    its ``priorities.bin`` (``capacity + 1`` float64: the last holds that largest priority),
    so they survive restarts.
    """

    def __init__(
        self,
        capacity: int,
        alpha: float = 0.6,
        beta: float = 0.4,
        seed: int | None = None,
        directory: Path | None = None,
    ) -> None:
        super().__init__(capacity, seed)
        self.alpha = alpha
        self.beta = beta
        self._open_priorities(capacity, directory)
        self._tree = SumMinTree(capacity)
        self._count = 0

    @property
    def size(self) -> int:
        return self._count

    @property
    def mass(self) -> float:
        return self._tree.total

    def can_sample(self, batch_size: int) -> bool:
        return self._count > 0 and self._tree.total > 0

    def on_publish(self, segments: SegmentBatch, priorities: np.ndarray | None = None) -> None:
        """Make the segments' steps sampleable: with ``priorities`` (float64, one per step,
        segment after segment, finite and >= 0) those, else :attr:`max_priority` each.
        Given priorities raise :attr:`max_priority` as updates do."""
        slots = segments.step_slots()
        self._tree.set(slots, self._set_new(slots, priorities) ** self.alpha)
        self._count += len(slots)

    def recover(self, segments: SegmentBatch) -> None:
        """Take back the segments found on disk with the priorities stored for them."""
        slots = segments.step_slots()
        p = np.asarray(self.priorities[slots], dtype=np.float64)
        self._tree.set(slots, p**self.alpha)
        self._count += len(slots)
        self._raise_max(p)

    def reset(self, next_generation: int) -> None:
        super().reset(next_generation)
        self._max[0] = 1.0  # new steps start from priority 1 again
        self._tree = SumMinTree(self.capacity)
        self._count = 0

    def on_evict(self, segments: SegmentBatch) -> None:
        slots = segments.step_slots()
        self._tree.set(slots, 0.0)
        self._count -= len(slots)

    def sample(self, batch_size: int) -> Selection:
        slots, weights = _weighted_draw(self._tree, self._count, batch_size, self.rng, self.beta)
        return Selection(slots, weights=weights)

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Set the raw priorities of live step slots (the table drops stale ones first)."""
        if self._set_updates(slots, priorities):
            self._tree.set(slots, priorities**self.alpha)

    def set_exponents(self, alpha: float, beta: float) -> None:
        """Change ``alpha`` and ``beta`` of a running table: the stored steps' sampling
        weights are recomputed from their priorities (kept as given, so any ``alpha``
        applies exactly)."""
        if alpha != self.alpha:
            live = np.flatnonzero(self._tree.get(np.arange(self.capacity)) > 0)
            if len(live):
                self._tree.set(live, np.asarray(self.priorities[live]) ** alpha)
        self.alpha, self.beta = alpha, beta

    def state(self) -> dict:
        return {
            "size": self.size,
            "total_priority": self._tree.total,
            "max_priority": self.max_priority,
            "alpha": self.alpha,
            "beta": self.beta,
        }


class QueueSampler(Sampler):
    """FIFO for on-policy learners: each step delivered exactly once, in publication order.

    A sample returns whole segments: as many, in order, as fit in the batch size (a single
    segment longer than the batch is delivered alone). Unread segments are never
    overwritten; writers wait for the learner instead. The cursor holds the generation of
    the last delivered segment; with a ``directory`` it is the ``QUEUE_CURSOR`` entry of the
    table's ``counters.bin`` there (where the file format has always kept it), mapped here.
    """

    def __init__(
        self, capacity: int, seed: int | None = None, directory: Path | None = None
    ) -> None:
        super().__init__(capacity, seed)
        self._cursor: np.ndarray = np.zeros(1, dtype=np.int64)
        if directory is not None:
            offset = Counter.QUEUE_CURSOR * np.dtype(np.int64).itemsize
            self._cursor = np.memmap(
                directory / COUNTERS_FILE, dtype=np.int64, mode="r+", offset=offset, shape=(1,)
            )
        self._queue: collections.deque[tuple[int, int, int]] = collections.deque()
        self._steps = 0

    @property
    def size(self) -> int:
        return self._steps

    @property
    def delivered_through(self) -> int:
        return int(self._cursor[0])

    def on_publish(self, segments: SegmentBatch) -> None:
        for gen, start, length in zip(
            segments.generations.tolist(), segments.starts.tolist(), segments.lengths.tolist()
        ):
            if gen > self._cursor[0]:
                self._queue.append((gen, start, length))
                self._steps += length

    def on_evict(self, segments: SegmentBatch) -> None:
        if self.blocks_eviction(segments):
            raise RuntimeError("queue segments evicted before delivery")

    def blocks_eviction(self, segments: SegmentBatch) -> bool:
        return bool(len(segments)) and bool((segments.generations > self._cursor[0]).any())

    def reset(self, next_generation: int) -> None:
        super().reset(next_generation)
        self._queue.clear()
        self._steps = 0
        self._cursor[0] = next_generation - 1  # every dropped generation counts as delivered

    def flush(self) -> None:
        if isinstance(self._cursor, np.memmap):
            self._cursor.flush()

    def can_sample(self, batch_size: int) -> bool:
        return self._steps > 0 and self._steps >= batch_size

    def sample(self, batch_size: int) -> Selection:
        taken: list[tuple[int, int, int]] = []
        total = 0
        while self._queue and (not taken or total + self._queue[0][2] <= batch_size):
            seg = self._queue.popleft()
            taken.append(seg)
            total += seg[2]
        self._steps -= total
        self._cursor[0] = taken[-1][0]
        starts = np.array([s for _, s, _ in taken], dtype=np.int64)
        lengths = np.array([n for _, _, n in taken], dtype=np.int64)
        ends = np.zeros(int(lengths.sum()), dtype=bool)
        ends[np.cumsum(lengths) - 1] = True
        return Selection(ranges(starts, lengths), segment_lengths=lengths, ends=ends)

    def requeue(self, segments: list[tuple[int, int, int]]) -> None:
        """Put taken ``(generation, start, length)`` segments back at the head, in order.

        For a batch that could not be delivered (the call was cancelled, or the answer was
        too large). The cursor moves back to just before the first of them.
        """
        for seg in reversed(segments):
            self._queue.appendleft(seg)
            self._steps += seg[2]
        if segments:
            self._cursor[0] = min(int(self._cursor[0]), segments[0][0] - 1)

    def state(self) -> dict:
        return {
            "size": self.size,
            "segments": len(self._queue),
            "delivered_through_generation": self.delivered_through,
        }


def _weighted_draw(
    tree: SumMinTree, count: int, batch_size: int, rng: np.random.Generator, beta: float
) -> tuple[np.ndarray, np.ndarray]:
    """``batch_size`` leaves of ``tree`` drawn with probability ``P(i) = leaf_i / total``,
    and their importance weights ``(N P(i))^-beta`` over the largest possible one
    (``N = count``, the leaves that may be drawn; Schaul et al. 2016), float32."""
    total = tree.total
    slots = tree.find(rng.random(batch_size) * total)
    p = tree.get(slots)
    # Rounding at the edge of a tree node can land on an empty leaf; draw those again.
    for _ in range(100):
        bad = p <= 0
        if not bad.any():
            break
        slots[bad] = tree.find(rng.random(int(bad.sum())) * total)
        p = tree.get(slots)
    max_weight = (count * tree.min / total) ** (-beta)
    weights = (count * (p / total)) ** (-beta) / max_weight
    return slots, weights.astype(np.float32)
