"""A table's inserts: admission, placement and writers' de-duplication.

A block of segments is admitted once the rate limiter, a full queue and the slots other
writers are still copying let it in; it is placed in the table's regions or in a block of
fresh slots (evicting the oldest segments there), copied outside the lock and published
under it, with the initial priorities its writer gave (a prioritized table only). A
writer's segments carry sequences: one already stored is skipped, so a re-send after a lost
acknowledgement never stores anything twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.errors import InvalidDataError
from millpond.insert_checks import check_insert_priorities
from millpond.routing import writer_hash
from millpond.segments import PackedSegments, Segment, pack
from millpond.service.regions import Placement, ring_end_left
from millpond.service.segment_batch import SegmentBatch
from millpond.spec import DONE, TERMINATED, TRUNCATED, Key

if TYPE_CHECKING:
    from millpond.config import TableConfig
    from millpond.service.rate_limiter import RateLimiter
    from millpond.service.regions import Regions
    from millpond.service.samplers import Sampler
    from millpond.service.storage import SegmentStorage
    from millpond.service.table_files import TableFiles


class TableInserts:
    """The insert side of :class:`~millpond.service.table.Table` (one of its bases: the
    state it works on is the table's, under the table's lock; the spec check, the waits and
    the redraw allowance are the table's too)."""

    config: TableConfig
    storage: SegmentStorage
    sampler: Sampler
    rate_limiter: RateLimiter
    _cond: threading.Condition
    _files: TableFiles
    _regions: Regions
    _inflight: dict[int, int]
    _queue_full_writers: int
    _evictions: int
    _writer_hwm: dict[int, int]
    _writer_locks: dict[int, threading.Lock]

    def insert(
        self,
        steps: TensorDictBase,
        tail: TensorDictBase,
        episode_id: int,
        first_step: int = 0,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Store one segment; returns its generation (as a 1-element array).

        Blocks while the rate limiter (or a full queue) holds inserts back, up to ``timeout``
        seconds, then raises :class:`RateLimiterTimeoutError`. On any error nothing is stored.
        """
        return self.insert_many([Segment(steps, tail, episode_id, first_step)], timeout)

    def insert_many(
        self,
        segments: Sequence[Segment],
        timeout: float | None = None,
        writer_id: str | None = None,
    ) -> np.ndarray:
        """Store several segments in one block; returns their generations.

        With a ``writer_id`` and segment sequences, a segment whose (writer, sequence) is
        already stored is skipped (its generation is reported as 0): re-sending after a
        lost acknowledgement never stores anything twice.
        """
        return self.insert_packed(pack(segments), timeout, writer_id)

    def insert_packed(
        self, packed: PackedSegments, timeout: float | None = None, writer_id: str | None = None
    ) -> np.ndarray:
        """Store segments already packed into columns (see :func:`segments.pack`).

        Frame-stacked keys (``TableConfig.frame_stacks``) may come as whole stacks (checked
        to overlap, then cut to frames) or as frames already. Steps with ``priorities``
        start with those (a prioritized table only; others refuse them by name), steps
        without with the sampler's rule for new steps.
        """
        packed = check_insert_priorities(packed, self.config.name, self.config.sampler)
        packed = self._check_spec(packed)
        if np.any(packed.episode_ids < 0) or np.any(packed.first_steps < 0):
            raise InvalidDataError("episode ids and first steps must be >= 0")
        if writer_id is None or packed.sequences is None:
            blocks = packed.split(self.config.capacity)
            return np.concatenate([self._insert_block(p, timeout, 0) for p in blocks])
        writer = writer_hash(writer_id)
        with self._cond:
            lock = self._writer_locks.setdefault(writer, threading.Lock())
        # One writer's inserts run one at a time, so that a re-sent segment racing the
        # original (an old stream still finishing after a reconnect) is seen as a duplicate.
        with lock:
            fresh = packed.sequences > self._writer_hwm.get(writer, 0)
            gens = np.zeros(len(packed), dtype=np.int64)
            if fresh.any():
                todo = packed if fresh.all() else packed.select(fresh)
                blocks = todo.split(self.config.capacity)
                gens[fresh] = np.concatenate(
                    [self._insert_block(p, timeout, writer) for p in blocks]
                )
            return gens

    def writer_sequence(self, writer_id: str) -> int:
        """The highest sequence stored from ``writer_id`` (0 if none).

        Waits for an insert of that writer still in progress (a previous connection of a
        restarted writer), so that the answer is final.
        """
        writer = writer_hash(writer_id)
        with self._cond:
            lock = self._writer_locks.setdefault(writer, threading.Lock())
        with lock:
            return self._writer_hwm.get(writer, 0)

    def _insert_block(
        self, packed: PackedSegments, timeout: float | None, writer: int
    ) -> np.ndarray:
        deadline = None if timeout is None else time.monotonic() + timeout
        ends = _episode_ends(packed)
        refused: set[int] = set()  # segments whose first observation is not their
        # predecessor's tail: stored on their own, never joined to it
        with self._cond:
            while True:
                self._check_open()
                place = self._regions.plan(
                    writer, packed.lengths, packed.episode_ids, packed.first_steps, ends, refused
                )
                differ = self._tails_differ(place, packed)
                if differ:
                    refused |= differ
                    continue
                cursor, capacity = self.storage.cursor, self.storage.capacity
                block = place.pieces(cursor, capacity, packed.lengths)
                cleared = ring_end_left(block, cursor, capacity) + block
                taken = [(s, n) for s, n in cleared if self._regions.overlaps(place, s, n)]
                if taken:
                    for s, n in taken:
                        self._regions.forget(s, n)  # the block takes their room
                    continue
                reason = None
                writes = place.ranges(block, packed.lengths) + cleared
                held_back = self.rate_limiter.why_insert_waits(self.sampler.size)
                if held_back is not None:
                    reason = (
                        f"the rate limiter holds inserts back: {held_back} "
                        f"({self.rate_limiter.describe()})"
                    )
                elif any(self._overlaps_inflight(s, n) for s, n in writes):
                    reason = "the slots are being written by another writer"
                else:
                    victims = SegmentBatch.concat(
                        [self.storage.published_in(s, n) for s, n in cleared]
                    )
                    if self.sampler.blocks_eviction(victims):
                        reason = "the queue is full of steps not yet delivered to a learner"
                    else:
                        break
                message = f"insert of {packed.num_steps} steps timed out: {reason}"
                if reason.startswith("the queue is full"):
                    # A learner waiting for a full batch must not wait for this writer.
                    self._queue_full_writers += 1
                    self._cond.notify_all()
                    try:
                        self._wait(deadline, message, "insert")
                    finally:
                        self._queue_full_writers -= 1
                else:
                    self._wait(deadline, message, "insert")
            # Disk blocks first: a full disk refuses the insert here, the table unchanged.
            # Evicting writes only into slots and records already written (the victims'),
            # which have their blocks, so nothing after this point can meet a full disk.
            end = max(s + n for s, n in writes)
            roots = int(np.count_nonzero(~place.continues))
            self.storage.reserve_space(0, end, len(packed), roots)
            self.sampler.reserve_space(end)
            if len(victims):
                self._evictions += 1
                self._allow_redraws(int(victims.lengths.sum()))
            self.storage.unpublish(victims)
            self.sampler.on_evict(victims)
            for s, n in cleared:
                self._regions.forget(s, n)
                self.storage.reserve(s, n)  # the cursor ends after the block's last piece
            self._regions.commit(place, block)
            records = self.storage.take_records(len(packed))
            starts = place.absolute(block)
            chains = self.storage.take_chains(starts, packed.lengths, place.continues)
            for s, n in writes:
                self._inflight[s] = n
        layout = SegmentBatch(
            starts,
            packed.lengths,
            np.zeros(len(packed), dtype=np.int64),
            packed.episode_ids,
            packed.first_steps,
            np.full(len(packed), writer, dtype=np.int64),
            packed.sequences,
        )
        try:
            self.storage.write(layout, packed.steps, packed.tails, packed.frames, records, chains)
        except BaseException:
            with self._cond:
                self.storage.return_records(records)
                self.storage.return_chains(chains, starts)
                self._regions.abandon(writer)
                for s, _ in writes:
                    del self._inflight[s]
                self._cond.notify_all()
            raise
        with self._cond:
            first_gen = self._files.take_generations(len(packed))
            layout.generations = np.arange(first_gen, first_gen + len(packed), dtype=np.int64)
            self.storage.publish(layout, records, chains)
            if packed.priorities is None:
                self.sampler.on_publish(layout)
            else:  # a prioritized sampler (check_insert_priorities saw to it)
                self.sampler.on_publish(layout, packed.priorities)
            # A continuation whose predecessor went while it was copied (evicted by another
            # writer's block, or dropped damaged) would read frames no longer there.
            orphans = self.storage.orphans(starts, records)
            if len(orphans):  # before anyone could see them
                self._unpublish(self.storage.segments_of_records(orphans))
            self.rate_limiter.on_insert(packed.num_steps)
            if writer and packed.sequences is not None:
                self._writer_hwm[writer] = max(
                    self._writer_hwm.get(writer, 0), int(packed.sequences[-1])
                )
            for s, _ in writes:
                del self._inflight[s]
            self._cond.notify_all()
        return layout.generations

    def _unpublish(self, segments: SegmentBatch) -> SegmentBatch:
        """Drop published ``segments`` from the table (under the lock), their regions too:
        nothing may continue them. Returns them."""
        for s, n in zip(segments.starts.tolist(), segments.lengths.tolist()):
            self._regions.forget(s, n + 1)
        self._evictions += 1
        self._allow_redraws(int(segments.lengths.sum()))
        self.storage.unpublish(segments)
        self.sampler.on_evict(segments)
        return segments

    def _tails_differ(self, place: Placement, packed: PackedSegments) -> set[int]:
        """The planned continuations whose first observation is not, byte for byte, the
        tail of the segment they would continue (a writer that cut and re-sent differently:
        such segments are stored on their own)."""
        if not place.checks and not place.in_batch:
            return set()
        first = _first_observations(packed)
        differ: set[int] = set()
        if place.checks:
            idx = np.array([i for i, _ in place.checks])
            _, stored = self.storage.gather(np.array([t - 1 for _, t in place.checks]))
            same = np.logical_and.reduce([_rows_equal(stored[k], first[k][idx]) for k in first])
            differ.update(idx[~same].tolist())
        if place.in_batch:
            tails = _tail_observations(packed)
            idx = np.array([i for i, _ in place.in_batch])
            pred = np.array([j for _, j in place.in_batch])
            same = np.logical_and.reduce(
                [_rows_equal(tails[k][pred], first[k][idx]) for k in first]
            )
            differ.update(idx[~same].tolist())
        return differ

    def _overlaps_inflight(self, start: int, n: int) -> bool:
        return any(s < start + n and start < s + m for s, m in self._inflight.items())


def _episode_ends(packed: PackedSegments) -> np.ndarray:
    """Whether each segment's last step ends its episode."""
    last = np.cumsum(packed.lengths) - 1
    out = np.zeros(len(packed), dtype=bool)
    for key in (TERMINATED, TRUNCATED, DONE):
        flags = packed.steps.get(key)
        if flags is not None:
            out |= flags.reshape(len(flags), -1).any(1).numpy()[last]
    return out


def _first_observations(packed: PackedSegments) -> dict[Key, torch.Tensor]:
    """Each segment's first observation, per observation key (whole stacks)."""
    rows = torch.from_numpy(np.cumsum(packed.lengths) - packed.lengths)
    out = {k: v.index_select(0, rows) for k, v in packed.steps.items() if k in packed.tails}
    for key, frames in packed.frames.items():
        k = packed.stacks[key]
        at = np.cumsum(packed.lengths + k) - (packed.lengths + k)
        out[key] = torch.stack([frames[a : a + k] for a in at.tolist()])
    return out


def _tail_observations(packed: PackedSegments) -> dict[Key, torch.Tensor]:
    """Each segment's tail, per observation key (whole stacks)."""
    out = dict(packed.tails)
    for key, frames in packed.frames.items():
        k = packed.stacks[key]
        at = np.cumsum(packed.lengths + k) - k  # the tail's stack: the last k frames
        out[key] = torch.stack([frames[a : a + k] for a in at.tolist()])
    return out


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Row by row, whether ``a`` and ``b`` hold the same bytes (NaN payloads included:
    what is stored is the bytes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return np.zeros(len(a), dtype=bool)
    rows = len(a)
    av = a.contiguous().reshape(rows, -1).view(torch.uint8)
    bv = b.contiguous().reshape(rows, -1).view(torch.uint8)
    return (av == bv).all(1).numpy()
