"""What the reference learners share beyond the ground floor's checks: the published version,
and how many gradient steps old the policy behind a batch's steps is."""

from __future__ import annotations

import numpy as np
import torch

from millpond.learner.client import ReplayClient

#: Versions a :class:`PublishClock` remembers (a DQN publishing every 10 steps: 1M steps).
_REMEMBERED = 100_000


def published_version(client: ReplayClient) -> int:
    """The weight version the weights rendezvous holds now, ``-1`` if none (or if it
    cannot say)."""
    version = client.info().get("weights_version")
    return -1 if version is None else int(version)


class PublishClock:
    """The learner's gradient-step count at each version it published, so that a batch's
    policy lag reads in gradient steps as well as in versions.

    Versions count publications, whose spacing differs between learners (PPO: one per
    iteration of many minibatch steps; DQN: every ``publish_every`` steps), so a lag in
    versions alone does not say how far the acting policy is from the trained one. A
    version published before this learner started (a restarted job) is counted from the
    learner's start: its lag in steps is then a lower bound.
    """

    def __init__(self, version: int) -> None:
        self._versions = np.full(64, version, dtype=np.int64)  # increasing, first n used
        self._steps = np.zeros(64, dtype=np.int64)
        self._n = 1

    def published(self, version: int, steps: int) -> None:
        """``version`` was published after ``steps`` gradient steps."""
        if self._n == _REMEMBERED:  # forget the older half
            half = _REMEMBERED // 2
            self._versions[:half] = self._versions[half : self._n]
            self._steps[:half] = self._steps[half : self._n]
            self._n = half
        if self._n == len(self._versions):
            self._versions = np.resize(self._versions, 2 * self._n)
            self._steps = np.resize(self._steps, 2 * self._n)
        self._versions[self._n], self._steps[self._n] = version, steps
        self._n += 1

    def lag_steps(self, versions: torch.Tensor, steps: int) -> torch.Tensor:
        """Gradient steps taken since each of ``versions`` was published (int64, like it)."""
        acted = versions.numpy() if versions.device.type == "cpu" else versions.cpu().numpy()
        # the latest publication at or before each version (the oldest known for older ones)
        i = np.searchsorted(self._versions[: self._n], acted, side="right") - 1
        return torch.from_numpy(steps - self._steps[np.maximum(i, 0)])
