"""Slot records: the ring's slot pointers and segment records, handed out and published.

``slots.bin`` holds a record pointer per slot and ``segments.bin`` a record per segment (the
layout is described in :mod:`.storage`). :class:`SlotRecords` claims blocks of slots,
hands out records (freed ones first, so few are ever written), publishes segments (records
and pointers first, then the generations that commit them), unpublishes them (generations
first), and decodes slots from their records (:meth:`SlotRecords.slot_info`). It is the
base of :class:`~millpond.service.storage.SegmentStorage`, which opens the files and sets
the state declared here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from millpond.errors import StorageCorruptedError
from millpond.service import checksums as cks
from millpond.service.disk_space import Reservation
from millpond.service.segment_batch import SegmentBatch, ranges
from millpond.spec import Key, TableSpec
from millpond.storage_format import (
    RECORD_WIDTH,
    SLOT_STEP,
    ChainField,
    RecordField,
    SlotColumn,
)

_META_WIDTH = len(SlotColumn)


class SlotRecords:
    """Slot pointers and segment records: allocation, the publish commit, decoded slots.

    The storage's opening (:class:`~millpond.service.storage.SegmentStorage`) sets every
    attribute declared here; the other parts of the storage build on these methods.
    """

    capacity: int
    fsync: bool
    spec: TableSpec | None
    stacks: dict[Key, int]
    table_dir: Path
    slot_records: np.ndarray
    records: np.ndarray
    checksums: np.ndarray
    #: Per record, where its stacks' older frames are (see :mod:`.chains`); ``None`` in a
    #: table without frame stacks or made before chains.
    chains: np.ndarray | None
    cursor: int
    _generation: np.ndarray
    _free: list[int]
    _next_record: int
    _claimed_records: int
    _slot_space: Reservation
    _record_space: Reservation
    _slots_on_disk: int
    _records_on_disk: int
    _column_bytes: list[tuple[np.ndarray, int]]
    _prefix_bytes: list[np.ndarray]
    _fds: list[int]
    #: Per record: its published segment's data is not checked against its checksum yet
    #: (left so by a reopen, see :mod:`.recovery`).
    _unverified: np.ndarray
    #: Published segments not checked yet (the true entries of ``_unverified``).
    unverified: int

    # -- cursor and bounds ---------------------------------------------------------------
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

    # -- allocation ----------------------------------------------------------------------
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
        if self.unverified:  # nothing left to check: a new segment there comes checksummed
            self.unverified -= int(np.count_nonzero(self._unverified[records]))
            self._unverified[records] = False
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
        if self.unverified:  # (the flags' pages stay untouched otherwise)
            self._unverified[:] = False
            self.unverified = 0
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

    # -- publication ---------------------------------------------------------------------
    def own_prefix_rows(
        self, starts: np.ndarray, records: np.ndarray, chains: np.ndarray | None = None
    ) -> np.ndarray:
        """The prefix row each segment (its first slot, its record) stored its older frames
        in, 0 for one that continues its chain (it stores none). ``chains``: their chain
        rows, where not yet in the file. Tables made before chains: the record."""
        if self.chains is None:
            return records
        if chains is None:
            chains = self.chains[records]
        own = chains[:, ChainField.START] == starts
        return np.where(own, chains[:, ChainField.PREFIX], 0)

    def _data_sums(
        self,
        starts: np.ndarray,
        lengths: np.ndarray,
        records: np.ndarray | None,
        chains: np.ndarray | None = None,
    ) -> np.ndarray:
        """The data values of segments: their rows, then their prefixes and chain rows (if
        any; ``chains``: those not yet in the file)."""
        if not self._prefix_bytes:
            return cks.data_sums(self._column_bytes, starts, lengths)
        assert records is not None
        rows = self.own_prefix_rows(starts, records, chains)
        extra = None
        if self.chains is not None:
            extra = np.ascontiguousarray(self.chains[records] if chains is None else chains)
            extra = extra.view(np.uint8).reshape(len(starts), -1)
        return cks.data_sums(self._column_bytes, starts, lengths, self._prefix_bytes, rows, extra)

    def publish(
        self,
        layout: SegmentBatch,
        records: np.ndarray | None = None,
        chains: np.ndarray | None = None,
    ) -> None:
        """Write the records and slot pointers of ``layout``, commit markers last.

        ``layout``: segments written by :meth:`write`. ``records``: those the write was
        given (:meth:`take_records`), else taken now. ``chains``: their chain rows (from
        :meth:`~.chains.Chains.take_chains`, a table with chains). A segment that starts on
        another's tail slot (:mod:`.regions`) takes that slot's pointer: a slot points at
        the segment it is a step of.
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
        if chains is not None:
            assert self.chains is not None
            self.chains[records] = chains
        block[f.GENERATION] = layout.generations  # what the checksum vouches for
        sums = layout.sums
        if sums is None:
            sums = self._data_sums(layout.starts, layout.lengths, records, chains)
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

    # -- decoded slots -------------------------------------------------------------------
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

    def segments_at(self, slots: np.ndarray) -> SegmentBatch:
        """The distinct published segments holding ``slots`` (any shape)."""
        pointers = self._pointers(np.asarray(slots, dtype=np.int64).reshape(-1))
        records = np.unique(pointers).astype(np.int64)
        records = records[records > 0]
        return self._segments_of(records[self._generation[records] > 0])

    # -- free records and durability -----------------------------------------------------
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
