"""What the reference learners share beyond the ground floor's checks: the published version,
publishing a network's weights (now, or in the background while the next steps run),
how many gradient steps old the policy behind a batch's steps is, and where the batches
come from."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.checks import check_int
from millpond.errors import DeadlineExceededError, InvalidConfigError, MillpondError
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

    def _lag_steps(self, acted: np.ndarray, steps: int) -> np.ndarray:
        # the latest publication at or before each version (the oldest known for older ones)
        i = np.searchsorted(self._versions[: self._n], acted, side="right") - 1
        return steps - self._steps[np.maximum(i, 0)]

    def lag_metrics(
        self, acted: torch.Tensor, version: int, steps: int, name: str = "policy_lag"
    ) -> dict[str, Any]:
        """How far behind ``version`` (after ``steps`` gradient steps) the policies that
        acted ``acted`` (a batch's ``policy_version``) are: ``{name}_mean`` / ``{name}_max``
        in versions, ``{name}_steps_mean`` / ``{name}_steps_max`` in gradient steps."""
        # numpy: a learner computes these every step, and four small torch reductions
        # cost more than its whole polyak update
        acted = acted.reshape(-1)
        acted_np = (acted if acted.device.type == "cpu" else acted.cpu()).numpy()
        lag = version - acted_np
        lag_steps = self._lag_steps(acted_np, steps)
        return {
            f"{name}_mean": float(lag.mean(dtype=np.float64)),
            f"{name}_max": int(lag.max()),
            f"{name}_steps_mean": float(lag_steps.mean(dtype=np.float64)),
            f"{name}_steps_max": int(lag_steps.max()),
        }


def adam(params: Any, device: torch.device, **kwargs: Any) -> torch.optim.Adam:
    """Adam over ``params`` (tensors or parameter groups) on ``device``: torch's fused kernel
    where it has one (CPU, CUDA), else one foreach kernel per operation. The same update as
    the per-tensor loop, without its Python cost per parameter, which on small networks is
    more than the arithmetic (a CartPole Q-network's step: 0.07 ms fused, 0.18 ms foreach,
    0.2-0.27 ms the loop)."""
    fused = device.type in ("cpu", "cuda")
    return torch.optim.Adam(params, fused=fused or None, foreach=None if fused else True, **kwargs)


def module_weights(module: nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """``module``'s state dict on the host; ``copy``: tensors of their own even where they
    are there already (a snapshot that later in-place updates leave as it is)."""
    state = {}
    for k, v in module.state_dict().items():
        v = v.detach()
        state[k] = v.clone() if copy and v.device.type == "cpu" else v.cpu()
    return state


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
        version = _send(client, module_weights(module), version + 1, max_lag)
    clock.published(version, steps)
    return version


def _send(
    client: ReplayClient, state: dict[str, torch.Tensor], version: int, max_lag: int | None
) -> int:
    """Publish ``state`` as ``version``; with ``max_lag`` ask again after each deadline."""
    while max_lag is not None:
        try:
            return client.publish_weights(state, version, max_lag=max_lag)
        except DeadlineExceededError as e:  # nothing stored: wait on
            logger.warning("the learner waits for the actors to catch up: %s", e)
    return client.publish_weights(state, version)


class PublishAhead:
    """A learner's periodic weight publications, each sent while the learner takes its next
    steps.

    A publication waits for the weights rendezvous to store it (a gRPC call to a shard that
    shares the learner's cores, and with ``max_lag`` the acting actors), time in which the
    learner's gradient steps stop; here it is a snapshot of the weights whose call goes on
    in gRPC's core (:meth:`ReplayClient.publish_weights_later`: no thread of the learner's
    waits on it, or takes turns with its steps at the GIL). One publication is in flight at
    a time: the next one, :meth:`now`, :meth:`wait` and :meth:`close` wait for it first, so
    versions land in order, and an error the rendezvous answered is raised there (a
    deadline with ``max_lag``, nothing stored, is asked again there, as :func:`publish_module`
    does). Data-parallel ranks other than 0 count the version without sending anything, as
    :func:`publish_module`.

    **Bounded staleness** (``max_lag``): the rendezvous stores version ``v`` only once every
    acting env actor holds ``v - max_lag`` or newer, in the background as it would in the step,
    so the acting lag (the newest stored version minus the one an actor acts with) stays
    within ``max_lag``. The learner runs ahead of the stored version by the one publication
    in flight at most, since the next hand-over waits for it: counted from the learner's
    version the actors trail by ``max_lag + 1`` at most while one is in flight, and while
    the actors hold a publication back the learner takes one more publication interval of
    gradient steps before it waits (in the step it would have waited at once).
    """

    def __init__(
        self,
        client: ReplayClient,
        clock: PublishClock,
        data_parallel: bool,
        max_lag: int | None = None,
    ) -> None:
        self._client, self._clock, self._data_parallel = client, clock, data_parallel
        self._max_lag = max_lag
        # (the call, its version, the weights it sends: asked again after a deadline)
        self._pending: tuple[Any, int, dict[str, torch.Tensor]] | None = None
        self._waited_mark = self._client_waited()

    def submit(self, module: nn.Module, version: int, steps: int) -> int:
        """Hand ``module``'s weights over as version ``version + 1`` after ``steps``
        gradient steps; returns that version (stored once its call is answered)."""
        self.wait()
        version += 1
        if not (self._data_parallel and distributed.rank() != 0):
            state = module_weights(module, copy=True)
            call = self._client.publish_weights_later(state, version, max_lag=self._max_lag)
            self._pending = (call, version, state)
        self._clock.published(version, steps)
        return version

    def now(self, module: nn.Module, version: int, steps: int) -> int:
        """Publish ``module``'s weights as version ``version + 1`` in this thread, after the
        one in flight, and wait until the rendezvous stores it; returns it."""
        self.wait()
        return publish_module(
            self._client, module, version, self._clock, steps, self._data_parallel, self._max_lag
        )

    def wait(self) -> None:
        """Wait for the publication in flight, if any; raise its error."""
        if self._pending is None:
            return
        call, version, state = self._pending
        self._pending = None
        try:
            stored = call.result()
        except DeadlineExceededError as e:
            if self._max_lag is None:
                raise
            logger.warning("the learner waits for the actors to catch up: %s", e)
            stored = _send(self._client, state, version, self._max_lag)
        if stored != version:
            raise MillpondError(
                f"the weights rendezvous stored version {stored} for version {version}"
            )

    def waited_s(self) -> float:
        """Seconds the publications waited at the rendezvous for the acting actors
        (``max_lag``) since the previous call, in the background or in :meth:`now`."""
        waited = self._client_waited()
        since, self._waited_mark = waited - self._waited_mark, waited
        return since

    def _client_waited(self) -> float:
        return float(getattr(self._client, "publish_wait_s", 0.0))

    def close(self) -> None:
        """Wait for the publication in flight (raising its error)."""
        self.wait()


class PublishesAhead:
    """What a learner whose steps publish through a :class:`PublishAhead` adds to them:
    :meth:`publish`, :meth:`flush`, :meth:`close` and the publication after a step.

    The learner sets ``version``, ``updates``, ``_publisher`` and ``_batches`` and names the
    module the actors run (:meth:`_acting_module`).
    """

    version: int
    updates: int
    _publisher: PublishAhead
    _batches: BatchSource

    def _acting_module(self) -> nn.Module:
        raise NotImplementedError

    def _publish_due(self, every: int, metrics: dict[str, Any]) -> None:
        """After a step: hand the weights over every ``every`` steps; sets ``published``
        (the version handed over, or ``None``) and ``publish_wait_s`` in ``metrics``."""
        metrics["published"] = None
        if self.updates % every == 0:
            self.version = self._publisher.submit(self._acting_module(), self.version, self.updates)
            metrics["published"] = self.version
        metrics["publish_wait_s"] = self._publisher.waited_s()

    def publish(self) -> int:
        """Publish the actors' module's weights as version :attr:`version` ``+ 1`` and wait
        until the rendezvous stores it (after the publication in flight); returns it.

        A step publishes every ``publish_every`` steps without waiting. Call this once
        before the actors start, so that they act with the learner's initial weights.
        Data-parallel ranks other than 0 take the next version without sending anything;
        with a ``max_policy_lag`` it waits for the actors as long as they take.
        """
        self.version = self._publisher.now(self._acting_module(), self.version, self.updates)
        return self.version

    def flush(self) -> None:
        """Wait until the last publication handed over is stored (raising its error)."""
        self._publisher.wait()

    def close(self) -> None:
        """Wait for the publication in flight and cancel prefetched sample requests."""
        try:
            self._publisher.close()
        finally:
            self._batches.close()


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
