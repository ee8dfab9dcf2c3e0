"""An in-process sink for the collection loop: segments go straight into a :class:`Table`.

It has the interface of :class:`millpond.Writer` that :class:`millpond.actors.Collector`
uses (``write_segment``, ``write_packed``, ``flush``), for tests, notebooks and
single-process jobs that need no server.
"""

from __future__ import annotations

import numpy as np
from tensordict import TensorDictBase

from millpond.errors import InvalidDataError
from millpond.segments import PackedSegments
from millpond.service.table import Table

__all__ = ["TableSink"]


class TableSink:
    """Inserts each segment into an in-process :class:`~millpond.Table`.

    Implements :class:`millpond.roles.SegmentSink`.

    Args:
        table: the table to insert into.
        timeout: seconds an insert may wait for the table's rate limiter before raising
            :class:`~millpond.RateLimiterTimeoutError` (``None``: wait as long as needed).
    """

    def __init__(self, table: Table, timeout: float | None = None) -> None:
        self.table = table
        self.timeout = timeout
        self.segments_written = 0
        self.steps_written = 0

    def write_segment(
        self,
        steps: TensorDictBase,
        tail: TensorDictBase,
        episode_id: int | None = None,
        first_step: int | None = None,
    ) -> int:
        """Store one segment; returns its generation."""
        if episode_id is None:
            raise InvalidDataError("TableSink needs an explicit episode_id")
        gens = self.table.insert(steps, tail, episode_id, first_step or 0, timeout=self.timeout)
        self.segments_written += 1
        self.steps_written += steps.batch_size[0]
        return int(gens[0])

    def write_packed(self, packed: PackedSegments) -> np.ndarray:
        """Store segments laid out as columns; returns their generations."""
        gens = self.table.insert_packed(packed, timeout=self.timeout)
        self.segments_written += len(packed)
        self.steps_written += packed.num_steps
        return gens

    def flush(self, timeout_s: float | None = None) -> None:
        """Nothing to wait for: inserts are synchronous."""

    def __repr__(self) -> str:
        return f"TableSink({self.table.name!r}, steps_written={self.steps_written})"
