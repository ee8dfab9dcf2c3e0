"""The forms of a sampled batch, one class each: what it reads of the sampled slots and how
it packages what it read.

Every form is drawn alike (:mod:`.draws`); the caller picks one by object:

* :data:`TED`: a TED TensorDict, ``("next", obs)`` included (:meth:`Table.sample`);
* :data:`SLOTS`: a :class:`SlotSample`, each distinct observation slot read once (what the
  servicer sends, :meth:`Table.sample_slots`);
* :data:`COLOCATED`: a :class:`ColocatedSample`, no observation read, the distinct
  observation slots and their generations instead (:meth:`Table.sample_colocated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np
import torch
from tensordict import TensorDict

from millpond.sample_format import ColocatedSample, SlotSample, assemble_ted, distinct_rows
from millpond.service.samplers import Selection
from millpond.service.storage import SegmentStorage, SlotColumn

T = TypeVar("T")


@dataclass
class Drawn:
    """What a draw picked: its :class:`Selection`, the slots' rows of ``slot_info``, and,
    for a form that asks (:attr:`SampleForm.next_generations`), the generation of each
    step's next slot."""

    selection: Selection
    rows: np.ndarray
    next_gens: np.ndarray | None = None


class SampleForm(Generic[T]):
    """What a batch of this form reads of its sampled slots, and what it returns."""

    #: Why this form cannot sample a queue table (``None``: it can).
    not_for_queues: ClassVar[str | None] = None
    #: Whether it needs, at the draw, the generation of each step's next slot.
    next_generations: ClassVar[bool] = False

    def read(self, storage: SegmentStorage, slots: np.ndarray) -> tuple:
        """What the batch reads of the sampled ``slots``."""
        raise NotImplementedError

    def reread(
        self, storage: SegmentStorage, gathered: tuple, slots: np.ndarray, idx: np.ndarray
    ) -> tuple:
        """``gathered`` once the rows ``idx`` were drawn again (``slots`` holds their new
        slots). The distinct slots change with the redrawn ones: all is read again."""
        return self.read(storage, slots)

    def package(self, gathered: tuple, drawn: Drawn) -> T:
        """The batch of ``drawn`` from what it read."""
        raise NotImplementedError


class TedForm(SampleForm[TensorDict]):
    """The steps as a TED TensorDict, ``("next", obs)`` read for every row."""

    def read(self, storage: SegmentStorage, slots: np.ndarray) -> tuple:
        return storage.gather(slots)

    def reread(
        self, storage: SegmentStorage, gathered: tuple, slots: np.ndarray, idx: np.ndarray
    ) -> tuple:
        """Only the redrawn rows are read again, into ``gathered``."""
        r_now, r_nxt = storage.gather(slots[idx])
        t_idx = torch.from_numpy(idx)
        for d, r in zip(gathered, (r_now, r_nxt)):
            for k, v in r.items():
                d[k][t_idx] = v
        return gathered

    def package(self, gathered: tuple, drawn: Drawn) -> TensorDict:
        return _as_ted(*gathered, drawn)


class SlotsForm(SampleForm[SlotSample]):
    """The steps with each distinct observation slot read once
    (:meth:`SegmentStorage.gather_slots`)."""

    def read(self, storage: SegmentStorage, slots: np.ndarray) -> tuple:
        return storage.gather_slots(slots)

    def package(self, gathered: tuple, drawn: Drawn) -> SlotSample:
        now, observations, obs_rows, next_rows = gathered
        return SlotSample(_as_ted(now, {}, drawn), observations, obs_rows, next_rows)


class ColocatedForm(SampleForm[ColocatedSample]):
    """The steps without observations: the distinct observation slots, and the generation
    each had when drawn (a next slot's: its step's segment's, or that of the successor
    sharing it), for a reader on the shard's host."""

    not_for_queues = (
        "its delivered segments become evictable at once, so they are sampled with their "
        "observations, never read afterwards"
    )
    next_generations = True

    def read(self, storage: SegmentStorage, slots: np.ndarray) -> tuple:
        return (storage.gather_steps(slots),)

    def package(self, gathered: tuple, drawn: Drawn) -> ColocatedSample:
        assert drawn.next_gens is not None
        (now,) = gathered
        distinct, obs_rows, next_rows = distinct_rows(drawn.selection.slots)
        at_draw = np.ascontiguousarray(drawn.rows[..., SlotColumn.GENERATION]).reshape(-1)
        generations = torch.zeros(len(distinct), dtype=torch.int64)
        generations[next_rows.reshape(-1).long()] = torch.from_numpy(
            np.ascontiguousarray(drawn.next_gens, dtype=np.int64).reshape(-1)
        )
        generations[obs_rows.reshape(-1).long()] = torch.from_numpy(at_draw)
        ted = _as_ted(now, {}, drawn)
        return ColocatedSample(ted, distinct, generations, obs_rows, next_rows)


TED = TedForm()
SLOTS = SlotsForm()
COLOCATED = ColocatedForm()


def _as_ted(now: dict, nxt: dict, drawn: Drawn) -> TensorDict:
    """The sampled steps in TED form, their slot metadata read from ``drawn.rows``."""
    selection, rows = drawn.selection, drawn.rows
    return assemble_ted(
        now,
        nxt,
        selection.slots,
        generations=rows[..., SlotColumn.GENERATION],
        episode_ids=rows[..., SlotColumn.EPISODE_ID],
        steps=rows[..., SlotColumn.STEP],
        weights=selection.weights,
        ends=selection.ends,
        mask=selection.mask,
    )
