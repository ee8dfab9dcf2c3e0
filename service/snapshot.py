"""A table's consistent snapshot, read while inserts go on: what the ReadTable RPC streams.

:func:`pin` takes, under the table's lock, the segments published at that instant: each
one's start slot, length, generation, episode id and first step (40 bytes a segment, nothing
of its data). :meth:`TableSnapshot.read` then reads them oldest first, a group at a time,
each group under the table's lock: inserts wait for one group's copy (a few MiB), never for
the whole export. A segment whose generation changed since the pin was overwritten by an
insert (generations are never reused): it is left out and counted, never read torn.

Episodes stay unbroken: a segment overwritten before its episode sent anything is the
beginning of that episode evicted, as a ring evicts (its later segments still go); one
overwritten after an earlier segment of its episode was read leaves a gap, so the episode's
later segments are left out too (counted as cut). Each episode's steps that are read are
then one unbroken run, as in any state the table itself goes through. A reopened table's
segments not verified yet are checked before their group is read (:mod:`.verifier`); one
found damaged is dropped from the table and left out here as an overwritten one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from millpond.config import TableConfig
from millpond.errors import ResourceExhaustedError
from millpond.segments import PackedSegments
from millpond.service.segment_batch import ranges
from millpond.service.storage import SegmentStorage, SlotColumn
from millpond.spec import TableSpec

if TYPE_CHECKING:
    from millpond.service.table import Table

__all__ = ["GROUP_BYTES", "TableSnapshot", "pin"]

#: The most bytes of segment data one group (one ReadTable message) holds, unless a single
#: segment is larger (it then goes alone, up to the message limit): the table's lock is held
#: while a group is copied.
GROUP_BYTES = 8 << 20
# Room, per message, for keys, dtypes, shapes and the per-segment integers.
_TENSOR_OVERHEAD = 1024
_SEGMENT_OVERHEAD = 32


@dataclasses.dataclass
class TableSnapshot:
    """The segments a table had published at one instant (see the module docstring).

    Attributes:
        config: the table's config then (its spec included, once known).
        starts, lengths, generations, episode_ids, first_steps: one entry per segment, in
            publication order (oldest first).
        sent_segments, sent_steps: what :meth:`read` has returned so far.
        overwritten_segments, overwritten_steps: segments of the snapshot that inserts
            overwrote before :meth:`read` reached them (left out).
        cut_segments, cut_steps: segments left out because an earlier segment of their
            episode was overwritten after another one of it was read (a gap).
    """

    config: TableConfig
    starts: np.ndarray
    lengths: np.ndarray
    generations: np.ndarray
    episode_ids: np.ndarray
    first_steps: np.ndarray
    sent_segments: int = 0
    sent_steps: int = 0
    overwritten_segments: int = 0
    overwritten_steps: int = 0
    cut_segments: int = 0
    cut_steps: int = 0
    # Per segment: the previous segment of its episode in the snapshot (-1: none), whether
    # its episode had sent a segment by then, and whether its episode has a gap by then.
    _prev: np.ndarray = dataclasses.field(init=False, repr=False)
    _sent: np.ndarray = dataclasses.field(init=False, repr=False)
    _gap: np.ndarray = dataclasses.field(init=False, repr=False)
    _any_gap: bool = dataclasses.field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.lengths)
        order = np.lexsort((np.arange(n), self.episode_ids))  # by episode, then position
        same = np.zeros(n, dtype=bool)
        same[1:] = self.episode_ids[order][1:] == self.episode_ids[order][:-1]
        self._prev = np.full(n, -1, dtype=np.int64)
        self._prev[order[same]] = order[np.flatnonzero(same) - 1]
        self._sent = np.zeros(n, dtype=bool)
        self._gap = np.zeros(n, dtype=bool)

    @property
    def spec(self) -> TableSpec | None:
        return self.config.spec

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    @property
    def num_steps(self) -> int:
        return int(self.lengths.sum())

    def groups(self, max_bytes: int) -> list[tuple[int, int]]:
        """``(i, j)``: consecutive runs of segments ``i .. j - 1`` whose message takes at most
        ``min(max_bytes, GROUP_BYTES)`` bytes (a larger segment alone, up to ``max_bytes``).

        Raises :class:`ResourceExhaustedError` (before anything is read) where one segment
        alone would take more than ``max_bytes``.
        """
        n = self.num_segments
        if n == 0 or self.spec is None:
            return []
        spec = self.spec
        data = self.lengths * spec.slot_bytes + spec.observation_bytes
        # zstd's worst case on incompressible data (a table's compression): +1/256
        per_segment = data + data // 256 + 1 + _SEGMENT_OVERHEAD
        fixed = _TENSOR_OVERHEAD * (2 * len(spec.fields) + 4)
        k = int(np.argmax(per_segment))
        if int(per_segment[k]) + fixed > max_bytes:
            raise ResourceExhaustedError(
                f"table {self.config.name!r}: a segment of {int(self.lengths[k])} steps (episode "
                f"{int(self.episode_ids[k])}) takes {int(per_segment[k]) + fixed} bytes, more "
                f"than the message limit ({max_bytes} bytes): serve and read with a larger "
                "message limit (--max-message-mb)"
            )
        target = max(min(max_bytes, GROUP_BYTES) - fixed, 1)
        ends = np.cumsum(per_segment)
        out = []
        i = 0
        while i < n:
            base = int(ends[i - 1]) if i else 0
            j = int(np.searchsorted(ends, base + target, side="right"))
            j = max(j, i + 1)  # one segment at least: it fits max_bytes (checked above)
            out.append((i, j))
            i = j
        return out

    def read(self, table: Table, i: int, j: int) -> PackedSegments | None:
        """Segments ``i .. j - 1`` as stored (their steps, each with its tail), less those
        overwritten since the pin and those cut after a gap in their episode (see the
        module docstring); ``None`` if none is left. Frame-stacked keys come as whole
        stacks. The copy runs under the table's lock (:meth:`Table.reading`); call it for
        consecutive groups, in order."""
        starts, lengths = self.starts[i:j], self.lengths[i:j]
        table.verify_slots(starts)  # a damaged one is dropped: left out as if overwritten
        with table.reading() as storage:
            alive = storage.generations(starts) == self.generations[i:j]
            if alive.any():
                now, nxt = storage.gather(ranges(starts[alive], lengths[alive]))
        keep = self._follow(i, j, alive)
        lost = ~alive
        self.overwritten_segments += int(lost.sum())
        self.overwritten_steps += int(lengths[lost].sum())
        cut = alive & ~keep
        self.cut_segments += int(cut.sum())
        self.cut_steps += int(lengths[cut].sum())
        if not keep.any():
            return None
        kept = lengths[alive]
        last = torch.from_numpy(np.cumsum(kept) - 1)  # each segment's last step: its tail
        packed = PackedSegments(
            steps=now,
            tails={k: v.index_select(0, last) for k, v in nxt.items()},
            lengths=kept.copy(),
            episode_ids=self.episode_ids[i:j][alive].copy(),
            first_steps=self.first_steps[i:j][alive].copy(),
        )
        if cut.any():
            packed = packed.select(keep[alive])
        self.sent_segments += len(packed)
        self.sent_steps += packed.num_steps
        return packed

    def _follow(self, i: int, j: int, alive: np.ndarray) -> np.ndarray:
        """Which of segments ``i .. j - 1`` go out (``alive``: not overwritten), the
        episodes' state carried forward."""
        if alive.all() and not self._any_gap:  # the usual case: all of them
            self._sent[i:j] = True
            return alive
        keep = np.zeros(j - i, dtype=bool)
        for k in range(i, j):
            p = int(self._prev[k])
            sent = p >= 0 and bool(self._sent[p])
            gap = p >= 0 and bool(self._gap[p])
            if not gap and alive[k - i]:
                keep[k - i] = sent = True
            elif not alive[k - i] and sent:
                gap = True  # a segment of an episode that sent some: a hole
            self._sent[k], self._gap[k] = sent, gap
            self._any_gap |= gap
        return keep


