"""The prioritized slices sampler: slices drawn by the priority of their first step.

Prioritized n-step replay (Rainbow, Hessel et al. 2018; Ape-X, Horgan et al. 2018): each
stored step that may begin a slice (a *valid start*, as :mod:`.slice_sampler` defines it)
has a priority ``p_i``; a slice starting at ``i`` is drawn with probability
``P(i) = p_i^alpha / sum_j p_j^alpha`` over the valid starts, with the importance weight
``(N P(i))^-beta`` over the largest possible one (``N`` valid starts), exactly as
:class:`~.samplers.PrioritizedSampler` weighs single steps (Schaul et al. 2016). A learner
updates the priority of a slice's first step (its ``index``); the table drops an update
whose slot was overwritten since the draw.

Raw priorities are kept per step slot in the table's ``priorities.bin``, laid out as the
prioritized sampler's, so that they survive restarts; a step that is not (or no longer) a
valid start keeps its priority but is never drawn. New steps get the largest priority seen.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from millpond.service._sum_tree import SumMinTree
from millpond.service.samplers import Selection, _PriorityFile, _SlotSet, _weighted_draw
from millpond.service.segment_batch import SegmentBatch
from millpond.service.slice_sampler import SliceSampler

__all__ = ["PrioritizedSliceSampler"]


class _WeightedStarts(_SlotSet):
    """The valid slice starts, and a sum-tree holding ``p^alpha`` at each of them (0
    elsewhere): membership and count as :class:`_SlotSet`'s, draws by the tree."""

    def __init__(self, capacity: int, priorities: np.ndarray, alpha: float) -> None:
        super().__init__(capacity)
        self.priorities = priorities
        self.alpha = alpha
        self.tree = SumMinTree(capacity)

    def add(self, slots: np.ndarray) -> None:
        super().add(slots)
        self.tree.set(slots, np.asarray(self.priorities[slots]) ** self.alpha)

    def remove(self, slots: np.ndarray) -> None:
        super().remove(slots)
        self.tree.set(slots, 0.0)

    def reweigh(self, slots: np.ndarray) -> None:
        """Take the priorities of ``slots`` again, where they are valid starts."""
        slots = slots[self.member[slots]]
        self.tree.set(slots, np.asarray(self.priorities[slots]) ** self.alpha)


class PrioritizedSliceSampler(_PriorityFile, SliceSampler):
    """Slices ``[B, slice_len]`` as :class:`~.slice_sampler.SliceSampler` returns them, each
    drawn by the priority of its first step, with importance weights (see the module
    docstring). A slice's weight is repeated along its steps (``weights`` ``[B,
    slice_len]``), so that it indexes with the batch; a learner reads column 0.

    With a ``directory``, raw priorities are memory-mapped from its ``priorities.bin``
    (``capacity + 1`` float64, the last holding the largest priority) and flushed with the
    table's checkpoints. Implements :class:`millpond.roles.SlotSampler`.
    """

    def __init__(
        self,
        capacity: int,
        slice_len: int,
        alpha: float = 0.6,
        beta: float = 0.4,
        seed: int | None = None,
        strict_length: bool = True,
        directory: Path | None = None,
    ) -> None:
        self.alpha = alpha
        self.beta = beta
        self._open_priorities(capacity, directory)
        super().__init__(capacity, slice_len, seed, strict_length)

    def _clear(self) -> None:
        super()._clear()
        self._starts = _WeightedStarts(self.capacity, self.priorities, self.alpha)

    def reset(self, next_generation: int) -> None:
        super().reset(next_generation)
        self._max[0] = 1.0  # new steps start from priority 1 again

    @property
    def mass(self) -> float:
        return self._starts.tree.total

    def can_sample(self, batch_size: int) -> bool:
        return self._starts.count > 0 and self._starts.tree.total > 0

    def on_publish(self, segments: SegmentBatch, priorities: np.ndarray | None = None) -> None:
        """Make the segments' steps slice starts (where valid): with ``priorities`` (float64,
        one per step, segment after segment, finite and >= 0: an Ape-X actor's n-step TD
        errors) those, else :attr:`max_priority` each. Given priorities raise
        :attr:`max_priority` as updates do."""
        self._set_new(segments.step_slots(), priorities)
        super().on_publish(segments)

    def recover(self, segments: SegmentBatch) -> None:
        """Take back the segments found on disk with the priorities stored for them."""
        self._raise_max(np.asarray(self.priorities[segments.step_slots()], dtype=np.float64))
        super().on_publish(segments)

    def sample(self, batch_size: int) -> Selection:
        starts, weights = _weighted_draw(
            self._starts.tree, self._starts.count, batch_size, self.rng, self.beta
        )
        selection = self._slices_from(starts)
        selection.weights = np.repeat(weights[:, None], self.slice_len, axis=1)
        return selection

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Set the raw priorities of live step slots, slices' first steps (the table drops
        stale ones first); a slot that is no longer a valid start keeps it for later."""
        if self._set_updates(slots, priorities):
            self._starts.reweigh(slots)

    def set_exponents(self, alpha: float, beta: float) -> None:
        """Change ``alpha`` and ``beta`` of a running table: the valid starts' sampling
        weights are recomputed from their priorities."""
        if alpha != self.alpha:
            self._starts.alpha = alpha
            self._starts.reweigh(np.flatnonzero(self._starts.member))
        self.alpha, self.beta = alpha, beta

    def state(self) -> dict:
        return {
            **super().state(),
            "total_priority": self._starts.tree.total,
            "max_priority": self.max_priority,
            "alpha": self.alpha,
            "beta": self.beta,
        }
