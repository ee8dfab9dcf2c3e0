"""A vectorised sum-tree and min-tree over a fixed number of leaves (numpy)."""

from __future__ import annotations

import numpy as np


class SumMinTree:
    """Leaf values with O(log n) batched updates, prefix-sum search and a running minimum.

    A leaf value of 0 means "absent": it adds nothing to the sum and is ignored by the min.
    """

    def __init__(self, num_leaves: int) -> None:
        size = 1
        while size < num_leaves:
            size *= 2
        self._size = size
        self._sum = np.zeros(2 * size, dtype=np.float64)
        self._min = np.full(2 * size, np.inf, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest non-zero leaf (``inf`` when every leaf is 0)."""
        return float(self._min[1])

    def get(self, idx: np.ndarray) -> np.ndarray:
        return self._sum[self._size + np.asarray(idx)]

    def set(self, idx: np.ndarray, values: np.ndarray | float) -> None:
        """Set leaves ``idx`` to ``values`` (>= 0) and update their ancestors."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return
        values = np.broadcast_to(np.asarray(values, dtype=np.float64), idx.shape)
        nodes = idx + self._size
        self._sum[nodes] = values
        self._min[nodes] = np.where(values > 0, values, np.inf)
        nodes = np.unique(nodes // 2)
        while nodes[0] >= 1:
            left, right = 2 * nodes, 2 * nodes + 1
            self._sum[nodes] = self._sum[left] + self._sum[right]
            self._min[nodes] = np.minimum(self._min[left], self._min[right])
            if nodes[0] == 1:
                break
            nodes = np.unique(nodes // 2)

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """For each value ``u`` in ``[0, total)``, the leaf ``i`` with ``sum(<i) <= u < sum(<=i)``."""
        u = np.asarray(prefix, dtype=np.float64).copy()
        nodes = np.ones(u.shape, dtype=np.int64)
        depth_nodes = 1
        while depth_nodes < self._size:
            depth_nodes *= 2
            left = self._sum[2 * nodes]
            go_right = u >= left
            u -= np.where(go_right, left, 0.0)
            nodes = 2 * nodes + go_right
        return nodes - self._size
