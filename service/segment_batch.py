"""Segments by their slot layout (:class:`SegmentBatch`) and the vectorised slot ranges they
cover: what storage, samplers and recovery pass between them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from millpond.errors import InvalidDataError

_MAX_STEP = np.iinfo(np.int64).max


@dataclass
class SegmentBatch:
    """Segments by their slot layout; every field is an int64 array with one entry per segment.

    Attributes:
        starts: first slot of each segment.
        lengths: number of steps (the segment occupies ``length + 1`` slots).
        generations: publication number (0 while not yet published).
        episode_ids: episode each segment belongs to.
        first_steps: index within its episode of each segment's first step.
        writers: hash of the writer that sent each segment (0: anonymous).
        sequences: each segment's number in its writer's stream (for idempotent re-sends).
        sums: the data value of each segment (:mod:`.checksums`), set by
            :meth:`~millpond.service.storage.SegmentStorage.write` for
            :meth:`~millpond.service.storage.SegmentStorage.publish`.
    """

    starts: np.ndarray
    lengths: np.ndarray
    generations: np.ndarray
    episode_ids: np.ndarray
    first_steps: np.ndarray
    writers: np.ndarray | None = None
    sequences: np.ndarray | None = None
    sums: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def num_steps(self) -> int:
        return int(self.lengths.sum())

    def step_slots(self) -> np.ndarray:
        """Slot of every step, segment after segment."""
        return ranges(self.starts, self.lengths)

    def all_slots(self) -> np.ndarray:
        """Slot of every step and tail, segment after segment."""
        return ranges(self.starts, self.lengths + 1)

    def select(self, mask: np.ndarray) -> SegmentBatch:
        return SegmentBatch(
            self.starts[mask],
            self.lengths[mask],
            self.generations[mask],
            self.episode_ids[mask],
            self.first_steps[mask],
            None if self.writers is None else self.writers[mask],
            None if self.sequences is None else self.sequences[mask],
            None if self.sums is None else self.sums[mask],
        )

    @classmethod
    def concat(cls, batches: list[SegmentBatch]) -> SegmentBatch:
        """The segments of ``batches`` (of disjoint slots), each once."""
        if len(batches) == 1:
            return batches[0]
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls.empty()
        fields = {}
        for name in ("starts", "lengths", "generations", "episode_ids", "first_steps"):
            fields[name] = np.concatenate([getattr(b, name) for b in batches])
        for name in ("writers", "sequences", "sums"):
            parts = [getattr(b, name) for b in batches]
            fields[name] = None if any(p is None for p in parts) else np.concatenate(parts)
        out = cls(**fields)
        # A segment that reads another's frames comes along with each (chains).
        _, first = np.unique(out.starts, return_index=True)
        return out if len(first) == len(out) else out.select(np.sort(first))

    @classmethod
    def empty(cls) -> SegmentBatch:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, z)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` for each (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


def check_step_range(episode_ids: np.ndarray, first_steps: np.ndarray, lengths: np.ndarray) -> None:
    """Refuse segments whose steps (up to the tail's, ``first_step + length``) would pass the
    int64 range: :class:`InvalidDataError` naming the value, never a silent wrap-around."""
    over = first_steps > _MAX_STEP - lengths
    if over.any():
        i = int(np.argmax(over))
        raise InvalidDataError(
            f"first_step {int(first_steps[i])} of episode {int(episode_ids[i])} is too large: "
            f"its segment of {int(lengths[i])} steps would number steps past 2**63 - 1"
        )
