"""Writer regions: where a writer's short segments go, so that an episode sent a few steps
at a time is stored one slot a step.

A segment of L steps takes L+1 slots: its steps, then its tail (the observation after its
last step). An actor that sends each step as soon as it has it (``chunk_len: 1``, ALF's
per-step immediate mode) sends one-step segments, so laid end to end they would take two
slots a step, each tail a copy of the next segment's first observation. The ring is shared
by every writer and lane, so the next segment of a lane is not, in general, beside the
previous one.

So a writer's short segments are placed in *regions*: runs of slots of the ring set aside
for that writer, each holding the episodes of one lane back to back. A segment that
*continues* the last segment of a region (same episode, the next step, and a first
observation equal, byte for byte, to that segment's tail) starts *on* that tail slot: the
slot is the predecessor's tail and the successor's first step at once, and
``("next", obs)[i] == obs[i + 1]`` holds across the two. A segment that starts an episode
goes after the last one of a region whose episode ended, or into a new region. Regions are
carved from the ring where blocks are (so eviction still runs through the ring in order,
region by region), and a region is forgotten as soon as a new block overlaps it.

A region is filled over many inserts, so the steps in it are stored out of the ring's order,
and eviction is FIFO only to within the regions set aside at once. So their slots together
are bounded: the regions of every lane of every writer heard from within a pass of the ring
take at most 1/64 of it, and a new region is that share over the lanes (at most
:data:`MAX_REGION` slots; none under 8). An actor of many lanes on a small ring gets no
regions: its chunks are laid out plainly, each with its tail, and the ring stays FIFO
(``benchmarks/ring_order.py`` measures both).

Only writers with an id get regions: their inserts run one at a time, so a predecessor is
published before its successor is placed. This module only plans (a :class:`Placement` is
where one insert's segments go, its new block too: at the ring's cursor, or around the
ring's end, :meth:`Placement.pieces`); the table checks the observations, commits the plan
under its lock and writes the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

#: Regions are at most this many slots.
MAX_REGION = 256
#: The regions set aside at once take at most 1/this of the ring, every lane's together.
_RESERVED_FRACTION = 64
#: Smaller regions than this are not worth their bookkeeping: the segments go plainly.
_MIN_REGION = 8
#: Segments of more than a quarter of a region's slots go into plain blocks: their tails
#: cost them little (at most 1/64), and they keep the ring's order exact.
_SHORT_FRACTION = 4
#: Regions a writer keeps at once (a lane each, roughly); the oldest are dropped past it.
_MAX_REGIONS_PER_WRITER = 256


def region_size(capacity: int, lanes: int = 1) -> int:
    """The slots of a new region in a table of ``capacity`` slots whose writers have
    ``lanes`` lanes in all (0: no regions)."""
    size = min(MAX_REGION, capacity // _RESERVED_FRACTION // max(1, lanes))
    return size if size >= _MIN_REGION else 0


@dataclass
class _Region:
    start: int
    end: int  # exclusive
    used: int  # the first slot after its last segment's tail
    episode: int = -1  # of its last segment (-1: none yet)
    next_step: int = -1  # the step after its last segment's last
    ended: bool = True  # its last segment ended its episode (or it has none)


@dataclass
class Placement:
    """Where each segment of one insert goes.

    Attributes:
        starts: each segment's first slot; for those of ``new`` regions, relative to the
            block (see :meth:`Regions.commit`).
        in_block: whether each segment lies in the new block.
        continues: whether each segment starts on its predecessor's tail slot.
        block_slots: slots of the new block (its new regions, or its plain segments).
        checks: ``(segment, tail slot)`` of each continuation whose predecessor is
            stored: the table compares the observations before committing.
        in_batch: ``(segment, predecessor)`` of each continuation whose predecessor is
            in the same insert.
    """

    starts: np.ndarray
    in_block: np.ndarray
    continues: np.ndarray
    block_slots: int
    checks: list[tuple[int, int]] = field(default_factory=list)
    in_batch: list[tuple[int, int]] = field(default_factory=list)
    _regions: list[_Region] = field(default_factory=list)  # every region it touched, as after
    _new: list[int] = field(default_factory=list)  # index in _regions of the new ones
    _writer: int = 0
    _lanes: int = 0  # the writer's lanes, as this insert shows them
    _steps: int = 0

    def pieces(self, cursor: int, capacity: int, lengths: np.ndarray) -> list[tuple[int, int]]:
        """Where the new block goes: ``(first slot, slots)`` of each of its pieces, in the
        block's order (none for no block).

        The block starts at the ring's cursor. One that does not fit before the ring's end
        lays there what fits whole of it (plain segments and new regions lie back to back
        in it), and the rest from slot 0: the ring's end is written every pass, so it
        never keeps steps older than a pass of the ring and its slots are not left unused.
        """
        n = self.block_slots
        if not n:
            return []
        if cursor + n <= capacity:
            return [(cursor, n)]
        new = [self._regions[k] for k in self._new]
        plain = self.in_block.copy()
        for r in new:  # a new region's segments lie in it, and it lies whole
            plain &= (self.starts < r.start) | (self.starts >= r.end)
        ends = np.concatenate([self.starts[plain] + lengths[plain] + 1, [r.end for r in new]])
        fits = ends[ends <= capacity - cursor]
        head = int(fits.max()) if len(fits) else 0
        if not head or n - head > cursor:  # (nearly as large as the ring: it would overlap)
            return [(0, n)]
        return [(cursor, head), (0, n - head)]

    def absolute(self, pieces: list[tuple[int, int]]) -> np.ndarray:
        """Every segment's first slot, the new block laid as ``pieces``."""
        out = self.starts.copy()
        out[self.in_block] = _in_pieces(self.starts[self.in_block], pieces)
        return out

    def ranges(self, pieces: list[tuple[int, int]], lengths: np.ndarray) -> list[tuple[int, int]]:
        """``(start, slots)`` of everything the insert writes outside the new block."""
        starts = self.absolute(pieces)
        out = [(int(s), int(n) + 1) for s, n, b in zip(starts, lengths, self.in_block) if not b]
        return out


