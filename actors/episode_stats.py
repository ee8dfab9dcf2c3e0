"""Episode returns and lengths, tracked from the loop's ``[P, T]`` batches."""

from __future__ import annotations

from collections import deque

import numpy as np
from tensordict import TensorDictBase


class ReturnTracker:
    """Sums rewards per lane and records each finished episode's return and length.

    Args:
        num_lanes: ``P``.
        window: how many recent episodes :attr:`mean_return` averages over.
    """

    def __init__(self, num_lanes: int, window: int = 100) -> None:
        self._running = np.zeros(num_lanes, dtype=np.float64)
        self._length = np.zeros(num_lanes, dtype=np.int64)
        self.recent: deque[float] = deque(maxlen=window)
        self.finished: list[tuple[float, int]] = []  # since the last drain()

    def update(self, batch: TensorDictBase) -> None:
        """Account for one ``[P, T]`` batch (rows in time order per lane)."""
        reward = batch["next", "reward"].reshape(batch.shape[0], batch.shape[1]).double().numpy()
        done = batch["next", "done"].reshape(batch.shape[0], batch.shape[1]).numpy()
        for t in range(batch.shape[1]):
            self._running += reward[:, t]
            self._length += 1
            for lane in np.flatnonzero(done[:, t]):
                episode = (float(self._running[lane]), int(self._length[lane]))
                self.recent.append(episode[0])
                self.finished.append(episode)
                self._running[lane] = 0.0
                self._length[lane] = 0

    @property
    def mean_return(self) -> float | None:
        """Mean return of the last ``window`` finished episodes (``None`` before the first)."""
        return float(np.mean(self.recent)) if self.recent else None

    def drain(self) -> list[tuple[float, int]]:
        """The (return, length) of episodes finished since the last call."""
        out, self.finished = self.finished, []
        return out
