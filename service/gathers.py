"""Reading slots out: the three gathers of step slots' rows from the column files.

:meth:`Gathers.gather` reads values and next observations per slot,
:meth:`Gathers.gather_slots` reads each distinct observation slot once, and
:meth:`Gathers.gather_steps` reads the step keys alone. Frame-stacked observations are
rebuilt from their frame and prefix columns (:func:`millpond.frame_stacks.rebuild`), so
nothing above sees frames.
"""

from __future__ import annotations

import numpy as np
import torch

from millpond.frame_stacks import rebuild
from millpond.sample_format import distinct_rows
from millpond.service.chains import Chains
from millpond.spec import OBSERVATION, Key


class Gathers(Chains):
    """The reads of step slots' rows (a base of the storage)."""

    columns: dict[Key, torch.Tensor]
    prefixes: dict[Key, torch.Tensor]

    def gather(self, slots: np.ndarray) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:
        """Read step slots: ``(values at slots, observations at slots + 1)``.

        The first dict has every key (observations and step keys); the second has the
        observation keys only: the next observations. ``slots`` may have any shape.
        """
        assert self.spec is not None
        shape = slots.shape
        flat = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))
        flat_next = flat + 1
        now: dict[Key, torch.Tensor] = {}
        nxt: dict[Key, torch.Tensor] = {}
        starts = records = None
        if self.stacks:  # a slot and the next are in one segment: one lookup serves both
            starts, records = self._segment_of(flat)
        for key, f in self.spec.fields.items():
            col = self.columns[key]
            if key in self.stacks:
                now[key] = rebuild(col, self.prefixes[key], flat, starts, records)
                nxt[key] = rebuild(col, self.prefixes[key], flat_next, starts, records)
                continue
            now[key] = torch.index_select(col, 0, flat)
            if f.role == OBSERVATION:
                nxt[key] = torch.index_select(col, 0, flat_next)
        if len(shape) > 1:  # slices: [B, K] rows
            for d in (now, nxt):
                for key, t in d.items():
                    d[key] = t.reshape(*shape, *t.shape[1:])
        return now, nxt

    def gather_slots(
        self, slots: np.ndarray
    ) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Read step slots with each observation slot read once.

        Returns ``(step keys at slots, observations at the distinct slots of slots and
        slots + 1 in slot order, rows, next_rows)``: ``rows`` and ``next_rows`` (int32,
        ``slots``' shape) index the distinct observations. Consecutive sampled steps
        (slices, queue batches) share a slot, so this reads and ships fewer bytes than
        :meth:`gather`, and sorted slots read the memory maps in order.
        """
        assert self.spec is not None
        distinct, rows, next_rows = distinct_rows(slots)
        now = self.gather_steps(slots)
        obs: dict[Key, torch.Tensor] = {}
        starts = records = None
        if self.stacks:
            starts, records = self._segment_of(distinct)
        for key, f in self.spec.fields.items():
            col = self.columns[key]
            if key in self.stacks:
                obs[key] = rebuild(col, self.prefixes[key], distinct, starts, records)
            elif f.role == OBSERVATION:
                obs[key] = torch.index_select(col, 0, distinct)
        return now, obs, rows, next_rows

    def gather_steps(self, slots: np.ndarray) -> dict[Key, torch.Tensor]:
        """The step keys (no observation) at step ``slots`` (any shape): what
        :meth:`gather_slots` returns first, for a reader that reads the observations itself."""
        assert self.spec is not None
        shape = slots.shape
        flat = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))
        now: dict[Key, torch.Tensor] = {}
        for key, f in self.spec.fields.items():
            if f.role != OBSERVATION and key not in self.stacks:
                t = torch.index_select(self.columns[key], 0, flat)
                now[key] = t.reshape(*shape, *t.shape[1:]) if len(shape) > 1 else t
        return now

    def _segment_of(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the older frames of each slot's stacks are (slots of published segments):
        the first slot of its chain and the prefix row (see :mod:`.chains`)."""
        records = self._pointers(slots.numpy()).astype(np.int64)
        starts, rows = self.stack_origins(records)
        return (
            torch.from_numpy(np.ascontiguousarray(starts)),
            torch.from_numpy(np.ascontiguousarray(rows)),
        )