class Regions:
    """The regions of every writer of one table (call it under the table's lock)."""

    def __init__(self, capacity: int) -> None:
        self.enabled = region_size(capacity) > 0
        self.capacity = capacity
        self._by_writer: dict[int, list[_Region]] = {}
        # Every writer's lanes, and the steps stored before its last insert: writers not
        # heard from within a pass of the ring no longer count.
        self._lanes: dict[int, tuple[int, int]] = {}
        self._stored = 0  # steps, since the table opened

    def clear(self) -> None:
        self._by_writer.clear()
        self._lanes.clear()

    def size(self, writer: int, lanes: int) -> int:
        """The slots of a new region of ``writer``, which has ``lanes`` lanes now."""
        if not self.enabled:
            return 0
        since = self._stored - self.capacity
        others = sum(n for w, (n, at) in self._lanes.items() if w != writer and at >= since)
        return region_size(self.capacity, lanes + others)

    def plan(
        self,
        writer: int,
        lengths: np.ndarray,
        episode_ids: np.ndarray,
        first_steps: np.ndarray,
        ends: np.ndarray,
        refused: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> Placement:
        """Place one insert's segments (nothing changes until :meth:`commit`).

        ``ends``: whether each segment's last step ends its episode. ``refused``: segments
        that must not continue their predecessor (their observations differ).
        """
        n = len(lengths)
        starts = np.zeros(n, dtype=np.int64)
        in_block = np.ones(n, dtype=bool)
        continues = np.zeros(n, dtype=bool)
        # An actor's insert holds a chunk of each lane or several, so a lane is an episode
        # that goes on past it (one of a lane's unless its episode ended at the insert's end).
        placement = Placement(starts, in_block, continues, 0, _writer=writer)
        placement._steps = int(lengths.sum())
        if not (writer and self.enabled):  # anonymous inserts never get regions
            return _plain(placement, lengths)
        going_on = set(episode_ids[~ends].tolist()) - set(episode_ids[ends].tolist())
        placement._lanes = max(1, len(going_on))
        size = self.size(writer, placement._lanes)
        if not size:
            return _plain(placement, lengths)
        work = [_copy(r) for r in self._by_writer.get(writer, [])]
        open_at: dict[tuple[int, int], int] = {}  # (episode, next step) -> index in work
        last_in_batch: dict[int, int] = {}  # index in work -> its last segment of this insert
        for w, r in enumerate(work):
            if not r.ended:
                open_at[(r.episode, r.next_step)] = w
        block = 0
        for i in range(n):
            length, ep, first = int(lengths[i]), int(episode_ids[i]), int(first_steps[i])
            w = open_at.pop((ep, first), None)
            if length + 1 > size // _SHORT_FRACTION:  # a plain segment of the block
                starts[i], block = block, block + length + 1
                if w is not None:
                    work[w].ended = True  # its episode goes on elsewhere: free its room
                continue
            if w is not None and i not in refused and work[w].used + length <= work[w].end:
                r = work[w]
                starts[i] = r.used - 1
                in_block[i] = w in placement._new
                continues[i] = True
                if w in last_in_batch:
                    placement.in_batch.append((i, last_in_batch[w]))
                elif w not in placement._new:
                    placement.checks.append((i, r.used - 1))
                r.used += length
            else:
                if w is not None:
                    work[w].ended = True  # the episode goes on elsewhere: free its room
                w = next(
                    (k for k, r in enumerate(work) if r.ended and r.used + length + 1 <= r.end),
                    None,
                )
                if w is None and ends[i]:
                    # Nothing will continue it: a plain segment of the block, not a region
                    # whose other slots would wait, reserved, for segments of its writer.
                    starts[i], block = block, block + length + 1
                    continue
                if w is None:  # a new region, in the block
                    # Room for whole segments of this one's length (an actor's chunks are
                    # mostly of one length): slots a region could not use stay the next
                    # block's, not holes it holds (with their disk blocks) till it goes.
                    slots = max(length + 1, 1 + length * ((size - 1) // length))
                    work.append(_Region(block, block + slots, block))
                    block += slots
                    w = len(work) - 1
                    placement._new.append(w)
                r = work[w]
                starts[i] = r.used
                in_block[i] = w in placement._new
                r.used += length + 1
            r.episode, r.next_step, r.ended = ep, first + length, bool(ends[i])
            last_in_batch[w] = i
            if not r.ended:
                open_at[(ep, r.next_step)] = w
        if block > self.capacity:
            # New regions round the block up past what the insert was split to fit in the
            # ring: lay it out plainly instead (the writer starts its regions afresh).
            return _plain(replace(placement, checks=[], in_batch=[], _new=[]), lengths)
        placement.block_slots = block
        placement._regions = work
        return placement

    def forget(self, start: int, n_slots: int) -> None:
        """Drop every region that overlaps slots ``[start, start + n_slots)`` (a new block
        is about to be written there)."""
        end = start + n_slots
        for writer in list(self._by_writer):
            kept = [r for r in self._by_writer[writer] if r.end <= start or r.start >= end]
            if kept:
                self._by_writer[writer] = kept
            else:
                del self._by_writer[writer]

    def overlaps(self, placement: Placement, start: int, n_slots: int) -> bool:
        """Whether slots ``[start, start + n_slots)`` (a piece of the new block) overlap a
        stored region the placement writes into."""
        end = start + n_slots
        return any(
            not (r.end <= start or r.start >= end)
            for k, r in enumerate(placement._regions)
            if k not in placement._new
        )

    def commit(self, placement: Placement, pieces: list[tuple[int, int]]) -> None:
        """Make ``placement`` the writer's regions, its new block laid as ``pieces``."""
        self._stored += placement._steps
        if not placement._writer or not self.enabled:
            return
        since = self._stored - self.capacity
        self._lanes = {w: v for w, v in self._lanes.items() if v[1] >= since}
        self._lanes[placement._writer] = (placement._lanes, self._stored)
        regions = placement._regions
        for k in placement._new:
            r = regions[k]
            shift = int(_in_pieces(np.array([r.start]), pieces)[0]) - r.start
            r.start, r.end, r.used = r.start + shift, r.end + shift, r.used + shift
        # Keep what can still take a segment: a continuation needs one free slot.
        kept = [r for r in regions if r.used + 1 <= r.end]
        if kept:
            self._by_writer[placement._writer] = kept[-_MAX_REGIONS_PER_WRITER:]
        else:
            self._by_writer.pop(placement._writer, None)

    def abandon(self, writer: int) -> None:
        """Forget a writer's regions (an insert of it failed half way)."""
        self._by_writer.pop(writer, None)
        self._lanes.pop(writer, None)


def _plain(placement: Placement, lengths: np.ndarray) -> Placement:
    """``placement`` as one block of segments laid end to end, each with its tail."""
    placement.starts[:] = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]).astype(np.int64)
    placement.in_block[:] = True
    placement.continues[:] = False
    placement.block_slots = int(lengths.sum()) + len(lengths)
    return placement


def ring_end_left(
    pieces: list[tuple[int, int]], cursor: int, capacity: int
) -> list[tuple[int, int]]:
    """The slots a block laid as ``pieces`` leaves before the ring's end when it goes on
    from slot 0 (none, or ``[(start, slots)]``): their steps are the oldest the ring holds,
    and go with the block, so that the ring keeps none past a pass."""
    if not pieces or pieces[-1][0] >= cursor:
        return []
    start = cursor + (pieces[0][1] if pieces[0][0] == cursor else 0)
    return [(start, capacity - start)] if start < capacity else []


def _in_pieces(offsets: np.ndarray, pieces: list[tuple[int, int]]) -> np.ndarray:
    """The slots of ``offsets`` into a block laid as ``pieces``."""
    out = offsets.copy()
    at = 0
    for slot, n in pieces:
        here = (offsets >= at) & (offsets < at + n)
        out[here] = offsets[here] - at + slot
        at += n
    return out


def _copy(r: _Region) -> _Region:
    return _Region(r.start, r.end, r.used, r.episode, r.next_step, r.ended)
