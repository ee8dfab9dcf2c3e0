"""Chains: frame-stacked segments that continue their predecessor store no older frames.

A table with frame stacks (:mod:`millpond.frame_stacks`) stores one frame per slot, and the
``k - 1`` older frames of a segment's first stack in a *prefix* row. A segment that
continues its predecessor on that one's tail slot (a writer's region, :mod:`.regions`) needs
no prefix of its own: the older frames of its first stacks are the frames of the slots
before it, back to the first segment of its *chain* (the run of segments of one episode laid
end to end in a region), whose prefix row holds the rest. ``chains.bin`` holds, per record,
the chain's first slot and that prefix row (:class:`~millpond.storage_format.ChainField`), so
:func:`~millpond.frame_stacks.rebuild` takes them as a segment's start and prefix.

Prefix rows are handed out only to a chain's first segment, by their own free list, and
have their own disk reservation: a chain of short segments costs one prefix, not one a
segment.

A continuation reads its predecessors' slots, so it never outlives them: whatever evicts or
drops a segment takes the later segments of its chain along (:meth:`Chains.with_dependents`),
recovery keeps a continuation only if its predecessor is kept, and a continuation published
after its predecessor went is dropped at once (:meth:`Chains.orphans`). A stack is never
rebuilt from frames that were overwritten.

Tables with frame stacks made before ``chains.bin`` have none: their prefixes are indexed by
record, as before, and they get no regions (they have a record per two slots).
"""

from __future__ import annotations

import numpy as np

from millpond.errors import StorageCorruptedError
from millpond.service.disk_space import Reservation
from millpond.service.regions import MAX_REGION
from millpond.service.segment_batch import SegmentBatch
from millpond.service.slot_records import SlotRecords
from millpond.storage_format import ChainField, RecordField


