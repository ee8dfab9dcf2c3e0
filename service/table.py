"""A table: segment storage + a sampler + a rate limiter, behind one lock.

Writers allocate a contiguous block of slots under the lock (evicting the oldest segments
there), copy their data outside it, and publish under it. Samplers pick slots under the
lock; the gather runs outside it and is checked afterwards against the slots'
generations, so a row overwritten meanwhile is drawn again rather than returned torn.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.checks import as_int64
from millpond.config import TableConfig
from millpond.errors import (
    ClosedError,
    InvalidDataError,
    RateLimiterTimeoutError,
    StorageCorruptedError,
)
from millpond.routing import writer_hash
from millpond.sample_format import assemble_ted
from millpond.segments import PackedSegments, Segment, pack
from millpond.service.rate_limiter import RateLimiter
from millpond.service.samplers import (
    PrioritizedSampler,
    QueueSampler,
    Sampler,
    Selection,
    UniformSampler,
)
from millpond.service.slice_sampler import SliceSampler
from millpond.service.storage import SLOT_STEP, SegmentBatch, SegmentStorage, _atomic_write_json
from millpond.spec import OBSERVATION, STEP, TERMINATED, TRUNCATED, Key, TableSpec
from millpond.ted import compact_ted

_FORMAT = 1
# counters.bin: rate-limiter inserts, samples, next generation, queue cursor
_C_INSERTS, _C_SAMPLES, _C_NEXT_GEN, _C_QUEUE = 0, 1, 2, 3
_N_COUNTERS = 8


class Table:
    """One named table of a shard, stored under its own directory.

    Use :meth:`create` for a new table and :meth:`open` to resume one from disk.
    """

    def __init__(self, path: Path, config: TableConfig, *, fsync: bool, fresh: bool) -> None:
        self.path = path
        self.config = config
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._inflight: dict[int, int] = {}  # reserved block start -> slots, during copies
        self._queue_full_writers = 0  # writers waiting for a learner to drain a full queue
        self._evictions = 0  # bumped (under the lock) whenever published slots are dropped
        # Trajectories seen by extend(): episode id -> next step, so that a trajectory that
        # continues in the next call keeps counting its steps (and slices chain across calls).
        self._extend_state: dict[int, int] = {}
        self._extend_lock = threading.Lock()
        # Highest stored sequence per writer hash, for idempotent re-sends.
        self._writer_hwm: dict[int, int] = {}
        self._writer_locks: dict[int, threading.Lock] = {}
        counters_file = path / "counters.bin"
        self._counters = np.memmap(
            counters_file, dtype=np.int64, mode="w+" if fresh else "r+", shape=(_N_COUNTERS,)
        )
        self.storage = SegmentStorage(path / "data", config.capacity, config.spec, fsync=fsync)
        self._make_sampler_and_limiter()
        if fresh:
            self._counters[_C_NEXT_GEN] = 1
            self._write_meta()
        else:
            self._recover()

    # -- construction --------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, config: TableConfig, *, fsync: bool = False) -> Table:
        """A new, empty table in directory ``path`` (which must not hold a table already)."""
        path = Path(path)
        if (path / "meta.json").exists():
            raise FileExistsError(f"{path} already holds a table")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, config, fsync=fsync, fresh=True)

    @classmethod
    def open(cls, path: str | os.PathLike, *, fsync: bool = False) -> Table:
        """Resume the table stored in ``path``: data, priorities, queue position and counters."""
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.exists():
            raise StorageCorruptedError(f"{path} holds no table (missing meta.json)")
        try:
            meta = json.loads(meta_file.read_text())
            config = TableConfig.from_json(meta["config"])
        except (ValueError, KeyError) as e:
            raise StorageCorruptedError(f"{meta_file} is unreadable: {e}") from e
        if meta.get("format") != _FORMAT:
            raise StorageCorruptedError(f"{meta_file}: unknown format {meta.get('format')!r}")
        return cls(path, config, fsync=fsync, fresh=False)

    def _make_sampler_and_limiter(self) -> None:
        c = self.config
        self.rate_limiter = RateLimiter(
            c.min_size, c.samples_per_insert, c.effective_error_buffer, self._counters[0:2]
        )
        self.sampler: Sampler
        if c.sampler == "uniform":
            self.sampler = UniformSampler(c.capacity, c.seed)
        elif c.sampler == "prioritized":
            prio_file = self.path / "priorities.bin"
            prios = np.memmap(
                prio_file,
                dtype=np.float64,
                mode="r+" if prio_file.exists() else "w+",
                shape=(c.capacity + 1,),  # the last entry: the largest priority set
            )
            self._priorities_file = prios
            self.sampler = PrioritizedSampler(c.capacity, prios, c.alpha, c.beta, c.seed)
        elif c.sampler == "queue":
            self.sampler = QueueSampler(c.capacity, self._counters[_C_QUEUE : _C_QUEUE + 1], c.seed)
        else:
            assert c.slice_len is not None
            self.sampler = SliceSampler(c.capacity, c.slice_len, c.seed)

    def _recover(self) -> None:
        segments = self.storage.recover()
        if isinstance(self.sampler, PrioritizedSampler):
            self.sampler.restore(segments)
        else:
            self.sampler.on_publish(segments)
        writers_file = self.path / "writers.json"
        if writers_file.exists():
            try:
                saved = json.loads(writers_file.read_text())
                self._writer_hwm = {int(k): int(v) for k, v in saved.items()}
            except (ValueError, AttributeError) as e:
                raise StorageCorruptedError(f"{writers_file} is unreadable: {e}") from e
        if len(segments) and segments.writers is not None and segments.sequences is not None:
            for w, q in zip(segments.writers.tolist(), segments.sequences.tolist()):
                if w and q > self._writer_hwm.get(w, 0):
                    self._writer_hwm[w] = q
        self._extend_state = self._open_episodes(segments)
        newest = int(segments.generations.max()) if len(segments) else 0
        self._counters[_C_NEXT_GEN] = max(int(self._counters[_C_NEXT_GEN]), newest + 1)

    def _open_episodes(self, segments: SegmentBatch) -> dict[int, int]:
        """Episode id -> next step, for episodes whose newest stored segment did not end."""
        if not len(segments) or self.storage.spec is None:
            return {}
        order = np.lexsort((segments.first_steps, segments.episode_ids))
        eps = segments.episode_ids[order]
        newest = order[np.append(eps[1:] != eps[:-1], True)]
        last_slots = segments.starts[newest] + segments.lengths[newest] - 1
        now, _ = self.storage.gather(last_slots)
        ended = (now[TERMINATED] | now[TRUNCATED]).numpy()
        return {
            int(segments.episode_ids[i]): int(segments.first_steps[i] + segments.lengths[i])
            for i, e in zip(newest.tolist(), ended.tolist())
            if not e
        }

    def _write_meta(self) -> None:
        _atomic_write_json(
            self.path / "writers.json", {str(k): v for k, v in self._writer_hwm.items()}
        )
        _atomic_write_json(
            self.path / "meta.json",
            {
                "format": _FORMAT,
                "config": self.config.to_json(),
                "counters": {
                    "inserts": self.rate_limiter.inserts,
                    "samples": self.rate_limiter.samples,
                    "next_generation": int(self._counters[_C_NEXT_GEN]),
                    "queue_delivered_through": int(self._counters[_C_QUEUE]),
                },
            },
        )

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
        """Store segments already packed into columns (see :func:`segments.pack`)."""
        self._check_spec(packed)
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

    def extend(self, td: TensorDictBase, timeout: float | None = None) -> np.ndarray:
        """Insert TED data (batch ``[T]`` or ``[P, T]``, e.g. a TorchRL collector's output).

        The data is compacted: cut into segments at episode ends, trajectory changes and
        wherever ``("next", obs)[t]`` differs from ``obs[t + 1]``, each observation then
        stored once. Returns the generations of the stored segments.
        """

        with self._extend_lock:  # one extend at a time keeps step counts consistent
            state = dict(self._extend_state)
            packed = compact_ted(td, state)
            gens = self.insert_packed(packed, timeout)
            self._extend_state = state  # only once the insert succeeded
            return gens

    def _check_spec(self, packed: PackedSegments) -> None:
        spec = self.storage.spec
        if spec is None:
            with self._cond:
                if self.storage.spec is None:
                    inferred = TableSpec.from_example(packed.steps, packed.tails)
                    self.storage.set_spec(inferred)
                    self.config = self.config.with_spec(inferred)
                    self._write_meta()
                spec = self.storage.spec
        assert spec is not None
        spec.check(packed.tails, (OBSERVATION,), "tail")
        spec.check(packed.steps, (OBSERVATION, STEP), "steps")

    def _insert_block(
        self, packed: PackedSegments, timeout: float | None, writer: int
    ) -> np.ndarray:
        n_slots = packed.num_steps + len(packed)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                reason = None
                start = self.storage.next_start(n_slots)
                if not self.rate_limiter.can_insert():
                    reason = f"the rate limiter holds inserts back ({self._limiter_text()})"
                elif self._overlaps_inflight(start, n_slots):
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
                        self._wait(deadline, message)
                    finally:
                        self._queue_full_writers -= 1
                else:
                    self._wait(deadline, message)
            if len(victims):
                self._evictions += 1
            self.storage.unpublish(victims)
            self.sampler.on_evict(victims)
            self.storage.reserve(start, n_slots)
            self._inflight[start] = n_slots
        layout = SegmentBatch(
            start + np.concatenate([[0], np.cumsum(packed.lengths + 1)[:-1]]).astype(np.int64),
            packed.lengths,
            np.zeros(len(packed), dtype=np.int64),
            packed.episode_ids,
            packed.first_steps,
            np.full(len(packed), writer, dtype=np.int64),
            packed.sequences,
        )
        try:
            self.storage.write(layout, packed.steps, packed.tails)
        except BaseException:
            with self._cond:
                del self._inflight[start]
                self._cond.notify_all()
            raise
        with self._cond:
            first_gen = int(self._counters[_C_NEXT_GEN])
            layout.generations = np.arange(first_gen, first_gen + len(packed), dtype=np.int64)
            self._counters[_C_NEXT_GEN] = first_gen + len(packed)
            self.storage.publish(layout)
            self.sampler.on_publish(layout)
            self.rate_limiter.on_insert(packed.num_steps)
            if writer and packed.sequences is not None:
                self._writer_hwm[writer] = max(
                    self._writer_hwm.get(writer, 0), int(packed.sequences[-1])
                )
            del self._inflight[start]
            self._cond.notify_all()
        return layout.generations

    def _overlaps_inflight(self, start: int, n: int) -> bool:
        return any(s < start + n and start < s + m for s, m in self._inflight.items())

    # -- sample --------------------------------------------------------------------------
    def sample(self, batch_size: int, timeout: float | None = None) -> TensorDict:
        """Sample ``batch_size`` steps (``[B, slice_len]`` for slices tables) as a TED TensorDict.

        Blocks until the rate limiter and the sampler allow it, up to ``timeout`` seconds.
        Queue tables return whole segments, in order: at most ``batch_size`` steps, waiting
        until that many are queued, or less when the queue is full and writers wait on it.
        """
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
        with self._cond:
            while True:
                self._check_open()
                if self.rate_limiter.can_sample(self.sampler.size) and (
                    self.sampler.can_sample(batch_size)
                    # A full queue delivers what it holds rather than deadlock its writers.
                    or (self._queue_full_writers and self.sampler.size > 0)
                ):
                    break
                self._wait(
                    deadline,
                    f"sample of {batch_size} timed out: {self.sampler.size} steps stored "
                    f"(min_size {self.config.min_size}); {self._limiter_text()}",
                )
            selection = self.sampler.sample(batch_size)
            rows = self.storage.slot_info(selection.slots)
            evictions = self._evictions
            self.rate_limiter.on_sample(int(selection.slots.size))
            self._cond.notify_all()
            if isinstance(self.sampler, QueueSampler):
                # Delivered queue segments become evictable at once, so read them now.
                now, nxt = self.storage.gather(selection.slots)
                return assemble_ted(now, nxt, selection.slots, rows, selection.weights)
        now, nxt = self.storage.gather(selection.slots)
        if self._evictions == evictions:
            # Nothing was unpublished since the slots were picked, so no row was overwritten
            # during the gather (a writer unpublishes, under the lock, before it copies).
            return assemble_ted(now, nxt, selection.slots, rows, selection.weights)
        for _ in range(100):
            stale = self.storage.generations(selection.slots) != rows[..., 0]
            if stale.ndim > 1:
                stale = stale.any(axis=tuple(range(1, stale.ndim)))
            if not stale.any():
                break
            self._redraw(stale, selection, rows, now, nxt)
        return assemble_ted(now, nxt, selection.slots, rows, selection.weights)

    def _redraw(
        self,
        stale: np.ndarray,
        selection: Selection,
        rows: np.ndarray,
        now: dict[Key, torch.Tensor],
        nxt: dict[Key, torch.Tensor],
    ) -> None:
        """Replace the rows overwritten during the gather with fresh draws."""
        idx = np.flatnonzero(stale)
        with self._cond:
            redo = self.sampler.sample(len(idx))
            rows[idx] = self.storage.slot_info(redo.slots)
        selection.slots[idx] = redo.slots
        if selection.weights is not None and redo.weights is not None:
            selection.weights[idx] = redo.weights
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
                self._counters[_C_SAMPLES] -= len(slots)
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
            self._counters[_C_SAMPLES] -= sum(n for _, _, n in segments)
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
            live = (info[:, 0] == gens) & (gens > 0) & (info[:, 5] == SLOT_STEP)
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
                "next_generation": int(self._counters[_C_NEXT_GEN]),
                "bytes_on_disk": self.storage.nbytes_on_disk(),
                "spec": self.spec.to_json() if self.spec is not None else None,
            }

    def checkpoint(self) -> None:
        """Flush every file to disk and rewrite ``meta.json`` atomically."""
        with self._cond:
            self._check_open()
            self.storage.flush()
            self._counters.flush()
            if isinstance(self.sampler, PrioritizedSampler):
                self._priorities_file.flush()
            self._write_meta()

    def reset(self) -> None:
        """Drop every stored step and zero the counters; the spec and config stay."""
        with self._cond:
            while self._inflight:
                self._cond.wait()
            self._evictions += 1
            self.storage.meta[:, 0] = 0
            self.storage.cursor = 0
            next_gen = int(self._counters[_C_NEXT_GEN])
            self._counters[:] = 0
            self._counters[_C_NEXT_GEN] = next_gen  # stale indexes must stay stale
            self._counters[_C_QUEUE] = next_gen - 1
            if isinstance(self.sampler, PrioritizedSampler):
                self._priorities_file[-1] = 1.0  # new steps start from priority 1 again
            self._make_sampler_and_limiter()
            self._write_meta()
            self._cond.notify_all()

    def close(self) -> None:
        """Checkpoint and release the files; blocked callers get :class:`ClosedError`."""
        with self._cond:
            if self._closed:
                return
            while self._inflight:
                self._cond.wait()
            self.storage.flush()
            self._counters.flush()
            self._write_meta()
            self._closed = True
            self._cond.notify_all()
        self.storage.close()

    def destroy(self) -> None:
        """Close the table and delete its directory."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"table {self.name!r} is closed")

    def _wait(self, deadline: float | None, message: str) -> None:
        if deadline is None:
            self._cond.wait()
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0 or (not self._cond.wait(remaining) and time.monotonic() >= deadline):
            raise RateLimiterTimeoutError(message)

    def _limiter_text(self) -> str:
        r = self.rate_limiter
        if r.samples_per_insert is None:
            return f"inserts {r.inserts}, samples {r.samples}"
        return (
            f"inserts {r.inserts}, samples {r.samples}, samples_per_insert "
            f"{r.samples_per_insert}, diff {r.diff:g} in [{r.min_diff:g}, {r.max_diff:g}]"
        )
