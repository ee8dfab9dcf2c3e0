"""A table: segment storage + a sampler + a rate limiter, behind one lock.

:class:`Table` holds its lifecycle (create, open, checkpoint, reset, close), its config and
live settings, info and metrics, priority updates, TED ``extend`` and the spec check. Its
inserts (admission, placement, writers' de-duplication) are :mod:`.inserts`, its samples
(draws, redraws, give-backs) :mod:`.draws`, in the forms of :mod:`.sample_forms`. The
table's directory (its files, opening and recovery) is :mod:`.table_files`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.checks import as_int64
from millpond.config import MAX_CAPACITY, TableConfig
from millpond.errors import (
    ClosedError,
    InvalidConfigError,
    InvalidDataError,
    RateLimiterTimeoutError,
)
from millpond.insert_checks import check_insert
from millpond.segments import PackedSegments
from millpond.service.draws import TableDraws
from millpond.service.inserts import TableInserts
from millpond.service.prioritized_slices import PrioritizedSliceSampler
from millpond.service.rate_limiter import RateLimiter
from millpond.service.regions import Regions
from millpond.service.samplers import (
    PrioritizedSampler,
    QueueSampler,
    Sampler,
    UniformSampler,
)
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
    open_episodes_of,
    os_error,
    read_config,
    read_config_copy,
    restorable,
)
from millpond.service.verifier import Verifier, check_verify_settings
from millpond.spec import Key, TableSpec
from millpond.ted import OpenEpisodes, compact_ted, episode_base

log = logging.getLogger(__name__)


class Table(TableInserts, TableDraws):
    """One named table of a shard, stored under its own directory.

    Use :meth:`create` for a new table and :meth:`open` to resume one from disk.
    """

    def __init__(
        self,
        path: Path,
        config: TableConfig,
        *,
        fsync: bool,
        fresh: bool,
        verify: str = "background",
        verify_rate_mb: float = 0.0,
    ) -> None:
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
        # (None: not read yet from a reopened table's data, see _open_episodes.)
        self._extend_state: OpenEpisodes | None = {}
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
        self._verifier = Verifier(config.name, self._cond, self.storage, self._drop, verify_rate_mb)
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
                recovered = self._files.recover(self.storage, self.sampler, verify == "open")
                self._writer_hwm = recovered.writer_sequences
                self._extend_state = _extend_state(recovered.open_episodes)
        except BaseException:
            self.storage.close()  # its descriptors; the maps go with the object
            raise
        if verify == "background":
            self._verifier.start()

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
        cls,
        path: str | os.PathLike,
        *,
        fsync: bool = False,
        name: str | None = None,
        verify: str = "background",
        verify_rate_mb: float = 0.0,
    ) -> Table:
        """Resume the table stored in ``path``: data, priorities, queue position and counters.

        Files that are missing, unreadable, or not the ones ``meta.json`` describes (nor,
        given a ``name``, that table's) raise :class:`StorageCorruptedError` naming the file
        and the fix; nothing is rewritten.

        The open reads the segments' records and slot pointers, not their data: each
        segment's checksum is checked before any of its rows is read, and by a background
        thread meanwhile (``verify``, one of :data:`~millpond.service.verifier.VERIFY_MODES`:
        ``"background"``, ``"reads"`` without the thread, ``"open"`` all of them before the
        open returns; ``verify_rate_mb``: the thread's bound, MiB/s, 0 for none). A damaged
        segment is dropped, counted and logged when it is found, never served.
        """
        check_verify_settings(verify, verify_rate_mb)
        path = Path(path)
        try:
            restore = restorable(path)
            config = (read_config_copy if restore else read_config)(path, name)
            check_files(path, config)
            table = cls(
                path,
                config,
                fsync=fsync,
                fresh=False,
                verify=verify,
                verify_rate_mb=verify_rate_mb,
            )
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

    # -- insert (the rest is TableInserts) -----------------------------------------------
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
            if self._extend_state is None:
                self._extend_state = self._open_episodes()
            state = dict(self._extend_state)
            packed = compact_ted(td, state, base)
            gens = self.insert_packed(packed, timeout)
            self._extend_state = state  # only once the insert succeeded
            return gens

    def _open_episodes(self) -> OpenEpisodes:
        """The episodes a reopened table holds open, read from its data once it is verified
        (when :meth:`extend` first needs them)."""
        self.verify_all()
        with self.reading() as storage:
            segments = storage.segments_at(storage.published_step_slots())
            return _extend_state(open_episodes_of(storage, segments)) or {}

    def _check_spec(self, packed: PackedSegments) -> PackedSegments:
        """``packed`` checked against the spec (set from it if there is none yet), its
        frame-stacked keys as frames: the rule a writer applies too (:mod:`millpond.insert_checks`)."""
        packed, _ = check_insert(
            packed, self.config.frame_stacks, self.storage.spec, self._adopt_spec
        )
        return packed

    def _adopt_spec(
        self, steps: dict[Key, torch.Tensor], tails: dict[Key, torch.Tensor]
    ) -> TableSpec:
        """The spec the first insert sets (another insert may have set it first)."""
        with self._cond:
            if self.storage.spec is None:
                inferred = TableSpec.from_example(steps, tails)
                config = self.config.with_spec(inferred)  # checks the table's bytes first
                self.storage.set_spec(inferred)
                self.config = config
                self._write_meta()
            assert self.storage.spec is not None
            return self.storage.spec

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
        if not isinstance(self.sampler, PrioritizedSampler | PrioritizedSliceSampler):
            raise InvalidDataError(
                f"table {self.name!r} uses the {self.config.sampler} sampler; "
                "priorities are only for prioritized and prioritized_slices tables"
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
                "unverified_segments": self.storage.unverified,
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
            if isinstance(self.sampler, PrioritizedSampler | PrioritizedSliceSampler):
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
                "unverified_segments": self.storage.unverified,
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
        self._verifier.stop()  # first, outside the lock: its thread takes the lock
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

    def verify_all(self) -> None:
        """Check every segment not verified yet (a reopened table's), in the calling thread
        along with the background verifier; damaged ones are dropped, counted and logged.
        Afterwards everything stored is verified (new segments come verified)."""
        self._verifier.finish()

    def verify_slots(self, slots: np.ndarray) -> None:
        """Check the unverified segments holding ``slots`` (any shape) before reading them
        directly (:meth:`reading`); damaged ones are dropped (their generation is then 0)."""
        self._verifier.check_slots(slots)

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


def _extend_state(open_episodes: dict[int, int] | None) -> OpenEpisodes | None:
    # The last next observations are not recovered: a reopened table takes a trajectory's
    # continuation on its id alone.
    if open_episodes is None:
        return None
    return {ep: (n, None) for ep, n in open_episodes.items()}


def _make_sampler(config: TableConfig, directory: Path) -> Sampler:
    c = config
    if c.sampler == "uniform":
        return UniformSampler(c.capacity, c.seed)
    if c.sampler == "prioritized":
        return PrioritizedSampler(c.capacity, c.alpha, c.beta, c.seed, directory=directory)
    if c.sampler == "queue":
        return QueueSampler(c.capacity, c.seed, directory=directory)
    assert c.slice_len is not None
    if c.sampler == "prioritized_slices":
        return PrioritizedSliceSampler(
            c.capacity, c.slice_len, c.alpha, c.beta, c.seed, c.strict_length, directory
        )
    return SliceSampler(c.capacity, c.slice_len, c.seed, c.strict_length)
