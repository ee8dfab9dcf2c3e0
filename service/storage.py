"""Memory-mapped segment storage: one file per column plus slot metadata, laid out as a ring.

A segment of L steps occupies L+1 consecutive slots: L step slots, then a tail slot that
holds only the observation following the last step. So for every step slot ``i``,
``("next", obs)[i] == obs[i + 1]``: one gather, no branch, lossless at episode boundaries.

The metadata (table format 2) is two files, sized so that small observations do not pay
more for their bookkeeping than for themselves:

* ``slots.bin``: one int32 per slot, the index of the record of the segment the slot
  belongs to (0: the slot holds no published segment). 4 bytes per slot.
* ``segments.bin``: one record per segment, eight int64 (:class:`RecordField`, 64 bytes,
  one cache line): generation, episode id, step base (first step - start), start slot,
  length, tail slot, writer, sequence. Record 0 stays zero: it is what pointer 0 reads. A
  record is reused as soon as its segment is evicted (new segments take freed records
  before new ones), so the records ever written number at most the segments stored at
  once. The file has room for the most that can be stored at once (a record per slot: a
  segment that continues another on its tail slot, see :mod:`.regions`, takes one slot of
  its own at least; ``capacity // 2`` in tables with frame stacks, which get no regions)
  and is sparse: pages never written take no disk space.

* ``prefixes/<key>.bin``: for each frame-stacked observation key
  (:mod:`millpond.frame_stacks`; its column then holds one frame per slot, the newest of
  the stack there), the ``k - 1`` older frames of each segment's first stack, indexed by
  record like ``segments.bin`` and sparse alike. :meth:`SegmentStorage.gather` and
  :meth:`SegmentStorage.gather_slots` rebuild the stacks, so nothing above sees frames.
* ``checksums.bin``: one uint64 per record, the checksum of its segment's rows, prefixes
  and record (:mod:`.checksums`), sparse too. Recovery drops (and counts in
  :attr:`SegmentStorage.corrupted`) a segment whose checksum does not match, so damaged
  bytes are never served; a table written before checksums gets them on its next open.
  Row 0 (record 0 is no segment's) holds the ring's cursor + 1: writers' regions put new
  segments behind the cursor, so the newest segment does not say where the ring stopped.

The files are sparse, and storing through a map into a page that has no block yet makes the
kernel find one: on a full disk that is SIGBUS, the death of the process. So every insert
first reserves the blocks it will store into (:meth:`SegmentStorage.reserve_space`, in
chunks ahead of use, see :mod:`.disk_space`); a full disk then refuses the insert with
:class:`~millpond.errors.ResourceExhaustedError` before anything changes.

Everything else a slot needs is derived: its episode id and generation from its record,
its step as ``step base + slot``, its kind (step or tail) from whether it is the tail slot. :meth:`SegmentStorage.slot_info` decodes slots into rows of the
:class:`SlotColumn` fields: one gather of pointers, one of records, two fixes.

The record's generation is the commit marker: it is written last, after the segment's data,
its record and its slots' pointers, and cleared first when the segment is overwritten. On
reopen, a record counts only if its generation is set and every one of its L+1 slots points
at it, so a copy or a publication that was interrupted (a killed process) is never visible.
Generations are never reused, so a reader that compares a slot's generation before and
after reading its rows sees any overwrite in between.

This class does no locking: :class:`~millpond.service.table.Table` serialises allocation and
publication and lets the copies run outside its lock.
"""

from __future__ import annotations

import json
import logging
import os
from enum import IntEnum
from pathlib import Path

import numpy as np
import torch
from tensordict import MemoryMappedTensor

from millpond.config import MAX_CAPACITY  # slot pointers and records are int32
from millpond.errors import InvalidConfigError, StorageCorruptedError
from millpond.frame_stacks import PREFIX_DIR, check_stacks, rebuild
from millpond.sample_format import distinct_rows
from millpond.service import checksums as cks
from millpond.service.atomic_json import atomic_write_json
from millpond.service.disk_space import Reservation, create_sparse, data_end
from millpond.service.segment_batch import SegmentBatch, check_step_range, ranges
from millpond.spec import OBSERVATION, FieldSpec, Key, TableSpec, format_key
from millpond.storage_format import (  # the format a reader on the same host shares
    RECORD_WIDTH,
    SEGMENTS_FILE,
    SLOTS_FILE,
    RecordField,
    column_filename,
    num_records,
    records_in,
)

#: Values of the :attr:`SlotColumn.KIND` column.
SLOT_EMPTY, SLOT_STEP, SLOT_TAIL = 0, 1, 2

CHECKSUMS_FILE = cks.CHECKSUMS_FILE

log = logging.getLogger(__name__)

_MAX_STEP = np.iinfo(np.int64).max


class SlotColumn(IntEnum):
    """The fields of a decoded slot (``slot_info`` rows; derived, not stored per slot)."""

    GENERATION = 0  # the segment's publication number, 0 if none
    EPISODE_ID = 1
    STEP = 2  # index within its episode (a tail slot: one past the segment's last step)
    SEGMENT_START = 3
    SEGMENT_LENGTH = 4
    KIND = 5  # SLOT_STEP or SLOT_TAIL (SLOT_EMPTY: no published segment)
    WRITER = 6  # hash of the writer that sent the segment (0: anonymous)
    SEQUENCE = 7  # the segment's number in its writer's stream


