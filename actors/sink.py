"""Where the collection loop writes segments: anything with ``write_segment`` and ``flush``.

A :class:`millpond.Writer` (``ReplayClient.writer(table)``) is the sink of a deployed
actor; :class:`millpond.service.TableSink` writes into an in-process :class:`millpond.Table`,
for tests, notebooks and single-process jobs. A sink may also offer ``write_packed``
(segments as columns), which the loop then prefers.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tensordict import TensorDictBase

__all__ = ["SegmentSink"]


@runtime_checkable
class SegmentSink(Protocol):
    """The interface of :class:`millpond.Writer` that the loop uses."""

    def write_segment(
        self,
        steps: TensorDictBase,
        tail: TensorDictBase,
        episode_id: int | None = None,
        first_step: int | None = None,
    ) -> Any: ...

    def flush(self, timeout_s: float | None = None) -> None: ...
