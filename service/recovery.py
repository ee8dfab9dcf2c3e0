"""Recovery and verification: which stored segments are complete and intact.

:meth:`Recovery.recover` runs when a table opens: it keeps the published segments whose
record, slot pointers and checksum hold up and unpublishes the others (a killed process
leaves only unpublished ones; damaged files are counted in ``corrupted`` and logged).
:meth:`Recovery.verify` checks sampled segments against their checksums while the table
runs (``verify_reads``).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from millpond.service import checksums as cks
from millpond.service.chains import Chains
from millpond.service.segment_batch import SegmentBatch, ranges
from millpond.storage_format import ChainField, RecordField

# The storage's log, whichever of its parts writes to it.
log = logging.getLogger("millpond.service.storage")

_MAX_STEP = np.iinfo(np.int64).max


class Recovery(Chains):
    """Recovery on open and verification of reads (a base of the storage)."""

    corrupted: list[tuple[int, int, int]]
    _unchecked: bool
    _verify_order: np.ndarray  # records left unverified at open, by first slot
    _verify_next: int  # how far the background verifier went through them
    _column_fds: dict

    def recover(self, check_data: bool = True) -> SegmentBatch:
        """Find the complete, intact published segments (oldest first); clear the others.

        A segment is complete when its record has a generation, sane fields (a range inside
        the ring, its tail at its end, an episode id and steps >= 0), and each of its L+1
        slots points at it; intact when its checksum matches its data and record. A
        segment that continues its chain (see :mod:`.chains`) is kept only if its
        predecessor is (else it goes, logged, as an eviction interrupted half way leaves
        it). A
        published segment that is not both (never the remains of a killed process, which
        publishes the generation last and clears it first) has had its files damaged: it is
        unpublished, counted in :attr:`corrupted` and logged, never served. Slot pointers to
        anything but a kept segment are cleared.

        ``check_data=False``: the data is not read now; the kept segments are left
        unverified (see the module docstring), to be checked before any of their rows is
        read, and dropped then if damaged.

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
        deferred = (
            bool(self._column_bytes) and good.any() and not check_data and not self._unchecked
        )
        if self._column_bytes and good.any() and not deferred:
            kept = np.flatnonzero(good)
            sums = cks.combine(self._data_sums(start[kept], length[kept], live[kept]), r[kept])
            if self._unchecked:
                self._record_space.ensure(int(live[kept].max()) + 1)
                self.checksums[live[kept]] = sums
                log.warning(
                    "table dir %s has no %s (written before checksums): computed the "
                    "checksums of its %d segments from the data as it is",
                    self.table_dir,
                    cks.CHECKSUMS_FILE,
                    len(kept),
                )
            else:
                good[kept] = self.checksums[live[kept]] == sums
        self._unchecked = False
        self._drop_corrupted(live[~good], r[~good])
        chained = self.broken_chains(live, good)
        if (good & ~chained).any():
            orphans = live[good & ~chained]
            self._generation[orphans] = 0
            log.warning(
                "table dir %s: dropped %d segments whose earlier frames (their chain's "
                "earlier segments) are gone",
                self.table_dir,
                len(orphans),
            )
            good = chained
        # Slot pointers: exactly the slots of the kept segments.
        start, length, live = start[good], length[good], live[good]
        if deferred:
            self._unverified[live] = True
            self.unverified = len(live)
            self._verify_order = live[np.argsort(start, kind="stable")]
            self._verify_next = 0
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

    # -- verification after open -------------------------------------------------------
    def to_check(self, slots: np.ndarray, everything: bool = False) -> tuple[np.ndarray, ...]:
        """The distinct published segments holding ``slots`` (any shape) that are not
        verified yet (``everything``: all of them), as ``(records, record rows)``: what
        :meth:`check` takes. Call it under the table's lock (the rows are a snapshot)."""
        flat = np.asarray(slots, dtype=np.int64).reshape(-1)
        pointers = self._pointers(flat)
        if self.chains is not None and len(flat):
            # A stack reads the slots before its own, back to its chain's first segment,
            # and that one's prefix: those segments must be checked too.
            k = max(self.stacks.values())
            starts = self.chains[pointers, ChainField.START]
            older = np.maximum(flat[:, None] - np.arange(1, k)[None], starts[:, None])
            pointers = self._pointers(np.concatenate([flat, older.reshape(-1), starts]))
        if not everything:
            pointers = pointers[self._unverified[pointers]]
        records = np.unique(pointers).astype(np.int64)
        records = records[(records > 0) & (self._generation[records] > 0)]
        return records, self.records[records]

    def next_unverified(self, max_bytes: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The next segments left unverified at open, in slot order, about ``max_bytes`` of
        data (one at least), as :meth:`to_check` returns them, and their bytes; none when
        all are checked. Call it under the table's lock."""
        order, i = self._verify_order, self._verify_next
        slot_bytes = sum(rows.shape[1] for rows, _ in self._column_bytes) or 1
        taken: list[np.ndarray] = []
        size = 0
        while i < len(order) and size < max_bytes and self.unverified:
            block = order[i : i + 4096]
            pending = self._unverified[block]
            sizes = np.where(pending, self.records[block, RecordField.LENGTH] + 1, 0)
            total = np.cumsum(sizes) * slot_bytes
            end = min(int(np.searchsorted(total, max_bytes - size)) + 1, len(block))
            taken.append(block[:end][pending[:end]])
            size += int(total[end - 1])
            i += end
        self._verify_next = i
        if i >= len(order) and len(order):  # all gone through: the list is not needed
            self._verify_order, self._verify_next = order[:0], 0
        records = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        return records, self.records[records], size

    def check(self, records: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Whether each segment's data matches its checksum (``records`` and their ``rows``
        as :meth:`to_check` gives them). Reads the segments' bytes: call it outside the
        table's lock, then :meth:`settle` under it (a segment overwritten meanwhile fails
        here and is told apart there)."""
        ok = (records > 0) & (rows[:, RecordField.GENERATION] > 0)
        if ok.any():
            r = rows[ok]
            self._read_ahead(r[:, RecordField.START], r[:, RecordField.LENGTH])
            sums = self._data_sums(r[:, RecordField.START], r[:, RecordField.LENGTH], records[ok])
            ok[ok] = self.checksums[records[ok]] == cks.combine(sums, r)
        return ok

    def _read_ahead(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Have the kernel read the segments' rows in, all at once: a check of cold
        segments reads many ranges, and one page fault at a time each waits for the disk."""
        if not hasattr(os, "posix_fadvise") or len(starts) < 2:
            return
        order = np.argsort(starts)
        starts, ends = starts[order], starts[order] + lengths[order] + 1
        # Runs of touching segments (the background check's are) go as one range.
        cut = np.flatnonzero(starts[1:] > ends[:-1]) + 1
        firsts, lasts = starts[np.r_[0, cut]], ends[np.r_[cut - 1, len(ends) - 1]]
        for fd, (rows, _) in zip(self._column_fds.values(), self._column_bytes):
            width = rows.shape[1]
            for a, b in zip(firsts.tolist(), lasts.tolist()):
                os.posix_fadvise(fd, a * width, (b - a) * width, os.POSIX_FADV_WILLNEED)

    def settle(self, records: np.ndarray, rows: np.ndarray, ok: np.ndarray) -> SegmentBatch:
        """Record what :meth:`check` found (under the table's lock): segments still as they
        were (same generation: nothing wrote their slots meanwhile) become verified if
        ``ok``; the others of them are returned, damaged, for the table to drop. Segments
        overwritten since are left alone (their new data was checksummed by its writer)."""
        gens = rows[:, RecordField.GENERATION]
        same = (gens > 0) & (self._generation[records] == gens)
        good = records[same & ok]
        if len(good):
            self.unverified -= int(np.count_nonzero(self._unverified[good]))
            self._unverified[good] = False
        return self._segments_of(records[same & ~ok])

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
        ok = self.check(records, self.records[records])
        return ok[inverse].reshape(slots.shape)

    def count_dropped(self, segments: SegmentBatch) -> None:
        """Count and log ``segments`` as damaged (found so by :meth:`verify`, after the table
        unpublished them)."""
        dropped = list(
            zip(segments.episode_ids.tolist(), segments.starts.tolist(), segments.lengths.tolist())
        )
        self.corrupted.extend(dropped)
        cks.log_dropped(log, self.table_dir, dropped)