_META_WIDTH = len(SlotColumn)
#: Rows at least this large are written with one slice copy per segment.
_ROW_COPY_BYTES = 1024


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in C order, as a flat view (a copy only if it is not contiguous)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


class SegmentStorage:
    """The ring of slots of one table, in memory-mapped files under ``path``.

    Args:
        path: the table's directory (created if needed).
        capacity: number of slots.
        spec: the table's keys, or ``None`` until the first insert provides them
            (see :meth:`set_spec`).
        fsync: make :meth:`publish` flush the written files to disk, so that a published
            segment survives a machine crash, not only a killed process.
        stacks: the frame-stacked observation keys and their frame counts
            (``TableConfig.frame_stacks``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        capacity: int,
        spec: TableSpec | None,
        *,
        fsync: bool = False,
        stacks: dict[Key, int] | None = None,
    ) -> None:
        if capacity > MAX_CAPACITY:
            raise InvalidConfigError(
                f"capacity ({capacity}) exceeds the largest the storage can address "
                f"({MAX_CAPACITY} slots: slot pointers and segment records are int32)"
            )
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.fsync = fsync
        self.spec: TableSpec | None = None
        self.columns: dict[Key, torch.Tensor] = {}
        #: Frame-stacked keys: their frame counts, and their prefix columns
        #: (``[records, k - 1, *frame]``).
        self.stacks: dict[Key, int] = dict(stacks or {})
        self.prefixes: dict[Key, torch.Tensor] = {}
        self._prefix_bytes: list[np.ndarray] = []
        self._fds: list[int] = []
        slots_file, records_file = self.path / SLOTS_FILE, self.path / SEGMENTS_FILE
        fresh = not slots_file.exists()
        if fresh:
            n_records = num_records(capacity, stacked=bool(self.stacks))
        else:  # as many as it was made with (tables made before regions: half as many)
            if not records_file.exists():
                raise StorageCorruptedError(f"{records_file} is missing")
            try:
                n_records = records_in(records_file.stat().st_size, capacity)
            except (OSError, ValueError) as e:
                raise StorageCorruptedError(f"{records_file}: {e}") from e
        #: Whether a segment may take one slot of its own (continue another on its tail,
        #: see .regions): there is a record for every slot.
        self.continuations = n_records > capacity // 2 + 1
        # Disk blocks are reserved before pages are first written (see reserve_space).
        self.table_dir = self.path.parent if self.path.name == "data" else self.path
        self._slot_space = Reservation(self.table_dir, capacity, "slots")
        # Sized for segments of two slots or more: one-slot ones are rare but for regions.
        self._record_space = Reservation(
            self.table_dir, n_records, "segment records", typical=capacity // 2 + 1
        )
        self._claimed_records = 0  # segments reserved for and not yet published
        try:
            self._open_files(slots_file, records_file, n_records, fresh, spec)
        except BaseException:
            # A half-opened storage is unreachable to its table: release what it holds.
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            raise

    def _open_files(
        self,
        slots_file: Path,
        records_file: Path,
        n_records: int,
        fresh: bool,
        spec: TableSpec | None,
    ) -> None:
        self._slot_map = self._open_map(slots_file, np.dtype(np.int32), (self.capacity,), fresh)
        self._slot_space.add(self._fds[-1], 4, SLOTS_FILE)
        # Reads through the maps stay below what has blocks (or is reserved): on tmpfs,
        # reading a hole takes a page too, a SIGBUS on a full disk. Beyond: zeros.
        self._slots_on_disk = -(-data_end(self._fds[-1]) // 4)
        self._record_map = self._open_map(
            records_file, np.dtype(np.int64), (n_records, RECORD_WIDTH), fresh
        )
        self._record_space.add(self._fds[-1], RECORD_WIDTH * 8, SEGMENTS_FILE)
        self._records_on_disk = -(-data_end(self._fds[-1]) // (RECORD_WIDTH * 8))
        # A format-2 table written before checksums has none: recover() computes them.
        self._unchecked = not fresh and not (self.path / CHECKSUMS_FILE).exists()
        self._checksum_map = self._open_map(
            self.path / CHECKSUMS_FILE, np.dtype(np.uint64), (n_records,), fresh or self._unchecked
        )
        self._record_space.add(self._fds[-1], 8, CHECKSUMS_FILE)
        #: Per segment record: its checksum (see :mod:`.checksums`).
        self.checksums = self._checksum_map.view(np.ndarray)
        self._column_bytes: list[tuple[np.ndarray, int]] = []
        self._column_fds: dict[Key, int] = {}  # large rows are written with pwrite
        #: Segments that recovery dropped for a checksum or a record that does not hold up:
        #: ``(episode id, first slot, length)`` each.
        self.corrupted: list[tuple[int, int, int]] = []
        # Plain ndarray views of the same pages: numpy's memmap subclass adds microseconds of
        # __array_finalize__ to every indexing, which dominates small samples and inserts.
        #: Per slot: 1 + the index of its segment's record, 0 if none.
        self.slot_records = self._slot_map.view(np.ndarray)
        #: Per segment record: a row of :class:`RecordField`.
        self.records = self._record_map.view(np.ndarray)
        self._generation = self.records[:, RecordField.GENERATION]  # the commit markers
        # Records never written are not on disk: new segments take freed records first.
        self._free: list[int] = []  # freed record indices (a stack)
        self._next_record = 1  # records [1, next) have been handed out at least once
        #: Next slot to allocate from; recovered from the newest segment on reopen.
        self.cursor = 0
        if spec is not None:
            self.set_spec(spec)
        self._slot_space.resume()
        self._record_space.resume()
        if not fresh:
            self._rebuild_free()

    def _open_map(
        self, file: Path, dtype: np.dtype, shape: tuple[int, ...], fresh: bool
    ) -> np.memmap:
        if fresh and file.exists() and file.name != CHECKSUMS_FILE:
            raise StorageCorruptedError(f"{file} exists but {self.path / SLOTS_FILE} does not")
        if not fresh:
            if not file.exists():
                raise StorageCorruptedError(f"{file} is missing")
            expected = int(np.prod(shape)) * dtype.itemsize
            if file.stat().st_size != expected:
                raise StorageCorruptedError(
                    f"{file} has {file.stat().st_size} bytes, expected {expected} "
                    f"for capacity {self.capacity}"
                )
        if fresh:  # all holes: np.memmap's "w+" would write its last byte
            create_sparse(file, int(np.prod(shape)) * dtype.itemsize, self.table_dir)
        mm = np.memmap(file, dtype=dtype, mode="r+", shape=shape)
        self._fds.append(os.open(file, os.O_RDWR))
        return mm

    def _save_cursor(self) -> None:
        # Checksum row 0 belongs to record 0, which is never a segment's: it holds the
        # cursor + 1 (0: not known, as in tables made before it). Written only where its
        # page has its blocks (see reserve_space).
        if self._record_bound() > 0:
            self.checksums[0] = self.cursor + 1

    def _saved_cursor(self) -> int | None:
        if self._record_bound() == 0:
            return None
        value = int(self.checksums[0]) - 1
        return value if 0 <= value <= self.capacity else None

    def _slot_bound(self) -> int:
        """Slots below this may hold pointers; those above are holes (zeros)."""
        return max(self._slots_on_disk, self._slot_space.reserved)

    def _record_bound(self) -> int:
        """Records below this may have been written; those above are holes (zeros)."""
        return max(self._records_on_disk, self._record_space.reserved)

    def _pointers(self, slots: np.ndarray) -> np.ndarray:
        """The record pointers of ``slots`` (flat int64), without reading holes."""
        bound = self._slot_bound()
        if not len(slots) or int(slots.max()) < bound:
            return np.take(self.slot_records, slots)
        inside = slots < bound
        out = np.zeros(len(slots), dtype=self.slot_records.dtype)
        out[inside] = np.take(self.slot_records, slots[inside])
        return out

    # -- columns -------------------------------------------------------------------------
    def set_spec(self, spec: TableSpec) -> None:
        """Create (or open) the column files of ``spec``."""
        if self.spec is not None:
            raise RuntimeError("the storage spec is already set")
        check_stacks(self.stacks, spec)
        cols_dir = self.path / "columns"
        cols_dir.mkdir(exist_ok=True)
        index: dict[str, list] = {"columns": []}
        columns: dict[Key, torch.Tensor] = {}
        fds: list[tuple[int, int, str]] = []
        prefixes: dict[Key, torch.Tensor] = {}
        prefix_fds: list[tuple[int, int, str]] = []
        try:
            for key, f in spec.fields.items():
                filename = cols_dir / column_filename(key)
                frame = f.shape[1:] if key in self.stacks else f.shape
                nbytes = f.nbytes // f.shape[0] if key in self.stacks else f.nbytes
                shape = torch.Size([self.capacity, *frame])
                expected = self.capacity * nbytes
                if not filename.exists():
                    # A hole, not MemoryMappedTensor.empty: that writes the last byte, which
                    # takes a block now (and fails on a full disk with a half-made file).
                    create_sparse(filename, expected, self.table_dir)
                elif filename.stat().st_size != expected:
                    raise StorageCorruptedError(
                        f"column file {filename} has {filename.stat().st_size} bytes, "
                        f"expected {expected}"
                    )
                mm = MemoryMappedTensor.from_filename(filename, dtype=f.dtype, shape=shape)
                # A plain tensor view on the same pages: torch's own ops without the subclass
                # dispatch, which costs more than the copy for small rows.
                columns[key] = mm.as_subclass(torch.Tensor)
                fds.append((os.open(filename, os.O_RDWR), nbytes, filename.name))
                index["columns"].append({"key": list(key), "file": filename.name})
            for key, k in self.stacks.items():
                existed = (cols_dir / column_filename(key)).stat().st_blocks > 0
                prefixes[key] = self._open_prefix(key, k, spec.fields[key], prefix_fds, existed)
            if prefixes:  # only then: the index of a table without stacks stays as it was
                index["prefixes"] = [
                    {"key": list(key), "file": f"{PREFIX_DIR}/{column_filename(key)}", "k": k}
                    for key, k in self.stacks.items()
                ]
            index_file = cols_dir / "index.json"
            if _read_json(index_file) != index:  # not on every open: a full disk refuses it
                atomic_write_json(index_file, index)
        except BaseException:
            for fd, _, _ in fds + prefix_fds:  # a later set_spec (the disk freed) starts over
                os.close(fd)
            raise
        for fd, nbytes, name in fds:
            self._fds.append(fd)
            self._slot_space.add(fd, nbytes, name)
        self._column_fds = {key: fd for key, (fd, _, _) in zip(columns, fds)}
        for fd, nbytes, name in prefix_fds:
            self._fds.append(fd)
            self._record_space.add(fd, nbytes, name)
        self.columns = columns
        self.prefixes = prefixes
        self._prefix_bytes = [
            t.reshape(-1).view(torch.uint8).numpy().reshape(t.shape[0], -1)
            for t in prefixes.values()
        ]
        self._slot_space.resume()
        self._record_space.resume()
        self._column_bytes = [
            (t.reshape(-1).view(torch.uint8).numpy().reshape(self.capacity, -1), int(role))
            for t, role in zip(
                columns.values(), (f.role == OBSERVATION for f in spec.fields.values())
            )
        ]
        self.spec = spec
        self._row_copy = {key: f.nbytes >= _ROW_COPY_BYTES for key, f in spec.fields.items()}

    def _open_prefix(
        self, key: Key, k: int, f: FieldSpec, fds: list[tuple[int, int, str]], stored: bool
    ) -> torch.Tensor:
        """The prefix column of a frame-stacked key, created sparse if new (``stored``: its
        column holds data, so the file must be there)."""
        directory = self.path / PREFIX_DIR
        directory.mkdir(exist_ok=True)
        filename = directory / column_filename(key)
        n_records = len(self.records)
        shape = torch.Size([n_records, k - 1, *f.shape[1:]])
        nbytes = f.nbytes // k * (k - 1)
        if not filename.exists():
            if stored:
                raise StorageCorruptedError(
                    f"prefix file {filename} is missing (the older frames of the first stack "
                    f"of {format_key(key)} in each stored segment): restore the table "
                    "directory from a copy"
                )
            create_sparse(filename, n_records * nbytes, self.table_dir)
        elif filename.stat().st_size != n_records * nbytes:
            raise StorageCorruptedError(
                f"prefix file {filename} has {filename.stat().st_size} bytes, expected "
                f"{n_records * nbytes} ({n_records} records of {k - 1} frames)"
            )
        mm = MemoryMappedTensor.from_filename(filename, dtype=f.dtype, shape=shape)
        fds.append((os.open(filename, os.O_RDWR), nbytes, f"{PREFIX_DIR}/{filename.name}"))
        return mm.as_subclass(torch.Tensor)

    # -- allocation ----------------------------------------------------------------------
    def next_start(self, n_slots: int) -> int:
        """Where a block of ``n_slots`` slots would start (wrapping to 0 if it does not fit)."""
        return 0 if self.cursor + n_slots > self.capacity else self.cursor

    def published_in(self, start: int, n_slots: int) -> SegmentBatch:
        """The published segments that overlap slots ``[start, start + n_slots)``."""
        pointers = self.slot_records[start : min(start + n_slots, self._slot_bound())]
        held = pointers[pointers != 0]
        if len(held) and start > 0:  # a tail shared with a successor: its segment goes too
            pred = int(self.slot_records[start - 1])
            if pred and pred != held[0] and self.records[pred, RecordField.TAIL] == start:
                held = np.concatenate([[pred], held]).astype(held.dtype)
        if not len(held):
            return SegmentBatch.empty()
        # A segment's slots are consecutive: each record appears as one run, in slot order.
        first = np.empty(len(held), dtype=bool)
        first[0] = True
        np.not_equal(held[1:], held[:-1], out=first[1:])
        records = held[first].astype(np.int64)
        return self._segments_of(records[self._generation[records] > 0])

    def _segments_of(self, records: np.ndarray) -> SegmentBatch:
        r = self.records[records].T.copy()  # one contiguous row per field
        f = RecordField
        return SegmentBatch(
            r[f.START],
            r[f.LENGTH],
            r[f.GENERATION],
            r[f.EPISODE_ID],
            r[f.STEP_BASE] + r[f.START],
            r[f.WRITER],
            r[f.SEQUENCE],
        )

    def _records_of(self, segments: SegmentBatch) -> np.ndarray:
        return self.slot_records[segments.starts].astype(np.int64)

    def unpublish(self, segments: SegmentBatch) -> None:
        """Clear the commit marker of ``segments``, then their slots; free their records.

        A slot shared with a segment that stays (a tail that is also its successor's first
        step, see :mod:`.regions`) stays that segment's: only pointers at ``segments`` are
        cleared, and a predecessor that stays gets back its tail slot's pointer.
        """
        if not len(segments):
            return
        records = self._records_of(segments)
        slots = segments.all_slots()
        own = self.slot_records[slots] == np.repeat(records, segments.lengths + 1)
        records = records[records > 0]
        self._generation[records] = 0
        self.slot_records[slots[own]] = 0
        self._free.extend(records.tolist())
        before = segments.starts[segments.starts > 0] - 1
        if len(before):
            pred = self.slot_records[before].astype(np.int64)
            back = (pred > 0) & (self._generation[pred] > 0)
            back[back] &= self.records[pred[back], RecordField.TAIL] == before[back] + 1
            self.slot_records[before[back] + 1] = pred[back]

    def clear(self) -> None:
        """Unpublish every slot and allocate from slot 0 again."""
        if self._next_record > 1:  # record 0 alone may lie in a page never written
            self._generation[: self._next_record] = 0
        self._claimed_records = 0
        # Only those: unwritten pages stay unwritten.
        held = np.flatnonzero(self.slot_records[: self._slot_bound()])
        self.slot_records[held] = 0
        self._free = list(range(self._next_record - 1, 0, -1))
        self.cursor = 0
        self._save_cursor()

    def reserve_space(self, start: int, n_slots: int, n_segments: int) -> None:
        """Reserve the disk blocks that writing ``n_segments`` segments into slots
        ``[start, start + n_slots)`` and publishing them will store into.

        Call it under the table's lock before anything else of the insert changes: a full
        disk raises :class:`ResourceExhaustedError` here, the storage as it was. Blocks are
        reserved in chunks ahead of use (:class:`~.disk_space.Reservation`), so most calls
        do nothing. Records are handed out freed ones first, so the fresh ones a publication
        takes are at most ``claimed - free`` past the last handed out, counting every block
        reserved and not yet published (a block whose write fails keeps its claim: that only
        reserves a little early).
        """
        self._slot_space.ensure(start + n_slots)
        claimed = self._claimed_records + n_segments
        self._record_space.ensure(self._next_record + max(0, claimed - len(self._free)))
        self._claimed_records = claimed

    def reserve(self, start: int, n_slots: int) -> None:
        """Claim ``[start, start + n_slots)`` for a write; its slots must hold no live segment."""
        block = self.slot_records[start : start + n_slots]
        if block.any():
            block[:] = 0
        self.cursor = start + n_slots
        self._save_cursor()  # before the copy: a killed copy leaves the cursor past it

    def take_records(self, n: int) -> np.ndarray:
        """Hand out the records of ``n`` segments reserved for (:meth:`reserve_space`)
        before their write, so that the write can fill what is indexed by record (the
        prefixes of frame-stacked keys); :meth:`publish` then takes them. Call it under the
        table's lock; :meth:`return_records` gives them back if the write fails."""
        records = self._allocate(n)
        self._claimed_records = max(0, self._claimed_records - n)
        return records

    def return_records(self, records: np.ndarray) -> None:
        """Free records taken by :meth:`take_records` for a write that failed."""
        self._free.extend(np.asarray(records).tolist())

    def _allocate(self, n: int) -> np.ndarray:
        """``n`` free record indices: freed ones first, so that few records are ever written."""
        reuse = min(n, len(self._free))
        taken = self._free[len(self._free) - reuse :]
        del self._free[len(self._free) - reuse :]
        fresh = n - reuse
        if self._next_record + fresh > len(self.records):  # more live than can fit
            self._free.extend(taken)
            raise StorageCorruptedError(
                f"no free segment record for {n} segments ({len(self.records) - 1} records, "
                f"{self._next_record - 1 - len(self._free)} in use)"
            )
        taken.extend(range(self._next_record, self._next_record + fresh))
        self._next_record += fresh
        return np.array(taken, dtype=np.int64)

    # -- data ----------------------------------------------------------------------------
    def write(
        self,
        layout: SegmentBatch,
        steps: dict[Key, torch.Tensor],
        tails: dict[Key, torch.Tensor],
        frames: dict[Key, torch.Tensor] | None = None,
        records: np.ndarray | None = None,
    ) -> None:
        """Copy segments into their reserved slots (no metadata is touched).

        A segment that continues another on its tail slot (:mod:`.regions`) rewrites that
        slot's observation with the same bytes and fills its step keys, which the tail's
        segment does not cover.

        ``steps`` holds every key for all steps, segment after segment; ``tails`` holds the
        observation keys, one row per segment. Frame-stacked keys come in ``frames``
        instead (``L + k`` rows per segment, see :mod:`millpond.frame_stacks`), and their
        prefixes go to ``records`` (from :meth:`take_records`). Refuses
        (:class:`InvalidDataError`, before copying anything) segments whose steps would
        count past the int64 range.
        """
        assert self.spec is not None
        if self.stacks and records is None:
            raise ValueError("a table with frame stacks writes into records taken first")
        check_step_range(layout.episode_ids, layout.first_steps, layout.lengths)
        # Segments lie back to back in a block, or apart (in writers' regions).
        base = int(layout.starts.min())
        n_slots = int((layout.starts + layout.lengths).max()) + 1 - base
        rel = (layout.starts - base).tolist()
        lengths = layout.lengths.tolist()
        rows = (np.cumsum(layout.lengths) - layout.lengths).tolist()
        step_rel = tail_rel = None
        for key, f in self.spec.fields.items():
            block = self.columns[key][base : base + n_slots]
            if key in self.stacks:
                self._write_frames(key, base, (frames or {})[key], rel, lengths, records)
                continue
            src = steps[key]
            if self._row_copy[key]:
                # Large rows: each segment's steps are contiguous in the block and in the
                # source, so plain slice copies (memcpy) beat index_copy_'s per-row kernel
                # by ~15x on image observations.
                # Written through the file, not the map: pwrite fills the page cache without
                # faulting each page into this process (a fresh or written-back page costs a
                # fault per 4 KiB through the map: ~0.5 GB/s, against ~10 GB/s).
                fd, row = self._column_fds[key], f.nbytes
                data = _bytes_of(src)
                for s, r, n in zip(rel, rows, lengths):
                    _pwrite(fd, data[r * row : (r + n) * row], (base + s) * row)
                if f.role == OBSERVATION:
                    tail = _bytes_of(tails[key])
                    for i, (s, n) in enumerate(zip(rel, lengths)):
                        _pwrite(fd, tail[i * row : (i + 1) * row], (base + s + n) * row)
                continue
            if step_rel is None:
                step_rel = torch.from_numpy(layout.step_slots() - base)
                tail_rel = torch.from_numpy(layout.starts + layout.lengths - base)
            block.index_copy_(0, step_rel, src)
            if f.role == OBSERVATION:
                block.index_copy_(0, tail_rel, tails[key])
        # Of what the files hold now: a copy that went wrong is caught too.
        layout.sums = self._data_sums(layout.starts, layout.lengths, records)

    def _write_frames(
        self,
        key: Key,
        base: int,
        src: torch.Tensor,
        rel: list[int],
        lengths: list[int],
        records: np.ndarray | None,
    ) -> None:
        """Copy one frame-stacked key: each segment's ``L + k`` frames, the first ``k - 1``
        to its record's prefix, the rest one per slot (with pwrite, as :meth:`write`)."""
        assert records is not None
        k = self.stacks[key]
        prefix = self.prefixes[key]
        fd, row = self._column_fds[key], src[0].numel() * src.element_size()
        data = _bytes_of(src)
        at = 0
        for s, n, r in zip(rel, lengths, records.tolist()):
            prefix[r].copy_(src[at : at + k - 1])
            first = at + k - 1
            _pwrite(fd, data[first * row : (first + n + 1) * row], (base + s) * row)
            at += n + k

    def _data_sums(
        self, starts: np.ndarray, lengths: np.ndarray, records: np.ndarray | None
    ) -> np.ndarray:
        """The data values of segments: their rows, then their prefixes (if any)."""
        if not self._prefix_bytes:
            return cks.data_sums(self._column_bytes, starts, lengths)
        assert records is not None
        return cks.data_sums(self._column_bytes, starts, lengths, self._prefix_bytes, records)

    def publish(self, layout: SegmentBatch, records: np.ndarray | None = None) -> None:
        """Write the records and slot pointers of ``layout``, commit markers last.

        ``layout``: segments written by :meth:`write`. ``records``: those the write was
        given (:meth:`take_records`), else taken now. A segment that starts on another's
        tail slot (:mod:`.regions`) takes that slot's pointer: a slot points at the segment
        it is a step of.
        """
        n = len(layout)
        base = int(layout.starts[0])
        n_slots = int(layout.lengths.sum()) + n
        back_to_back = bool(
            np.all(layout.starts == base + np.cumsum(layout.lengths + 1) - (layout.lengths + 1))
        )
        if records is None:
            records = self.take_records(n)
        f = RecordField
        block = np.zeros((RECORD_WIDTH, n), dtype=np.int64)  # generation 0: not yet visible
        block[f.EPISODE_ID] = layout.episode_ids
        block[f.STEP_BASE] = layout.first_steps - layout.starts
        block[f.START] = layout.starts
        block[f.LENGTH] = layout.lengths
        block[f.TAIL] = layout.starts + layout.lengths
        if layout.writers is not None:
            block[f.WRITER] = layout.writers
        if layout.sequences is not None:
            block[f.SEQUENCE] = layout.sequences
        self.records[records] = block.T
        block[f.GENERATION] = layout.generations  # what the checksum vouches for
        sums = layout.sums
        if sums is None:
            sums = self._data_sums(layout.starts, layout.lengths, records)
        self.checksums[records] = cks.combine(sums, block.T)
        pointers = np.repeat(records, layout.lengths + 1)
        if back_to_back:
            self.slot_records[base : base + n_slots] = pointers
        else:
            self.slot_records[layout.all_slots()] = pointers
            self.slot_records[layout.starts] = records  # a shared slot: its step's segment
        if self.fsync:
            self.flush()  # the data must be on disk before the marker that vouches for it
        self._generation[records] = layout.generations
        if self.fsync:
            self.flush()

    def generations(self, slots: np.ndarray) -> np.ndarray:
        """The generation of each slot's segment (0 where none is published)."""
        # Indexing, not np.take: take makes a strided column contiguous first, reading every
        # record, holes included (on a full tmpfs, a hole read is a SIGBUS).
        return self._generation[np.take(self.slot_records, slots)]  # 0: record 0

    def slot_info(self, slots: np.ndarray) -> np.ndarray:
        """Decoded metadata rows of ``slots`` (shape ``[*slots.shape, width]``, int64; the
        fields of :class:`SlotColumn`). A slot without a published segment decodes to zeros.
        """
        slots = np.asarray(slots, dtype=np.int64)
        flat = slots.reshape(-1)
        # Each slot's record row (pointer 0 reads record 0, which stays zero), in SlotColumn
        # order already but for the step and the kind. np.take: ~2x faster than fancy
        # indexing for rows.
        out = np.take(self.records, self._pointers(flat), axis=0)
        out[:, SlotColumn.STEP] += flat  # the step base + the slot
        kind = out[:, SlotColumn.KIND]  # holds the tail's slot
        np.equal(kind, flat, out=kind, casting="unsafe")  # 1 at the tail
        kind += SLOT_STEP  # SLOT_STEP, or SLOT_TAIL = SLOT_STEP + 1
        # A nonzero pointer always names the record that covers the slot (publication writes
        # pointers with records, eviction clears them, recovery drops stale ones), so only
        # unpublished records need masking.
        if not out[:, SlotColumn.GENERATION].all():
            out[out[:, SlotColumn.GENERATION] == 0] = 0
        return out.reshape(*slots.shape, _META_WIDTH)

    @property
    def meta(self) -> np.ndarray:
        """Every slot decoded (a ``[capacity, width]`` copy, see :meth:`slot_info`), for
        inspection and tests; the files hold the compact form."""
        return self.slot_info(np.arange(self.capacity))

    def published_step_slots(self) -> np.ndarray:
        """Every published step slot, in publication order (by generation, then slot)."""
        gens = self._generation[: self._next_record]
        live = np.flatnonzero(gens > 0)
        live = live[np.argsort(gens[live], kind="stable")]
        r = self.records[live]
        return ranges(r[:, RecordField.START], r[:, RecordField.LENGTH])

    def gather(self, slots: np.ndarray) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:
        """Read step slots: ``(values at slots, observations at slots + 1)``.

        The first dict has every key (observations and step keys); the second has the
        observation keys only: the next observations. ``slots`` may have any shape.
        """
        assert self.spec is not None
        shape = slots.shape
        flat = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))
        flat_next = flat + 1
        now: dict[Key, torch.Tensor] = {}
        nxt: dict[Key, torch.Tensor] = {}
        starts = records = None
        if self.stacks:  # a slot and the next are in one segment: one lookup serves both
            starts, records = self._segment_of(flat)
        for key, f in self.spec.fields.items():
            col = self.columns[key]
            if key in self.stacks:
                now[key] = rebuild(col, self.prefixes[key], flat, starts, records)
                nxt[key] = rebuild(col, self.prefixes[key], flat_next, starts, records)
                continue
            now[key] = torch.index_select(col, 0, flat)
            if f.role == OBSERVATION:
                nxt[key] = torch.index_select(col, 0, flat_next)
        if len(shape) > 1:  # slices: [B, K] rows
            for d in (now, nxt):
                for key, t in d.items():
                    d[key] = t.reshape(*shape, *t.shape[1:])
        return now, nxt

    def gather_slots(
        self, slots: np.ndarray
    ) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Read step slots with each observation slot read once.

        Returns ``(step keys at slots, observations at the distinct slots of slots and
        slots + 1 in slot order, rows, next_rows)``: ``rows`` and ``next_rows`` (int32,
        ``slots``' shape) index the distinct observations. Consecutive sampled steps
        (slices, queue batches) share a slot, so this reads and ships fewer bytes than
        :meth:`gather`, and sorted slots read the memory maps in order.
        """
        assert self.spec is not None
        distinct, rows, next_rows = distinct_rows(slots)
        now = self.gather_steps(slots)
        obs: dict[Key, torch.Tensor] = {}
        starts = records = None
        if self.stacks:
            starts, records = self._segment_of(distinct)
        for key, f in self.spec.fields.items():
            col = self.columns[key]
            if key in self.stacks:
                obs[key] = rebuild(col, self.prefixes[key], distinct, starts, records)
            elif f.role == OBSERVATION:
                obs[key] = torch.index_select(col, 0, distinct)
        return now, obs, rows, next_rows

    def gather_steps(self, slots: np.ndarray) -> dict[Key, torch.Tensor]:
        """The step keys (no observation) at step ``slots`` (any shape): what
        :meth:`gather_slots` returns first, for a reader that reads the observations itself."""
        assert self.spec is not None
        shape = slots.shape
        flat = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))
        now: dict[Key, torch.Tensor] = {}
        for key, f in self.spec.fields.items():
            if f.role != OBSERVATION and key not in self.stacks:
                t = torch.index_select(self.columns[key], 0, flat)
                now[key] = t.reshape(*shape, *t.shape[1:]) if len(shape) > 1 else t
        return now

    def _segment_of(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first slot and the record of each slot's segment (slots of published
        segments)."""
        records = self._pointers(slots.numpy()).astype(np.int64)
        starts = self.records[records, RecordField.START]
        return torch.from_numpy(starts), torch.from_numpy(records)

    # -- recovery and durability ---------------------------------------------------------
    def recover(self) -> SegmentBatch:
        """Find the complete, intact published segments (oldest first); clear the others.

        A segment is complete when its record has a generation, sane fields (a range inside
        the ring, its tail at its end, an episode id and steps >= 0), and each of its L+1
        slots points at it; intact when its checksum matches its data and record. A
        published segment that is not both (never the remains of a killed process, which
        publishes the generation last and clears it first) has had its files damaged: it is
        unpublished, counted in :attr:`corrupted` and logged, never served. Slot pointers to
        anything but a kept segment are cleared.

        A table without ``checksums.bin`` (written before checksums) gets its checksums
        computed from its data as it is, and a log line says so.
        """
        n_records, n_slots = self._record_bound(), self._slot_bound()
        if n_records and self.records[0].any():  # the zero record, read through pointer 0
            self.records[0] = 0
        live = np.flatnonzero(self._generation[:n_records] > 0)
        r = self.records[live]
        f = RecordField
        start, length = r[:, f.START], r[:, f.LENGTH]
        good = (length > 0) & (start >= 0) & (start + length < n_slots)
        good &= r[:, f.TAIL] == start + length
        good &= r[:, f.EPISODE_ID] >= 0
        # first step = STEP_BASE + START >= 0, and its segment's steps within int64
        good &= (r[:, f.STEP_BASE] >= -start) & (r[:, f.STEP_BASE] <= _MAX_STEP - start - length)
        slots = ranges(start[good], length[good] + 1)
        pointers = np.repeat(live[good], length[good] + 1)
        if len(slots):
            match = self.slot_records[slots] == pointers
            # A tail slot may be its successor's first step (see .regions) and point at it.
            tails = np.cumsum(length[good] + 1) - 1
            held = self.slot_records[slots[tails]].astype(np.int64)
            shared = ~match[tails] & (held > 0) & (held < len(self.records))
            shared[shared] &= self._generation[held[shared]] > 0
            shared[shared] &= self.records[held[shared], f.START] == slots[tails][shared]
            match[tails] |= shared
            offsets = np.cumsum(length[good] + 1) - (length[good] + 1)
            good[good] = np.logical_and.reduceat(match, offsets)
        if self._column_bytes and good.any():
            kept = np.flatnonzero(good)
            sums = cks.combine(self._data_sums(start[kept], length[kept], live[kept]), r[kept])
            if self._unchecked:
                self._record_space.ensure(int(live[kept].max()) + 1)
                self.checksums[live[kept]] = sums
                log.warning(
                    "table dir %s has no %s (written before checksums): computed the "
                    "checksums of its %d segments from the data as it is",
                    self.table_dir,
                    CHECKSUMS_FILE,
                    len(kept),
                )
            else:
                good[kept] = self.checksums[live[kept]] == sums
        self._unchecked = False
        self._drop_corrupted(live[~good], r[~good])
        # Slot pointers: exactly the slots of the kept segments.
        start, length, live = start[good], length[good], live[good]
        expected = np.zeros(self.capacity, dtype=np.int32)
        expected[ranges(start, length + 1)] = np.repeat(live, length + 1)
        expected[start] = live  # a shared slot is its step's (a kept successor's)
        stale = np.flatnonzero(self.slot_records[:n_slots] != expected[:n_slots])
        if len(stale):
            self.slot_records[stale] = expected[stale]
        self._rebuild_free()
        order = np.argsort(self._generation[live], kind="stable")
        segments = self._segments_of(live[order])
        saved = self._saved_cursor()
        if saved is not None:
            self.cursor = saved
        else:  # a table made before the cursor was kept (and so before regions)
            self.cursor = (
                int(segments.starts[-1] + segments.lengths[-1] + 1) if len(segments) else 0
            )
        return segments

    def _drop_corrupted(self, records: np.ndarray, rows: np.ndarray) -> None:
        """Unpublish damaged segments, count and log them."""
        if not len(records):
            return
        self._generation[records] = 0
        f = RecordField
        dropped = list(zip(*(rows[:, c].tolist() for c in (f.EPISODE_ID, f.START, f.LENGTH))))
        self.corrupted.extend(dropped)
        cks.log_dropped(log, self.table_dir, dropped)

    def verify(self, slots: np.ndarray) -> np.ndarray:
        """Whether the data of each slot's segment still matches its checksum.

        ``slots``: any shape, slots of published segments (sampled ones, say). Returns a
        bool array of the same shape, ``False`` where the segment's rows or record changed
        since it was published, or where the slot holds no published segment. Reads every
        row of each distinct segment, so it costs what reading those segments whole costs.
        Call it under the table's lock, or check the generations afterwards (a segment
        overwritten meanwhile fails).
        """
        slots = np.asarray(slots, dtype=np.int64)
        pointers = self._pointers(slots.reshape(-1)).astype(np.int64)
        records, inverse = np.unique(pointers, return_inverse=True)
        rows = self.records[records]
        ok = (records > 0) & (rows[:, RecordField.GENERATION] > 0)
        if ok.any():
            r = rows[ok]
            sums = self._data_sums(r[:, RecordField.START], r[:, RecordField.LENGTH], records[ok])
            ok[ok] = self.checksums[records[ok]] == cks.combine(sums, r)
        return ok[inverse].reshape(slots.shape)

    def segments_at(self, slots: np.ndarray) -> SegmentBatch:
        """The distinct published segments holding ``slots`` (any shape)."""
        pointers = self._pointers(np.asarray(slots, dtype=np.int64).reshape(-1))
        records = np.unique(pointers).astype(np.int64)
        records = records[records > 0]
        return self._segments_of(records[self._generation[records] > 0])

    def count_dropped(self, segments: SegmentBatch) -> None:
        """Count and log ``segments`` as damaged (found so by :meth:`verify`, after the table
        unpublished them)."""
        dropped = list(
            zip(segments.episode_ids.tolist(), segments.starts.tolist(), segments.lengths.tolist())
        )
        self.corrupted.extend(dropped)
        cks.log_dropped(log, self.table_dir, dropped)

    def _rebuild_free(self) -> None:
        """Free records: the unpublished ones below the highest published (record 0 aside)."""
        live = np.flatnonzero(self._generation[1 : self._record_bound()] > 0) + 1
        self._next_record = int(live[-1]) + 1 if len(live) else 1
        free = np.ones(self._next_record, dtype=bool)
        free[0] = False
        free[live] = False
        self._free = np.flatnonzero(free)[::-1].tolist()  # lowest first off the stack

    def flush(self) -> None:
        """fsync every file of this storage."""
        for fd in self._fds:
            os.fsync(fd)

    def nbytes_on_disk(self) -> int:
        """Bytes the files really occupy (sparse regions that were never written cost nothing)."""
        total = 0
        for p in self.path.rglob("*"):
            if p.is_file():
                total += p.stat().st_blocks * 512
        return total

    def close(self) -> None:
        self._slot_map.flush()
        self._record_map.flush()
        self._checksum_map.flush()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.columns = {}
        self._column_fds = {}
        self.prefixes = {}
        self._column_bytes = []
        self._prefix_bytes = []