def pin(table: Table) -> TableSnapshot:
    """The segments ``table`` has published now, oldest first (under its lock; the step
    slots are listed once, so the lock is held for a pass over them, not for any data)."""
    with table.reading() as storage:
        config = table.config
        if storage.spec is None:  # nothing was ever inserted
            empty = np.zeros(0, dtype=np.int64)
            return TableSnapshot(config, empty, empty, empty, empty, empty)
        columns = _published_segments(storage)
    return TableSnapshot(config, *columns)


def _published_segments(storage: SegmentStorage) -> tuple[np.ndarray, ...]:
    """``(starts, lengths, generations, episode ids, first steps)`` of the published
    segments in publication order (call under the table's lock)."""
    slots = storage.published_step_slots()
    if not len(slots):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty, empty
    # A segment's step slots are consecutive and its tail slot follows them, so two segments
    # never make one run: each run of consecutive step slots is one segment.
    first = np.flatnonzero(np.r_[True, np.diff(slots) != 1])
    starts = slots[first]
    lengths = np.diff(np.r_[first, len(slots)]).astype(np.int64)
    info = storage.slot_info(starts)
    if not (
        np.array_equal(info[:, SlotColumn.SEGMENT_START], starts)
        and np.array_equal(info[:, SlotColumn.SEGMENT_LENGTH], lengths)
    ):  # runs that are not segments: ask the storage for each slot's segment instead
        found = storage.segments_at(slots)
        order = np.argsort(found.generations, kind="stable")
        return tuple(
            np.ascontiguousarray(c[order], dtype=np.int64)
            for c in (
                found.starts,
                found.lengths,
                found.generations,
                found.episode_ids,
                found.first_steps,
            )
        )
    return (
        starts.astype(np.int64),
        lengths,
        info[:, SlotColumn.GENERATION].copy(),
        info[:, SlotColumn.EPISODE_ID].copy(),
        info[:, SlotColumn.STEP].copy(),
    )
