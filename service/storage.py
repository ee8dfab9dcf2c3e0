"""Memory-mapped segment storage: one file per column plus slot metadata, laid out as a ring.

This module opens the files and is the storage's public face (:class:`SegmentStorage`, the
slot vocabulary of :mod:`millpond.storage_format`). The class's other parts live one
concept to a module: slot records, their allocation and the publish commit
(:mod:`.slot_records`), frame-stack chains (:mod:`.chains`), copying segments in
(:mod:`.segment_writes`), the gathers
(:mod:`.gathers`), recovery and verification (:mod:`.recovery`).

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
  its own at least; ``capacity // 2`` in tables made before regions, and in tables with
  frame stacks made before ``chains.bin``, which get no regions) and is sparse: pages
  never written take no disk space.

* ``prefixes/<key>.bin``: for each frame-stacked observation key
  (:mod:`millpond.frame_stacks`; its column then holds one frame per slot, the newest of
  the stack there), the ``k - 1`` older frames of the first stack of each *chain* (a
  segment and those that continue it in a writer's region, :mod:`.chains`), sparse, with
  its own disk reservation. ``chains.bin`` holds per record its chain's first slot and
  prefix row (tables with frame stacks made before it index prefixes by record).
  :meth:`SegmentStorage.gather` and :meth:`SegmentStorage.gather_slots` rebuild the
  stacks, so nothing above sees frames.
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
import os
from pathlib import Path

import numpy as np
import torch
from tensordict import MemoryMappedTensor

from millpond.config import MAX_CAPACITY  # slot pointers and records are int32
from millpond.errors import InvalidConfigError, StorageCorruptedError
from millpond.frame_stacks import PREFIX_DIR, check_stacks
from millpond.service import checksums as cks
from millpond.service.atomic_json import atomic_write_json
from millpond.service.disk_space import Reservation, create_sparse, data_end
from millpond.service.gathers import Gathers
from millpond.service.recovery import Recovery
from millpond.service.segment_writes import SegmentWrites
from millpond.spec import OBSERVATION, FieldSpec, Key, TableSpec, format_key
from millpond.storage_format import (  # the format a reader on the same host shares
    CHAIN_WIDTH,
    CHAINS_FILE,
    RECORD_WIDTH,
    SEGMENTS_FILE,
    SLOT_EMPTY,
    SLOT_STEP,
    SLOT_TAIL,
    SLOTS_FILE,
    RecordField,
    SlotColumn,
    column_filename,
    num_prefix_rows,
    num_records,
    records_in,
)

__all__ = [
    "CHAINS_FILE",
    "CHECKSUMS_FILE",
    "SLOT_EMPTY",
    "SLOT_STEP",
    "SLOT_TAIL",
    "SegmentStorage",
    "SlotColumn",
]

CHECKSUMS_FILE = cks.CHECKSUMS_FILE

#: Rows at least this large are written with one slice copy per segment.
_ROW_COPY_BYTES = 1024


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


class SegmentStorage(SegmentWrites, Gathers, Recovery):
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
            n_records = num_records(capacity)
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
        # Tables with frame stacks keep chains (see .chains), but for those made before.
        chains_file = self.path / CHAINS_FILE
        if self.stacks and not fresh and not chains_file.exists() and self.continuations:
            raise StorageCorruptedError(
                f"{chains_file} is missing (where each segment's older frames are): restore "
                "the table directory from a copy"
            )
        self._chained = bool(self.stacks) and (fresh or chains_file.exists())
        self.chains: np.ndarray | None = None
        self._n_prefix_rows = num_prefix_rows(capacity)
        # A prefix row per chain, not per record: reserved by its own watermark, sized for
        # chains of a few segments (most use far fewer rows than the file holds).
        self._prefix_space: Reservation | None = None
        if self._chained:
            self._prefix_space = Reservation(
                self.table_dir, self._n_prefix_rows, "frame-stack prefixes", capacity // 16 + 1
            )
        self._free_prefixes: list[int] = []
        self._next_prefix = 1
        self._claimed_prefixes = 0
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
        if self._chained:
            chain_map = self._open_map(
                self.path / CHAINS_FILE, np.dtype(np.int64), (n_records, CHAIN_WIDTH), fresh
            )
            self._record_space.add(self._fds[-1], CHAIN_WIDTH * 8, CHAINS_FILE)
            self._chain_map: np.memmap | None = chain_map
            self.chains = chain_map.view(np.ndarray)
        else:
            self._chain_map = None
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
        # What recovery leaves for the verifier: a byte per record, a list of those left.
        self._unverified = np.zeros(n_records, dtype=bool)
        self.unverified = 0
        self._verify_order = np.zeros(0, dtype=np.int64)
        self._verify_next = 0
        # Records never written are not on disk: new segments take freed records first.
        self._free: list[int] = []  # freed record indices (a stack)
        self._next_record = 1  # records [1, next) have been handed out at least once
        #: Next slot to allocate from; recovered from the newest segment on reopen.
        self.cursor = 0
        if spec is not None:
            self.set_spec(spec)
        self._slot_space.resume()
        self._record_space.resume()
        if self._prefix_space is not None:
            self._prefix_space.resume()
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

    # -- column files --------------------------------------------------------------------
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
            (self._prefix_space or self._record_space).add(fd, nbytes, name)
        self.columns = columns
        self.prefixes = prefixes
        self._prefix_bytes = [
            t.reshape(-1).view(torch.uint8).numpy().reshape(t.shape[0], -1)
            for t in prefixes.values()
        ]
        self._slot_space.resume()
        self._record_space.resume()
        if self._prefix_space is not None:
            self._prefix_space.resume()
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
        n_records = self._n_prefix_rows
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
                f"{n_records * nbytes} ({n_records} rows of {k - 1} frames)"
            )
        mm = MemoryMappedTensor.from_filename(filename, dtype=f.dtype, shape=shape)
        fds.append((os.open(filename, os.O_RDWR), nbytes, f"{PREFIX_DIR}/{filename.name}"))
        return mm.as_subclass(torch.Tensor)

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
        if self._chain_map is not None:
            self._chain_map.flush()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.columns = {}
        self._column_fds = {}
        self.prefixes = {}
        self._column_bytes = []
        self._prefix_bytes = []
