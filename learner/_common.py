"""What the reference learners share beyond the ground floor's checks: the published version,
publishing a network's weights, how many gradient steps old the policy behind a batch's
steps is, and where the batches come from."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.checks import check_int
from millpond.errors import DeadlineExceededError, InvalidConfigError
from millpond.learner import distributed
from millpond.learner.client import ReplayClient

logger = logging.getLogger("millpond.learner")

#: Versions a :class:`PublishClock` remembers (a DQN publishing every 10 steps: 1M steps).
_REMEMBERED = 100_000


def check_learner_args(config: object, kind: type, version: int | None, **modules: object) -> None:
    """Raise :class:`InvalidConfigError` unless ``config`` is a ``kind``, each of
    ``modules`` a torch ``nn.Module`` and ``version`` (if given) at least ``-1``."""
    if not isinstance(config, kind):
        raise InvalidConfigError(f"config must be a {kind.__name__}, received {config!r}")
    for name, module in modules.items():
        if not isinstance(module, nn.Module):
            raise InvalidConfigError(f"{name} must be a torch nn.Module")
    if version is not None:
        check_int("version", version, -1)


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

    def lag_metrics(self, acted: torch.Tensor, version: int, steps: int) -> dict[str, Any]:
        """How far behind ``version`` (after ``steps`` gradient steps) the policies that
        acted ``acted`` (a batch's ``policy_version``) are: ``policy_lag_mean`` /
        ``policy_lag_max`` in versions, ``policy_lag_steps_mean`` / ``policy_lag_steps_max``
        in gradient steps."""
        acted = acted.reshape(-1)
        lag = version - acted
        lag_steps = self.lag_steps(acted, steps)
        return {
            "policy_lag_mean": float(lag.float().mean()),
            "policy_lag_max": int(lag.max()),
            "policy_lag_steps_mean": float(lag_steps.float().mean()),
            "policy_lag_steps_max": int(lag_steps.max()),
        }


def publish_module(
    client: ReplayClient,
    module: nn.Module,
    version: int,
    clock: PublishClock,
    steps: int,
    data_parallel: bool,
    max_lag: int | None = None,
) -> int:
    """Publish ``module``'s weights as version ``version + 1`` after ``steps`` gradient
    steps; returns the version. Data-parallel ranks other than 0 count the version without
    sending anything. With ``max_lag`` the publication waits at the weights rendezvous until
    every acting env actor holds ``version + 1 - max_lag`` or newer, for as long as they
    take (bounded staleness: a deadline stores nothing, so it is asked again)."""
    if data_parallel and distributed.rank() != 0:
        version += 1
    else:
        state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        while max_lag is not None:
            try:
                version = client.publish_weights(state, version + 1, max_lag=max_lag)
                break
            except DeadlineExceededError as e:  # the step is taken: wait on
                logger.warning("the learner waits for the actors to catch up: %s", e)
        else:
            version = client.publish_weights(state, version + 1)
    clock.published(version, steps)
    return version


class BatchSource:
    """A learner's batches from one table: one ``client.sample`` per batch, or with
    ``prefetch > 0`` a :meth:`ReplayClient.iterate` keeping that many requests in flight
    (restarted after an error, since an iterator that raised is finished)."""

    def __init__(
        self,
        client: ReplayClient,
        table: str,
        batch_size: int,
        prefetch: int,
        timeout_s: float | None,
    ) -> None:
        self._client, self._table = client, table
        self._batch_size, self._prefetch, self._timeout_s = batch_size, prefetch, timeout_s
        self._batches: Iterator[TensorDictBase] | None = None

    def next(self) -> TensorDictBase:
        """The next batch."""
        if self._prefetch == 0:
            return self._client.sample(self._table, self._batch_size, timeout_s=self._timeout_s)
        if self._batches is None:
            self._batches = self._client.iterate(
                self._table, self._batch_size, prefetch=self._prefetch, timeout_s=self._timeout_s
            )
        try:
            return next(self._batches)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Cancel prefetched sample requests (a no-op without prefetch)."""
        if self._batches is not None:
            batches, self._batches = self._batches, None
            batches.close()
