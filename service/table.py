"""A table: segment storage + a sampler + a rate limiter, behind one lock.

Writers allocate a contiguous block of slots under the lock (evicting the oldest segments
there), copy their data outside it, and publish under it. Samplers pick slots under the
lock; the gather runs outside it and is checked afterwards against the slots'
generations, so a row overwritten meanwhile is drawn again rather than returned torn.
The table's directory (its files, opening and recovery) is :mod:`.table_files`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.checks import as_int64
from millpond.config import MAX_CAPACITY, TableConfig
from millpond.errors import (
    ClosedError,
    InvalidConfigError,
    InvalidDataError,
    RateLimiterTimeoutError,
    StorageCorruptedError,
)
from millpond.frame_stacks import compact_stacks, stack_examples
from millpond.routing import writer_hash
from millpond.sample_format import ColocatedSample, SlotSample, assemble_ted, distinct_rows
from millpond.segments import PackedSegments, Segment, pack
from millpond.service.rate_limiter import RateLimiter
from millpond.service.regions import Placement, Regions
from millpond.service.samplers import (
    PrioritizedSampler,
    QueueSampler,
    Sampler,
    Selection,
    UniformSampler,
)
from millpond.service.segment_batch import SegmentBatch
from millpond.service.slice_sampler import SliceSampler
from millpond.service.storage import (
    SLOT_STEP,
    SegmentStorage,
    SlotColumn,
)
from millpond.service.table_files import (
    CONFIG_COPY,
    COUNTERS_FILE,
    META_FILE,
    TableFiles,
    check_files,
    new_table_dir,
    os_error,
    read_config,
    read_config_copy,
    restorable,
)
from millpond.spec import DONE, OBSERVATION, STEP, TERMINATED, TRUNCATED, Key, TableSpec
from millpond.ted import OpenEpisodes, compact_ted, episode_base

log = logging.getLogger(__name__)


class Table:
    """One named table of a shard, stored under its own directory.

    Use :meth:`create` for a new table and :meth:`open` to resume one from disk.
    """

    def __init__(self, path: Path, config: TableConfig, *, fsync: bool, fresh: bool) -> None:
        self.path = path
        self.config = config
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._inflight: dict[int, int] = {}  # start -> slots of what is being copied
        self._queue_full_writers = 0  # writers waiting for a learner to drain a full queue
        self._evictions = 0  # bumped (under the lock) whenever published slots are dropped
        # Steps that uncounted redraws may still take: those dropped since (a row is only
        # ever stale because its slot was overwritten), so that a client asking for
        # "redraws" cannot sample past the rate limiter.
        self._redraw_allowance = 0
        self._evicted_steps = 0  # since the table opened (Prometheus counters start at 0)
        self._waiting = {"insert": 0, "sample": 0}  # calls held back now, by side
        # Trajectories extend() left open, by episode id (every source's ids differ): their
        # next step and last next observation, so a trajectory that continues in the next
        # call keeps counting its steps (and slices chain across calls).
        self._extend_state: OpenEpisodes = {}
        self._extend_lock = threading.Lock()
        # Highest stored sequence per writer hash, for idempotent re-sends.
        self._writer_hwm: dict[int, int] = {}
        self._writer_locks: dict[int, threading.Lock] = {}
        self._files = TableFiles(path, fresh=fresh)
        self.storage = SegmentStorage(
            path / "data", config.capacity, config.spec, fsync=fsync, stacks=config.frame_stacks
        )
        # Where writers' short segments go (none in tables without a record per slot).
        self._regions = Regions(config.capacity if self.storage.continuations else 0)
        try:
            c = config
            self.rate_limiter = RateLimiter(
                c.min_size,
                c.samples_per_insert,
                c.effective_error_buffer,
                self._files.limiter_counters,
            )
            self.sampler = _make_sampler(config, path)
            if fresh:
                self._write_meta()
            else:
                recovered = self._files.recover(self.storage, self.sampler)
                self._writer_hwm = recovered.writer_sequences
                # The last next observations are not recovered: a reopened table takes a
                # trajectory's continuation on its id alone.
                self._extend_state = {ep: (n, None) for ep, n in recovered.open_episodes.items()}
        except BaseException:
            self.storage.close()  # its descriptors; the maps go with the object
            raise

    # -- construction --------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, config: TableConfig, *, fsync: bool = False) -> Table:
        """A new, empty table in directory ``path`` (which must not hold a table already).

        A create that fails leaves nothing behind (so the name can be created again), and
        an OSError is raised as the millpond error it means: disk full or out of memory
        (:class:`ResourceExhaustedError`), a name too long (:class:`InvalidConfigError`),
        a directory not writable (:class:`StorageCorruptedError`).
        """
        path = Path(path)
        if config.capacity > MAX_CAPACITY:  # before anything is on disk
            raise InvalidConfigError(
                f"table {config.name!r}: capacity ({config.capacity}) exceeds the largest the "
                f"storage can address ({MAX_CAPACITY} slots: slot pointers and segment records "
                "are int32)"
            )
        what = f"cannot create table {config.name!r}"
        try:
            new_table_dir(path)
        except OSError as e:
            raise os_error(e, what) from None
        try:
            return cls(path, config, fsync=fsync, fresh=True)
        except BaseException as e:
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(e, OSError):
                raise os_error(e, what) from None
            raise

    @classmethod
    def open(
        cls, path: str | os.PathLike, *, fsync: bool = False, name: str | None = None
    ) -> Table:
        """Resume the table stored in ``path``: data, priorities, queue position and counters.

        Files that are missing, unreadable, or not the ones ``meta.json`` describes (nor,
        given a ``name``, that table's) raise :class:`StorageCorruptedError` naming the file
        and the fix; nothing is rewritten.
        """
        path = Path(path)
        try:
            restore = restorable(path)
            config = (read_config_copy if restore else read_config)(path, name)
            check_files(path, config)
            table = cls(path, config, fsync=fsync, fresh=False)
            if restore:
                table._write_meta()
                log.warning(
                    "%s was missing: rebuilt from %s, with the counters of %s",
                    path / META_FILE,
                    path / CONFIG_COPY,
                    path / COUNTERS_FILE,
                )
            return table
        except OSError as e:
            raise os_error(e, f"cannot open the table in {path}") from None

    def _write_meta(self) -> None:
        self._files.write_meta(self.config, self._writer_hwm)

    # -- properties ----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def spec(self) -> TableSpec | None:
        return self.storage.spec

    @property
    def size(self) -> int:
        """Steps currently stored and sampleable."""
        return self.sampler.size

    # -- insert --------------------------------------------------------------------------
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
        to overlap, then cut to frames) or as frames already.
        """
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

    def extend(
        self, td: TensorDictBase, timeout: float | None = None, source: str | None = None
    ) -> np.ndarray:
        """Insert TED data (a TorchRL collector's output: ``[T]``, ``[P, T]``, ``[B, P, T]``,
        or ``split_trajs`` padded trajectories).

        The data is compacted (:func:`millpond.ted.compact_ted`): cut into segments at
        episode ends, trajectory changes and wherever ``("next", obs)[t]`` differs from
        ``obs[t + 1]``, each observation then stored once. Trajectory ids belong to their
        ``source``: give each producer (collector) its own, so that their trajectories are
        never joined; ``None`` is the table's default source. Returns the generations of the
        stored segments.
        """
        base = 0 if source is None else episode_base(source)
        with self._extend_lock:  # one extend at a time keeps step counts consistent
            state = dict(self._extend_state)
            packed = compact_ted(td, state, base)
            gens = self.insert_packed(packed, timeout)
            self._extend_state = state  # only once the insert succeeded
            return gens

    def _check_spec(self, packed: PackedSegments) -> PackedSegments:
        """``packed`` checked against the spec (set from it if there is none yet), its
        frame-stacked keys as frames."""
        packed = compact_stacks(packed, self.config.frame_stacks)
        stacks = stack_examples(packed)
        spec = self.storage.spec
        if spec is None:
            with self._cond:
                if self.storage.spec is None:
                    inferred = TableSpec.from_example(packed.steps, {**packed.tails, **stacks})
                    config = self.config.with_spec(inferred)  # checks the table's bytes first
                    self.storage.set_spec(inferred)
                    self.config = config
                    self._write_meta()
                spec = self.storage.spec
        assert spec is not None
        spec.check({**packed.tails, **stacks}, (OBSERVATION,), "tail")
        spec.check({**packed.steps, **stacks}, (OBSERVATION, STEP), "steps")
        return packed

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
                n_slots = place.block_slots
                start = self.storage.next_start(n_slots) if n_slots else self.storage.cursor
                if n_slots and self._regions.overlaps(place, start, n_slots):
                    self._regions.forget(start, n_slots)  # the block takes their room
                    continue
                reason = None
                writes = place.ranges(start, packed.lengths)
                if n_slots:
                    writes.append((start, n_slots))
                if not self.rate_limiter.can_insert():
                    reason = (
                        f"the rate limiter holds inserts back: "
                        f"{self.rate_limiter.why_insert_waits()} ({self.rate_limiter.describe()})"
                    )
                elif any(self._overlaps_inflight(s, n) for s, n in writes):
                    reason = "the slots are being written by another writer"
                else:
                    victims = self.storage.published_in(start, n_slots)
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
            self.storage.reserve_space(0, end, len(packed))
            self.sampler.reserve_space(end)
            if len(victims):
                self._evictions += 1
                self._allow_redraws(int(victims.lengths.sum()))
            self.storage.unpublish(victims)
            self.sampler.on_evict(victims)
            if n_slots:
                self._regions.forget(start, n_slots)
                self.storage.reserve(start, n_slots)
            self._regions.commit(place, start)
            records = self.storage.take_records(len(packed))
            for s, n in writes:
                self._inflight[s] = n
        layout = SegmentBatch(
            place.absolute(start),
            packed.lengths,
            np.zeros(len(packed), dtype=np.int64),
            packed.episode_ids,
            packed.first_steps,
            np.full(len(packed), writer, dtype=np.int64),
            packed.sequences,
        )
        try:
            self.storage.write(layout, packed.steps, packed.tails, packed.frames, records)
        except BaseException:
            with self._cond:
                self.storage.return_records(records)
                self._regions.abandon(writer)
                for s, _ in writes:
                    del self._inflight[s]
                self._cond.notify_all()
            raise
        with self._cond:
            first_gen = self._files.take_generations(len(packed))
            layout.generations = np.arange(first_gen, first_gen + len(packed), dtype=np.int64)
            self.storage.publish(layout, records)
            self.sampler.on_publish(layout)
            self.rate_limiter.on_insert(packed.num_steps)
            if writer and packed.sequences is not None:
                self._writer_hwm[writer] = max(
                    self._writer_hwm.get(writer, 0), int(packed.sequences[-1])
                )
            for s, _ in writes:
                del self._inflight[s]
            self._cond.notify_all()
        return layout.generations

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

    # -- sample --------------------------------------------------------------------------
    def sample(
        self, batch_size: int, timeout: float | None = None, *, counted: bool = True
    ) -> TensorDict:
        """Sample ``batch_size`` steps (``[B, slice_len]`` for slices tables) as a TED TensorDict.

        Blocks until the rate limiter and the sampler allow it, up to ``timeout`` seconds.
        Queue tables return whole segments, in order: at most ``batch_size`` steps, waiting
        until that many are queued, or less when the queue is full and writers wait on it.
        ``counted=False``: see :meth:`sample_colocated`.
        """
        return self._sample(batch_size, timeout, form="ted", counted=counted)

    def sample_slots(
        self, batch_size: int, timeout: float | None = None, *, counted: bool = True
    ) -> SlotSample:
        """:meth:`sample`, drawn alike, with each distinct observation slot read once
        (what the servicer sends): ``sample_slots(...).to_ted()`` equals :meth:`sample`
        on the same table and seed, bit for bit. ``counted=False``: see
        :meth:`sample_colocated`."""
        return self._sample(batch_size, timeout, form="slots", counted=counted)

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
        if isinstance(self.sampler, QueueSampler):
            raise InvalidDataError(
                f"table {self.name!r} is a queue: its delivered segments become evictable at "
                "once, so they are sampled with their observations, never read afterwards"
            )
        return self._sample(batch_size, timeout, form="colocated", counted=counted)

    def _sample(
        self, batch_size: int, timeout: float | None, *, form: str = "ted", counted: bool = True
    ):
        """One batch in ``form``: ``"ted"`` (:meth:`sample`), ``"slots"``
        (:meth:`sample_slots`) or ``"colocated"`` (:meth:`sample_colocated`); all draw alike
        and differ only in what they read."""
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int | np.integer)
            or batch_size < 1
        ):
            raise InvalidDataError(f"batch_size ({batch_size!r}) must be a positive integer")
        batch_size = int(batch_size)
        if isinstance(self.sampler, QueueSampler) and batch_size > self.config.capacity:
            raise InvalidDataError(
                f"batch_size ({batch_size}) exceeds the queue's capacity ({self.config.capacity})"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        steps = batch_size * (self.config.slice_len or 1)
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
                self.storage.generations(selection.slots + 1) if form == "colocated" else None
            )
            evictions = self._evictions
            if free:
                self._redraw_allowance -= steps
            else:
                self.rate_limiter.on_sample(int(selection.slots.size))
            self._cond.notify_all()
            if isinstance(self.sampler, QueueSampler):
                # Delivered queue segments become evictable at once, so read them now.
                if form == "ted":
                    now, nxt = self.storage.gather(selection.slots)
                    if self.config.verify_reads:
                        selection, rows = self._without_damaged(selection, rows, now, nxt)
                    return _as_ted(now, nxt, selection, rows)
                if self.config.verify_reads:
                    selection, rows = self._without_damaged(selection, rows, None, None)
                return _packaged(
                    form, self._read(form, selection.slots), selection, rows, next_gens
                )
        gathered = self._read(form, selection.slots)
        for _ in range(100):
            if self.config.verify_reads and self._drop_damaged(selection.slots, rows):
                pass  # unpublished: redrawn below, as overwritten rows are
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
            if form == "ted":  # only the redrawn rows are read again
                self._redraw(stale, selection, rows, *gathered)
            else:  # the distinct slots change with the redrawn ones: read them all again
                self._redraw(stale, selection, rows, None, None, next_gens)
                gathered = self._read(form, selection.slots)
        return _packaged(form, gathered, selection, rows, next_gens)

    def _read(self, form: str, slots: np.ndarray) -> tuple:
        """What a batch of ``form`` reads of the sampled ``slots``."""
        if form == "ted":
            return self.storage.gather(slots)
        if form == "slots":
            return self.storage.gather_slots(slots)
        return (self.storage.gather_steps(slots),)

    def _drop_damaged(self, slots: np.ndarray, rows: np.ndarray) -> bool:
        """``verify_reads``: unpublish the sampled segments whose data no longer matches
        their checksum; whether there were any. The check runs outside the lock and again
        under it, so a segment a writer overwrote meanwhile is not taken for damaged."""
        ok = self.storage.verify(slots)
        if ok.all():
            return False
        with self._cond:
            suspects = slots[~ok]
            live = self.storage.generations(suspects) == rows[..., SlotColumn.GENERATION][~ok]
            suspects = suspects[live]
            damaged = self.storage.segments_at(suspects[~self.storage.verify(suspects)])
            if not len(damaged):
                return False
            self._drop(damaged)
        return True

    def _allow_redraws(self, steps: int) -> None:
        """``steps`` were dropped: as many uncounted redraws may follow (under the lock)."""
        self._evicted_steps += steps
        self._redraw_allowance = min(self.config.capacity, self._redraw_allowance + steps)

    def _drop(self, damaged: SegmentBatch) -> None:
        """Unpublish segments found damaged, count and log them (under the lock)."""
        self._evictions += 1
        self._allow_redraws(int(damaged.lengths.sum()))
        self.storage.unpublish(damaged)
        self.sampler.on_evict(damaged)
        self.storage.count_dropped(damaged)
        self._cond.notify_all()

    def _without_damaged(
        self, selection: Selection, rows: np.ndarray, now: dict | None, nxt: dict | None
    ) -> tuple[Selection, np.ndarray]:
        """``verify_reads`` on a queue batch (under the lock): the segments that fail their
        checksum are dropped from the table and from the batch (``now`` and ``nxt`` are cut
        in place), since a queue cannot redraw what it delivers in order."""
        ok = self.storage.verify(selection.slots)
        if ok.all():
            return selection, rows
        self._drop(self.storage.segments_at(selection.slots[~ok]))
        self.rate_limiter.on_give_back(int((~ok).sum()))
        if not ok.any():
            raise StorageCorruptedError(
                f"table {self.name!r}: every queued segment of this batch failed its checksum "
                "and was dropped (damaged on disk, see the shard's log); sample again"
            )
        keep = torch.from_numpy(ok)
        for d in (now, nxt) if now is not None and nxt is not None else ():
            for k, v in d.items():
                d[k] = v[keep]
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
        now: dict[Key, torch.Tensor] | None,
        nxt: dict[Key, torch.Tensor] | None,
        next_gens: np.ndarray | None = None,
    ) -> None:
        """Replace the rows overwritten during the gather with fresh draws (and their
        gathered values, unless ``now`` is ``None``; their next slots' generations in
        ``next_gens``, if given)."""
        idx = np.flatnonzero(stale)
        with self._cond:
            redo = self.sampler.sample(len(idx))
            rows[idx] = self.storage.slot_info(redo.slots)
            if next_gens is not None:
                next_gens[idx] = self.storage.generations(redo.slots + 1)
        selection.slots[idx] = redo.slots
        if selection.weights is not None and redo.weights is not None:
            selection.weights[idx] = redo.weights
        if now is None or nxt is None:
            return
        r_now, r_nxt = self.storage.gather(redo.slots)
        t_idx = torch.from_numpy(idx)
        for d, r in ((now, r_now), (nxt, r_nxt)):
            for k, v in r.items():
                d[k][t_idx] = v

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

    # -- priorities ----------------------------------------------------------------------
    def update_priorities(
        self,
        slots: np.ndarray | torch.Tensor,
        generations: np.ndarray | torch.Tensor,
        priorities: np.ndarray | torch.Tensor,
    ) -> int:
        """Set priorities of sampled steps; entries whose slot was overwritten are ignored.

        Returns the number of priorities applied.
        """
        if not isinstance(self.sampler, PrioritizedSampler):
            raise InvalidDataError(
                f"table {self.name!r} uses the {self.config.sampler} sampler; "
                "priorities are only for prioritized tables"
            )
        slots = as_int64(slots)
        gens = as_int64(generations)
        prios = np.asarray(
            priorities.detach().cpu().numpy()
            if isinstance(priorities, torch.Tensor)
            else priorities,
            dtype=np.float64,
        ).reshape(-1)
        if not (len(slots) == len(gens) == len(prios)):
            raise InvalidDataError(
                f"update_priorities: {len(slots)} slots, {len(gens)} generations and "
                f"{len(prios)} priorities; they must be equal in number"
            )
        if len(slots) and (slots.min() < 0 or slots.max() >= self.config.capacity):
            raise InvalidDataError(f"slot out of range [0, {self.config.capacity})")
        if not np.all(np.isfinite(prios)) or np.any(prios < 0):
            raise InvalidDataError("priorities must be finite and >= 0")
        with self._cond:
            self._check_open()
            info = self.storage.slot_info(slots)
            live = info[:, SlotColumn.GENERATION] == gens
            live &= (gens > 0) & (info[:, SlotColumn.KIND] == SLOT_STEP)
            self.sampler.update(slots[live], prios[live])
            self._cond.notify_all()
            return int(live.sum())

    # -- admin ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Size, capacity, counters, rate-limiter and sampler state, bytes on disk."""
        with self._cond:
            return {
                "name": self.name,
                "sampler": self.config.sampler,
                "capacity": self.config.capacity,
                "size": self.sampler.size,
                "mass": self.sampler.mass,
                "inserts": self.rate_limiter.inserts,
                "samples": self.rate_limiter.samples,
                "rate_limiter": self.rate_limiter.state(),
                "sampler_state": self.sampler.state(),
                "next_generation": self._files.next_generation,
                "dropped_segments": len(self.storage.corrupted),
                "blocked_inserts": self._waiting["insert"],
                "blocked_samples": self._waiting["sample"],
                "bytes_on_disk": self.storage.nbytes_on_disk(),
                "spec": self.spec.to_json() if self.spec is not None else None,
            }

    def configure(self, **settings: Any) -> TableConfig:
        """Change live settings of the running table (``min_size``, ``samples_per_insert``,
        ``error_buffer``; ``alpha``, ``beta`` of a prioritized table; see
        :meth:`TableConfig.configured`); returns the config now.

        The change applies at once — inserts and samples held back are woken to check
        again under the new bounds; the counts so far are kept — and is written to the
        table's files, so it persists across restarts. A bad value raises
        :class:`InvalidConfigError` and changes nothing.
        """
        with self._cond:
            self._check_open()
            config = self.config.configured(**settings)
            c = config
            limiter = RateLimiter(
                c.min_size,
                c.samples_per_insert,
                c.effective_error_buffer,
                self._files.limiter_counters,  # the same counts, under the new bounds
            )
            previous = self.config
            self.config = config
            try:
                self._write_meta()
            except BaseException:
                self.config = previous  # not persisted: not applied either
                raise
            self.rate_limiter = limiter
            if isinstance(self.sampler, PrioritizedSampler):
                self.sampler.set_exponents(c.alpha, c.beta)
            self._cond.notify_all()
            return config

    def metrics(self) -> dict[str, float]:
        """What a metrics scrape reads (:mod:`millpond.service.metrics`): counts since the
        table was created (inserted, sampled) or opened (evicted), and gauges of now."""
        with self._cond:
            inserted, sampled = self.rate_limiter.inserts, self.rate_limiter.samples
            spi = self.config.samples_per_insert
            values: dict[str, float] = {
                "inserted": inserted,
                "sampled": sampled,
                "evicted": self._evicted_steps,
                "size": self.sampler.size,
                "capacity": self.config.capacity,
                "samples_per_insert": sampled / inserted if inserted else 0.0,
                "samples_per_insert_target": float("nan") if spi is None else spi,
                "blocked_inserts": self._waiting["insert"],
                "blocked_samples": self._waiting["sample"],
                "queue_depth": self.sampler.size if isinstance(self.sampler, QueueSampler) else 0,
                "dropped_segments": len(self.storage.corrupted),
            }
        values["bytes_on_disk"] = self.storage.nbytes_on_disk()  # walks files: not locked
        return values

    def checkpoint(self) -> None:
        """Flush every file to disk and rewrite ``meta.json`` atomically."""
        with self._cond:
            self._check_open()
            self.storage.flush()
            self._files.flush()
            self.sampler.flush()
            self._write_meta()

    def reset(self) -> None:
        """Drop every stored step and zero the counters; the spec and config stay."""
        with self._cond:
            while self._inflight:
                self._cond.wait()
            self._evictions += 1
            self._allow_redraws(self.sampler.size)
            self.storage.clear()
            self._regions.clear()
            self.sampler.reset(self._files.reset_counters())
            self._write_meta()
            self._cond.notify_all()

    def close(self) -> None:
        """Checkpoint and release the files; blocked callers get :class:`ClosedError`."""
        with self._cond:
            if self._closed:
                return
            while self._inflight:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
            try:
                self.storage.flush()
                self._files.flush()
                self.sampler.flush()
                self._write_meta()
            finally:
                # Released even when the last checkpoint fails (a full disk): every
                # acknowledged segment is in the files already, and reopening recovers it.
                self.storage.close()

    def destroy(self) -> None:
        """Close the table and delete its directory."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def reading(self) -> Iterator[SegmentStorage]:
        """Hold the table's lock while reading its storage directly (an export, say).

        Inserts, samples and priority updates wait meanwhile; nothing may be modified.
        """
        with self._cond:
            self._check_open()
            yield self.storage

    # -- helpers -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"table {self.name!r} is closed")

    def _wait(self, deadline: float | None, message: str, side: str) -> None:
        """Wait (under the lock) to be woken, ``side`` (``"insert"`` or ``"sample"``)
        counted as held back meanwhile."""
        self._waiting[side] += 1
        try:
            if deadline is None:
                self._cond.wait()
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (not self._cond.wait(remaining) and time.monotonic() >= deadline):
                raise RateLimiterTimeoutError(message)
        finally:
            self._waiting[side] -= 1


def _make_sampler(config: TableConfig, directory: Path) -> Sampler:
    c = config
    if c.sampler == "uniform":
        return UniformSampler(c.capacity, c.seed)
    if c.sampler == "prioritized":
        return PrioritizedSampler(c.capacity, c.alpha, c.beta, c.seed, directory=directory)
    if c.sampler == "queue":
        return QueueSampler(c.capacity, c.seed, directory=directory)
    assert c.slice_len is not None
    return SliceSampler(c.capacity, c.slice_len, c.seed, c.strict_length)


def _as_ted(now: dict, nxt: dict, selection: Selection, rows: np.ndarray) -> TensorDict:
    """The sampled steps in TED form, their slot metadata read from ``rows`` (``slot_info``)."""
    return assemble_ted(
        now,
        nxt,
        selection.slots,
        generations=rows[..., SlotColumn.GENERATION],
        episode_ids=rows[..., SlotColumn.EPISODE_ID],
        steps=rows[..., SlotColumn.STEP],
        weights=selection.weights,
        ends=selection.ends,
        mask=selection.mask,
    )


def _packaged(
    form: str,
    gathered: tuple,
    selection: Selection,
    rows: np.ndarray,
    next_gens: np.ndarray | None = None,
):
    """The sampled steps in ``form`` (see :meth:`Table._sample`) from what it read."""
    if form == "ted":
        return _as_ted(*gathered, selection, rows)
    if form == "slots":
        return _as_slot_sample(gathered, selection, rows)
    assert next_gens is not None
    return _as_colocated(gathered[0], selection, rows, next_gens)


def _as_colocated(
    now: dict, selection: Selection, rows: np.ndarray, next_gens: np.ndarray
) -> ColocatedSample:
    """The sampled steps without observations: the distinct observation slots, and the
    generation each had when drawn (a next slot's: its step's segment's, or that of the
    successor sharing it)."""
    distinct, obs_rows, next_rows = distinct_rows(selection.slots)
    drawn = torch.from_numpy(np.ascontiguousarray(rows[..., SlotColumn.GENERATION]).reshape(-1))
    generations = torch.zeros(len(distinct), dtype=torch.int64)
    generations[next_rows.reshape(-1).long()] = torch.from_numpy(
        np.ascontiguousarray(next_gens, dtype=np.int64).reshape(-1)
    )
    generations[obs_rows.reshape(-1).long()] = drawn
    ted = _as_ted(now, {}, selection, rows)
    return ColocatedSample(ted, distinct, generations, obs_rows, next_rows)


def _as_slot_sample(gathered: tuple, selection: Selection, rows: np.ndarray) -> SlotSample:
    """The sampled steps of :meth:`SegmentStorage.gather_slots` as a :class:`SlotSample`."""
    now, observations, obs_rows, next_rows = gathered
    return SlotSample(_as_ted(now, {}, selection, rows), observations, obs_rows, next_rows)


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
