"""Rows of a colocated batch to be replaced later: moved to its end, written in when needed.

A colocated reader finds some rows of a batch overwritten while it read them (their slots
were reused by an insert that arrived after the draw), and the shard draws replacements. A
joined call's batch of ``prefetch * batch_size`` rows is handed out a part at a time, so the
replacements are needed only by the parts that hold those rows: moved to the batch's end,
the parts before them go to the learner while the replacements are drawn. The rows of one
draw are independent and in no order, so which part holds which of them changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["LateRows", "move_last"]


@dataclass(frozen=True)
class LateRows:
    """The rows from ``first`` on of a batch wait for their replacements, which ``fill``
    receives and writes in (raising what their call raised)."""

    first: int
    fill: Callable[[], None]


def move_last(td: TensorDict, rows: np.ndarray) -> np.ndarray:
    """Move the rows ``rows`` (sorted, distinct indices along ``td``'s first dimension) to
    its end, in place: the rows that were there take their places. Returns the indices
    they now have, the last ``len(rows)``."""
    total, k = int(td.batch_size[0]), len(rows)
    tail = total - k
    outside = rows[rows < tail]
    if len(outside):
        in_tail = np.zeros(k, dtype=bool)
        in_tail[rows[rows >= tail] - tail] = True
        kept = tail + np.flatnonzero(~in_tail)  # rows to keep in the tail: as many as outside
        td[torch.from_numpy(outside)] = td[torch.from_numpy(kept)]
    return np.arange(tail, total, dtype=np.int64)