class Chains(SlotRecords):
    """Where each segment's older frames are, and the rules that keep them there (a base of
    the storage)."""

    _prefix_space: Reservation | None
    _free_prefixes: list[int]
    _next_prefix: int
    _claimed_prefixes: int
    _n_prefix_rows: int

    # -- where the older frames are ------------------------------------------------------
    def stack_origins(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(first slot, prefix row)`` that :func:`~millpond.frame_stacks.rebuild` takes
        for each of ``records`` (published ones)."""
        if self.chains is None:
            return self.records[records, RecordField.START], records
        rows = self.chains[records]
        return rows[:, ChainField.START], rows[:, ChainField.PREFIX]

    # -- allocation ----------------------------------------------------------------------
    def reserve_space(
        self, start: int, n_slots: int, n_segments: int, n_roots: int | None = None
    ) -> None:
        """:meth:`SlotRecords.reserve_space`, and the prefix rows of ``n_roots`` segments
        that start a chain (all ``n_segments`` if not given)."""
        super().reserve_space(start, n_slots, n_segments)
        if self._prefix_space is None:
            return
        claimed = self._claimed_prefixes + (n_segments if n_roots is None else n_roots)
        self._prefix_space.ensure(self._next_prefix + max(0, claimed - len(self._free_prefixes)))
        self._claimed_prefixes = claimed

    def published_in(self, start: int, n_slots: int) -> SegmentBatch:
        """:meth:`SlotRecords.published_in`, with the segments that read their frames."""
        return self.and_dependents(super().published_in(start, n_slots))

    def and_dependents(self, segments: SegmentBatch) -> SegmentBatch:
        """``segments`` (published ones about to be dropped) and the later segments of
        their chains (:meth:`with_dependents`)."""
        if self.chains is None or not len(segments):
            return segments
        records = self._records_of(segments)
        every = self.with_dependents(records)
        return segments if len(every) == len(records) else self._segments_of(every)

    def segments_of_records(self, records: np.ndarray) -> SegmentBatch:
        """The published segments of ``records``."""
        return self._segments_of(records)

    def unpublish(self, segments: SegmentBatch) -> None:
        """:meth:`SlotRecords.unpublish`, freeing the prefix rows the segments hold."""
        if self.chains is not None and len(segments):
            records = self._records_of(segments)
            records = records[(records > 0) & (self._generation[records] > 0)]
            own = self.own_prefix_rows(self.records[records, RecordField.START], records)
            self._free_prefixes.extend(own[own > 0].tolist())
        super().unpublish(segments)

    def clear(self) -> None:
        super().clear()
        self._free_prefixes = list(range(self._next_prefix - 1, 0, -1))
        self._claimed_prefixes = 0

    def _rebuild_free(self) -> None:
        """:meth:`SlotRecords._rebuild_free`, and the free prefix rows: those no published
        chain's first segment holds."""
        super()._rebuild_free()
        if self.chains is None:
            return
        live = np.flatnonzero(self._generation[: self._next_record] > 0)
        own = self.own_prefix_rows(self.records[live, RecordField.START], live)
        used = own[own > 0]
        self._next_prefix = int(used.max()) + 1 if len(used) else 1
        free = np.ones(self._next_prefix, dtype=bool)
        free[0] = False
        free[used] = False
        self._free_prefixes = np.flatnonzero(free)[::-1].tolist()
        self._claimed_prefixes = 0

    def take_chains(
        self, starts: np.ndarray, lengths: np.ndarray, continues: np.ndarray
    ) -> np.ndarray | None:
        """The chain rows of a block of segments about to be written (under the table's
        lock, after :meth:`reserve_space`): a prefix row for each that starts a chain, its
        predecessor's row (in the block, or published) for each that ``continues``."""
        if self.chains is None:
            return None
        n = len(starts)
        out = np.zeros((n, 2), dtype=np.int64)
        roots = ~continues
        out[roots, ChainField.START] = starts[roots]
        out[roots, ChainField.PREFIX] = self._allocate_prefixes(int(roots.sum()))
        self._claimed_prefixes = max(0, self._claimed_prefixes - int(roots.sum()))
        by_tail = {int(s + n): i for i, (s, n) in enumerate(zip(starts, lengths))}
        for i in np.flatnonzero(continues).tolist():
            s = int(starts[i])
            j = by_tail.get(s)
            if j is not None and j < i:
                out[i] = out[j]
                continue
            pred = int(self.slot_records[s - 1]) if s > 0 else 0
            if not (
                pred and self._generation[pred] > 0 and self.records[pred, RecordField.TAIL] == s
            ):
                self.return_chains(out, starts)
                raise RuntimeError(f"a continuation at slot {s} has no published predecessor")
            out[i] = self.chains[pred]
        return out

    def return_chains(self, chains: np.ndarray | None, starts: np.ndarray) -> None:
        """Free the prefix rows :meth:`take_chains` handed out for a write that failed."""
        if chains is None:
            return
        own = self.own_prefix_rows(starts, np.zeros(len(starts), dtype=np.int64), chains)
        self._free_prefixes.extend(own[own > 0].tolist())

    def _allocate_prefixes(self, n: int) -> np.ndarray:
        reuse = min(n, len(self._free_prefixes))
        taken = self._free_prefixes[len(self._free_prefixes) - reuse :]
        del self._free_prefixes[len(self._free_prefixes) - reuse :]
        fresh = n - reuse
        if self._next_prefix + fresh > self._n_prefix_rows:  # more chains than can be
            self._free_prefixes.extend(taken)
            raise StorageCorruptedError(
                f"no free prefix row for {n} segments ({self._n_prefix_rows - 1} rows)"
            )
        taken.extend(range(self._next_prefix, self._next_prefix + fresh))
        self._next_prefix += fresh
        return np.array(taken, dtype=np.int64)

    # -- the rules -----------------------------------------------------------------------
    def with_dependents(self, records: np.ndarray) -> np.ndarray:
        """``records`` (published segments about to go) and every published segment of
        their chains that follows one of them: those read their frames."""
        if self.chains is None or not len(records):
            return records
        taken = set(records.tolist())
        extra: list[int] = []
        tails = self.records[records, RecordField.TAIL]
        nxt = self._pointers(np.minimum(tails, self.capacity - 1)).astype(np.int64)
        follows = (nxt > 0) & (nxt != records) & (tails < self.capacity)
        for r, t, s in zip(records[follows].tolist(), tails[follows].tolist(), nxt[follows]):
            if s in taken or self._generation[s] == 0 or self.records[s, RecordField.START] != t:
                continue
            # A chain lies in one region, after its first segment: scan that far.
            window = np.unique(self._pointers(np.arange(t, min(t + MAX_REGION + 1, self.capacity))))
            window = window[(window > 0) & (self._generation[window] > 0)].astype(np.int64)
            same = (self.chains[window] == self.chains[r]).all(axis=1)
            same &= self.records[window, RecordField.START] >= t
            for w in window[same].tolist():
                if w not in taken:
                    taken.add(w)
                    extra.append(w)
        if not extra:
            return records
        return np.concatenate([records, np.array(extra, dtype=np.int64)])

    def orphans(self, starts: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Of segments just published (their first slots and records), the continuations
        whose predecessor is no longer published with the same chain (evicted or dropped
        while they were copied): they must go at once, with what follows them."""
        if self.chains is None or not len(records):
            return np.zeros(0, dtype=np.int64)
        rows = self.chains[records]
        cont = rows[:, ChainField.START] != starts
        if not cont.any():
            return np.zeros(0, dtype=np.int64)
        s, r = starts[cont], records[cont]
        pred = self.slot_records[s - 1].astype(np.int64)
        ok = (pred > 0) & (self._generation[pred] > 0)
        ok &= self.records[pred, RecordField.TAIL] == s
        ok &= (self.chains[pred] == rows[cont]).all(axis=1)
        return self.with_dependents(r[~ok])

    def broken_chains(self, live: np.ndarray, good: np.ndarray) -> np.ndarray:
        """Of published ``live`` records deemed ``good`` so far (recovery), whether each
        still is: a chain's first segment owns a prefix row no other holds, a continuation
        follows a good predecessor of its chain (back to the first)."""
        if self.chains is None or not len(live):
            return good
        good = good.copy()
        rows = self.chains[live]
        start = self.records[live, RecordField.START]
        root = rows[:, ChainField.START] == start
        prefix = rows[:, ChainField.PREFIX]
        bad_row = (prefix < 1) | (prefix >= self._n_prefix_rows)
        good[root & bad_row] = False
        held = prefix[root & good]
        values, counts = np.unique(held, return_counts=True)
        twice = np.isin(prefix, values[counts > 1])
        good[root & twice] = False
        cont = ~root & (rows[:, ChainField.START] < start) & (rows[:, ChainField.START] >= 0)
        good[~root & ~cont] = False
        kept = np.zeros(len(self.records), dtype=bool)
        while True:
            kept[:] = False
            kept[live[good]] = True
            idx = np.flatnonzero(good & cont)
            pred = self.slot_records[start[idx] - 1].astype(np.int64)
            ok = kept[pred] & (self.records[pred, RecordField.TAIL] == start[idx])
            ok &= (self.chains[pred] == rows[idx]).all(axis=1)
            if ok.all():
                return good
            good[idx[~ok]] = False
