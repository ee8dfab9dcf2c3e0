"""What the reference learners share beyond the ground floor's checks: the published version,
and how many gradient steps old the policy behind a batch's steps is."""

from __future__ import annotations

from collections import OrderedDict

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
        self._steps_at: OrderedDict[int, int] = OrderedDict({version: 0})

    def published(self, version: int, steps: int) -> None:
        """``version`` was published after ``steps`` gradient steps."""
        self._steps_at[version] = steps
        if len(self._steps_at) > _REMEMBERED:
            self._steps_at.popitem(last=False)

    def lag_steps(self, versions: torch.Tensor, steps: int) -> torch.Tensor:
        """Gradient steps taken since each of ``versions`` was published (int64, like it)."""
        oldest = next(iter(self._steps_at.values()))
        at = [self._steps_at.get(int(v), oldest) for v in versions.reshape(-1).tolist()]
        return steps - torch.tensor(at, dtype=torch.int64).reshape(versions.shape)
