"""The slices sampler: sequences of K consecutive steps of one episode.

Segments of an episode that follow each other (the next one starts at the step after the
previous one's last) form a *chain*, wherever their slots lie. A step is a valid slice
start when its chain holds at least K steps from it on; starts are drawn uniformly among
valid ones, and a slice that crosses from one segment into the next continues there.
Each step's next observation is still the slot after it, so a slice of K steps carries
its K+1 observations without any special case.
"""

from __future__ import annotations

import numpy as np

from millpond.service.samplers import Sampler, Selection, _SlotSet
from millpond.service.segment_batch import SegmentBatch, ranges


class _Chain:
    __slots__ = ("episode_id", "segments")

    def __init__(self, episode_id: int) -> None:
        self.episode_id = episode_id
        # (start slot, length, first step) per segment, in step order
        self.segments: list[tuple[int, int, int]] = []

    @property
    def next_step(self) -> int:
        _, length, first = self.segments[-1]
        return first + length


class SliceSampler(Sampler):
    """Uniform over valid slice starts; returns ``[B, slice_len]`` step slots.

    With ``strict_length`` (the default) a start is valid when its chain holds
    ``slice_len`` steps from it on. Without, every stored step is a valid start, so the
    last ``slice_len - 1`` steps of an episode begin slices too and episodes shorter than
    ``slice_len`` are sampled: such a slice holds the steps left, then repeats its last
    slot, and its ``mask`` is false on the repeats (TorchRL's ``strict_length=False``).
    Implements :class:`millpond.roles.SlotSampler`.
    """

    def __init__(
        self, capacity: int, slice_len: int, seed: int | None = None, strict_length: bool = True
    ) -> None:
        super().__init__(capacity, seed)
        self.slice_len = slice_len
        self.strict_length = strict_length
        self._clear()

    def _clear(self) -> None:
        self._starts = _SlotSet(self.capacity)
        self._steps = 0
        self._chain_of: dict[int, _Chain] = {}  # segment start slot -> chain
        self._open: dict[tuple[int, int], _Chain] = {}  # (episode, next step) -> chain
        self._segment_start = np.zeros(self.capacity, dtype=np.int64)  # per step slot
        self._segment_length = np.zeros(self.capacity, dtype=np.int64)

    def reset(self, next_generation: int) -> None:
        super().reset(next_generation)
        self._clear()

    @property
    def size(self) -> int:
        return self._steps

    @property
    def mass(self) -> float:
        return float(self._starts.count)

    def can_sample(self, batch_size: int) -> bool:
        return self._starts.count > 0

    def on_publish(self, segments: SegmentBatch) -> None:
        slots = segments.step_slots()
        self._segment_start[slots] = np.repeat(segments.starts, segments.lengths)
        self._segment_length[slots] = np.repeat(segments.lengths, segments.lengths)
        touched: dict[int, _Chain] = {}
        for start, length, ep, first in zip(
            segments.starts.tolist(),
            segments.lengths.tolist(),
            segments.episode_ids.tolist(),
            segments.first_steps.tolist(),
        ):
            chain = self._open.pop((ep, first), None)
            if chain is None:
                chain = _Chain(ep)
            chain.segments.append((start, length, first))
            self._chain_of[start] = chain
            self._open[(ep, chain.next_step)] = chain
            self._steps += length
            touched[id(chain)] = chain
        for chain in touched.values():
            self._refresh(chain)

    def on_evict(self, segments: SegmentBatch) -> None:
        self._starts.remove(segments.step_slots())
        touched: dict[int, _Chain] = {}
        for start, length in zip(segments.starts.tolist(), segments.lengths.tolist()):
            chain = self._chain_of.pop(start)
            self._steps -= length
            touched.pop(id(chain), None)
            if self._open.get((chain.episode_id, chain.next_step)) is chain:
                del self._open[(chain.episode_id, chain.next_step)]
            i = next(j for j, seg in enumerate(chain.segments) if seg[0] == start)
            before, after = chain.segments[:i], chain.segments[i + 1 :]
            for part in (before, after):
                if part:
                    piece = _Chain(chain.episode_id)
                    piece.segments = part
                    for seg in part:
                        self._chain_of[seg[0]] = piece
                    touched[id(piece)] = piece
                    if part is after:
                        self._open[(piece.episode_id, piece.next_step)] = piece
        for chain in touched.values():
            self._refresh(chain)

    def _refresh(self, chain: _Chain) -> None:
        """Recompute which steps of ``chain`` start a full slice."""
        starts = np.array([s[0] for s in chain.segments], dtype=np.int64)
        lengths = np.array([s[1] for s in chain.segments], dtype=np.int64)
        slots = ranges(starts, lengths)
        remaining = len(slots) - np.arange(len(slots))
        valid = remaining >= (self.slice_len if self.strict_length else 1)
        self._starts.remove(slots[~valid])
        self._starts.add(slots[valid])

    def sample(self, batch_size: int) -> Selection:
        return self._slices_from(self._starts.sample(batch_size, self.rng))

    def _slices_from(self, starts: np.ndarray) -> Selection:
        """The slices that begin at the valid starts ``starts``, ``[B]``."""
        k = self.slice_len
        batch_size = len(starts)
        out = starts[:, None] + np.arange(k)[None, :]
        # Slices that run past their segment's last step continue in the next segment.
        seg_start = self._segment_start[starts]
        crossing = np.flatnonzero(starts + k > seg_start + self._segment_length[starts])
        valid = np.full(batch_size, k, dtype=np.int64)  # real steps per slice
        for b in crossing.tolist():
            out[b], valid[b] = self._walk(int(starts[b]), int(seg_start[b]))
        mask = np.arange(k)[None, :] < valid[:, None]
        # A slice stops at its last real step; its repeats are stops too.
        ends = ~mask | (np.arange(k)[None, :] == (valid - 1)[:, None])
        return Selection(out, ends=ends, mask=None if self.strict_length else mask)

    def _walk(self, slot: int, seg_start: int) -> tuple[np.ndarray, int]:
        """The slots of a slice that leaves its first segment, and how many are real."""
        chain = self._chain_of[seg_start]
        i = next(j for j, s in enumerate(chain.segments) if s[0] == seg_start)
        out: list[int] = []
        start, length, _ = chain.segments[i]
        pos = slot
        while len(out) < self.slice_len:
            if pos < start + length:
                take = min(start + length - pos, self.slice_len - len(out))
                out.extend(range(pos, pos + take))
                pos += take
            elif i + 1 < len(chain.segments):
                i += 1
                start, length, _ = chain.segments[i]
                pos = start
            else:  # the chain ends first (only without strict_length): repeat its last slot
                real = len(out)
                return np.array(out + [out[-1]] * (self.slice_len - real), dtype=np.int64), real
        return np.array(out, dtype=np.int64), self.slice_len

    def state(self) -> dict:
        return {
            "size": self.size,
            "slice_starts": self._starts.count,
            "slice_len": self.slice_len,
            "strict_length": self.strict_length,
        }
