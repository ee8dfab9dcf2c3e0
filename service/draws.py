"""A table's samples: drawing a batch in a form, redrawing the rows overwritten or found
damaged meanwhile, and giving back a batch that could not be delivered.

Slots are picked under the table's lock; the form's read runs outside it and is checked
afterwards against the slots' generations, so a row overwritten meanwhile is drawn again
rather than returned torn (a queue's batch is read under the lock: its delivered segments
become evictable at once).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from tensordict import TensorDict, TensorDictBase

from millpond.checks import check_batch_size
from millpond.errors import InvalidDataError, StorageCorruptedError
from millpond.sample_format import ColocatedSample, SlotSample
from millpond.service.sample_forms import COLOCATED, SLOTS, TED, Drawn, SampleForm
from millpond.service.samplers import QueueSampler, Selection
from millpond.service.segment_batch import SegmentBatch
from millpond.service.storage import SlotColumn

if TYPE_CHECKING:
    from millpond.config import TableConfig
    from millpond.service.rate_limiter import RateLimiter
    from millpond.service.samplers import Sampler
    from millpond.service.storage import SegmentStorage
    from millpond.service.verifier import Verifier

T = TypeVar("T")


def check_batch_fits(config: TableConfig, batch_size: int) -> tuple[int, str]:
    """Refuse a batch of more steps (``batch_size`` x ``slice_len``) than ``config``'s table
    has slots, in process and through the service alike: such a batch is never a useful
    one (a queue never holds it; a uniform or prioritized table would repeat its rows) and
    is what sampling would allocate. Returns its steps and how the refusal names them."""
    k = config.slice_len or 1
    steps = batch_size * k
    what = f"batch_size ({batch_size})" + (f" x slice_len ({k}) = {steps} steps" if k > 1 else "")
    if steps > config.capacity:
        raise InvalidDataError(
            f"{what} exceeds the capacity of table {config.name!r} ({config.capacity} slots)"
        )
    return steps, what


class TableDraws:
    """The sample side of :class:`~millpond.service.table.Table` (one of its bases: the
    state it works on is the table's, under the table's lock; so are its waits)."""

    config: TableConfig
    storage: SegmentStorage
    sampler: Sampler
    rate_limiter: RateLimiter
    _cond: threading.Condition
    _evictions: int
    _redraw_allowance: int
    _evicted_steps: int
    _queue_full_writers: int
    _verifier: Verifier

    def sample(
        self, batch_size: int, timeout: float | None = None, *, counted: bool = True
    ) -> TensorDict:
        """Sample ``batch_size`` steps (``[B, slice_len]`` for slices tables) as a TED TensorDict.

        Blocks until the rate limiter and the sampler allow it, up to ``timeout`` seconds.
        Queue tables return whole segments, in order: at most ``batch_size`` steps, waiting
        until that many are queued, or less when the queue is full and writers wait on it.
        ``counted=False``: see :meth:`sample_colocated`.
        """
        return self.sample_as(TED, batch_size, timeout, counted=counted)

    def sample_slots(
        self, batch_size: int, timeout: float | None = None, *, counted: bool = True
    ) -> SlotSample:
        """:meth:`sample`, drawn alike, with each distinct observation slot read once
        (what the servicer sends): ``sample_slots(...).to_ted()`` equals :meth:`sample`
        on the same table and seed, bit for bit. ``counted=False``: see
        :meth:`sample_colocated`."""
        return self.sample_as(SLOTS, batch_size, timeout, counted=counted)

    def sample_colocated(
        self, batch_size: int, timeout: float | None = None, *, counted: bool = True
    ) -> ColocatedSample:
        """:meth:`sample_slots`, drawn alike, without reading the observations: the distinct
        observation slots and their generations instead, for a reader on this host that
        reads the rows from the table's files (:mod:`millpond.colocated`).

        ``counted=False`` draws replacements for rows of a batch already counted (rows that
        reader found overwritten): the rate limiter neither holds them back nor counts them,
        as it does not count the rows :meth:`sample` redraws itself — as far as steps were
        dropped (evicted, found damaged, reset) since: a row is only ever stale because its
        slot was overwritten, so redraws past that are ordinary samples, held back and
        counted (a client cannot sample past the rate limiter by calling them redraws).

        Not for queue tables (:class:`InvalidDataError`): a delivered queue segment may be
        overwritten at once, so a read after the answer could find it gone.
        """
        return self.sample_as(COLOCATED, batch_size, timeout, counted=counted)

    def sample_as(
        self,
        form: SampleForm[T],
        batch_size: int,
        timeout: float | None = None,
        *,
        counted: bool = True,
    ) -> T:
        """One batch in ``form`` (:mod:`.sample_forms`): :data:`TED` (:meth:`sample`),
        :data:`SLOTS` (:meth:`sample_slots`) or :data:`COLOCATED`
        (:meth:`sample_colocated`); all draw alike and differ only in what they read."""
        if form.not_for_queues is not None and isinstance(self.sampler, QueueSampler):
            raise InvalidDataError(f"table {self.name!r} is a queue: {form.not_for_queues}")
        check_batch_size(batch_size)
        batch_size = int(batch_size)
        steps, _ = check_batch_fits(self.config, batch_size)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                # Uncounted only as far as steps were dropped since: past that, a redraw is
                # an ordinary sample, held back and counted by the rate limiter.
                free = not counted and steps <= self._redraw_allowance
                if (free or self.rate_limiter.can_sample(self.sampler.size)) and (
                    self.sampler.can_sample(batch_size)
                    # A full queue delivers what it holds rather than deadlock its writers.
                    or (self._queue_full_writers and self.sampler.size > 0)
                ):
                    break
                why = self.rate_limiter.why_sample_waits(self.sampler.size)
                self._wait(
                    deadline,
                    f"sample of {batch_size} timed out: {self.sampler.size} steps stored, "
                    f"{why or 'fewer than the batch needs'}; {self.rate_limiter.describe()}",
                    "sample",
                )
            selection = self.sampler.sample(batch_size)
            rows = self.storage.slot_info(selection.slots)
            # What a colocated reader will find at each step's next slot: its segment's
            # generation, or its successor's where the two share the slot (regions).
            next_gens = (
                self.storage.generations(selection.slots + 1) if form.next_generations else None
            )
            evictions = self._evictions
            if free:
                self._redraw_allowance -= steps
            else:
                self.rate_limiter.on_sample(int(selection.slots.size))
            self._cond.notify_all()
            if isinstance(self.sampler, QueueSampler):
                # Delivered queue segments become evictable at once, so read them now.
                if self.config.verify_reads or self.storage.unverified:
                    selection, rows = self._without_damaged(selection, rows)
                gathered = form.read(self.storage, selection.slots)
                return form.package(gathered, Drawn(selection, rows, next_gens))
        if self.storage.unverified:
            self._check_unverified(selection, rows, next_gens)
        gathered = form.read(self.storage, selection.slots)
        for _ in range(100):
            if self._verifier.check_slots(selection.slots, self.config.verify_reads):
                pass  # damaged ones unpublished: redrawn below, as overwritten rows are
            elif self._evictions == evictions:
                # Nothing was unpublished since the slots were picked, so no row was
                # overwritten during the gather (a writer unpublishes, under the lock,
                # before it copies).
                break
            with self._cond:
                # Under the lock: a writer counts an eviction before it unpublishes (under
                # the lock) and copies (after). A count read mid-way would cover an eviction
                # whose slots still look live here and are overwritten during a re-read.
                evictions = self._evictions
                gens = self.storage.generations(selection.slots)
            stale = gens != rows[..., SlotColumn.GENERATION]
            if stale.ndim > 1:
                stale = stale.any(axis=tuple(range(1, stale.ndim)))
            if not stale.any():
                break
            idx = self._redraw(stale, selection, rows, next_gens)
            gathered = form.reread(self.storage, gathered, selection.slots, idx)
        return form.package(gathered, Drawn(selection, rows, next_gens))

    def _check_unverified(
        self, selection: Selection, rows: np.ndarray, next_gens: np.ndarray | None
    ) -> None:
        """Check the drawn segments that are not verified yet (a reopened table's) before
        their rows are read, redrawing those found damaged; the rows of cold segments are
        then in memory for the read (the check reads each segment at once, a read row by
        row). The read's own checks still follow: they cover rows overwritten meanwhile."""
        for _ in range(100):
            if not self._verifier.check_slots(selection.slots):
                return
            with self._cond:
                gens = self.storage.generations(selection.slots)
            stale = gens != rows[..., SlotColumn.GENERATION]
            if stale.ndim > 1:
                stale = stale.any(axis=tuple(range(1, stale.ndim)))
            if stale.any():
                self._redraw(stale, selection, rows, next_gens)

    def _allow_redraws(self, steps: int) -> None:
        """``steps`` were dropped: as many uncounted redraws may follow (under the lock)."""
        self._evicted_steps += steps
        self._redraw_allowance = min(self.config.capacity, self._redraw_allowance + steps)

    def _drop(self, damaged: SegmentBatch) -> None:
        """Unpublish segments found damaged, count and log them (under the lock), with the
        segments that read their frames (frame stacks, see :mod:`.chains`)."""
        damaged = self._unpublish(self.storage.and_dependents(damaged))
        self.storage.count_dropped(damaged)
        self._cond.notify_all()

    def _without_damaged(
        self, selection: Selection, rows: np.ndarray
    ) -> tuple[Selection, np.ndarray]:
        """The checksums of a queue batch (under the lock, before it is read): those of its
        unverified segments (every one with ``verify_reads``). Those that fail are dropped
        from the table and from the batch, since a queue cannot redraw what it delivers in
        order."""
        if not self._verifier.check_locked(selection.slots, self.config.verify_reads):
            return selection, rows
        ok = self.storage.generations(selection.slots) == rows[:, SlotColumn.GENERATION]
        self.rate_limiter.on_give_back(int((~ok).sum()))
        if not ok.any():
            raise StorageCorruptedError(
                f"table {self.name!r}: every queued segment of this batch failed its checksum "
                "and was dropped (damaged on disk, see the shard's log); sample again"
            )
        lengths = selection.segment_lengths
        if lengths is not None:
            lengths = lengths[ok[np.cumsum(lengths) - lengths]]
        kept = Selection(selection.slots[ok], None, lengths, selection.ends[ok], None)
        return kept, rows[ok]

    def _redraw(
        self,
        stale: np.ndarray,
        selection: Selection,
        rows: np.ndarray,
        next_gens: np.ndarray | None = None,
    ) -> np.ndarray:
        """Replace the rows overwritten during the gather with fresh draws, in ``selection``
        and ``rows`` (their next slots' generations in ``next_gens``, if given); returns
        their indices, for the form to read them again."""
        idx = np.flatnonzero(stale)
        with self._cond:
            redo = self.sampler.sample(len(idx))
            rows[idx] = self.storage.slot_info(redo.slots)
            if next_gens is not None:
                next_gens[idx] = self.storage.generations(redo.slots + 1)
        selection.slots[idx] = redo.slots
        # A redrawn slice may be shorter or longer than the one it replaces: its marks too.
        for field in ("weights", "ends", "mask"):
            mine, fresh = getattr(selection, field), getattr(redo, field)
            if mine is not None and fresh is not None:
                mine[idx] = fresh
        return idx

    def give_back(self, batch: TensorDictBase) -> int:
        """Undo a sample that could not be delivered; returns the steps given back.

        The rate limiter stops counting them, so a learner whose call was cancelled while
        the limiter held it is not charged for steps it never saw. A queue table also queues
        the segments again, first; those writers have overwritten since (they became
        evictable when delivered) are gone and are not given back.
        """
        slots = batch["index", "slot"].reshape(-1).numpy()
        gens = batch["index", "generation"].reshape(-1).numpy()
        if len(slots) == 0:
            return 0
        if not isinstance(self.sampler, QueueSampler):
            with self._cond:
                self.rate_limiter.on_give_back(len(slots))
                self._cond.notify_all()
            return len(slots)
        first = np.flatnonzero(np.r_[True, gens[1:] != gens[:-1]])
        lengths = np.diff(np.r_[first, len(gens)])
        with self._cond:
            live = self.storage.generations(slots[first]) == gens[first]
            segments = [
                (int(gens[i]), int(slots[i]), int(n))
                for i, n, ok in zip(first, lengths, live)
                if ok
            ]
            self.sampler.requeue(segments)
            self.rate_limiter.on_give_back(sum(n for _, _, n in segments))
            self._cond.notify_all()
        return sum(n for _, _, n in segments)
