"""A reference DQN learner on a uniform, prioritized, slices or prioritized slices table,
using only the public :class:`ReplayClient`.

Each :meth:`DQNLearner.step` is one gradient step of DQN (Mnih et al. 2015) on one sampled
batch, with the usual extensions as options:

- **n-step targets** (Sutton 1988; Rainbow): from a slices or prioritized slices table of
  ``slice_len >= n_step``, each row ``[K]`` is one episode's consecutive steps and the target of its first
  step is :func:`~millpond.learner.estimators.n_step_return` over the first ``n_step``
  columns, bootstrapping from the target network at the real next observation (zero after a
  termination; a truncation stops the sum early and bootstraps). Give the table
  ``strict_length=False``: then every stored step begins slices, the last ``n_step - 1``
  of an episode included (their slices are shorter, and the sum stops at the episode's
  end); with full slices only, the terminal transitions would never be trained directly. From a uniform or
  prioritized table each row is one transition and the target is the 1-step one
  (``n_step=1``)::

      y_t = sum_{k<m} gamma^k r_{t+k} + gamma^m (1 - terminated) max_a Q_target(s_{t+m}, a)

- **a target network**, copied from the online network every ``target_update_every``
  steps (a hard update), or moved towards it by ``target_tau`` after every step (a soft,
  Polyak update: ``theta' <- tau theta + (1 - tau) theta'``, as in DDPG and TorchRL's
  ``SoftUpdate``);
- **Double DQN** (van Hasselt et al. 2016): the online network chooses
  ``a* = argmax_a Q(s_{t+m}, a)``, the target network evaluates it;
- **the Huber loss** (or the squared error), weighted by the prioritized table's importance
  weights ``batch["weight"]`` when the batch carries them;
- **prioritized replay** (Schaul et al. 2016): after each step the sampled transitions get
  the priority ``|TD error| + priority_eps`` (``client.update_priorities``). ``alpha`` and
  ``beta`` live in the table's config. With n-step targets (Rainbow, Ape-X) the table is a
  prioritized slices table: a slice is drawn by the priority of its first step, the step
  whose n-step TD error the learner computes, and that step gets the new priority.

**Pacing.** The learner just samples. The update rate follows the stored experience through
the table's rate limiter: with ``TableConfig.uniform(..., samples_per_insert=R)`` (or
``prioritized``/``slices``/``prioritized_slices``) the server blocks a sample that would take the ratio of sampled
to inserted steps past ``R`` (within the error buffer) until actors insert more, and blocks
inserts when the learner falls behind. ``sample_timeout_s`` bounds the wait.

The Q-network maps the observation tensor to ``Q(s, ·)``, ``[..., n]`` for a
``Discrete(n)`` action space (start 0), e.g. :func:`millpond.learner.networks.mlp_q`. The
actors run the same factory (``"millpond.learner.networks:mlp_q"``) with
``deterministic=True`` (act by ``argmax Q``) and an :class:`~millpond.actors.EpsilonGreedy`
schedule; they pick up the weights published every ``publish_every`` steps.

**Acting lag and sample age.** A sampled step's ``policy_version`` says which weights acted
it; the learner's version minus it is the step's *sample age* (``sample_age_*`` metrics),
mostly the time it has spent in the replay ring: a uniform draw is on average half a ring
old. How far the actors' weights trail the learner's *when they act* is the acting lag,
measured by the actors (:mod:`millpond.actors.acting_lag`). ``max_policy_lag`` bounds the
acting lag, as PPO's bounds the lag of what it trains on: each publication waits at the
weights rendezvous until every env actor acting holds ``version - max_policy_lag`` or newer
(:meth:`ReplayClient.publish_weights` ``max_lag``). Dropping old rows, as PPO does, would
defeat replay; waiting on the actors bounds what they act on. An actor that is writing
(the rate limiter may hold it for the learner) holds nothing back: it fetches the newest
weights before it acts again.

**Publishing ahead.** A step hands its publication to a thread of its own
(:class:`~millpond.learner._common.PublishAhead`, as SAC's and TD3's) and goes on training:
sending the weights, and with ``max_policy_lag`` waiting for the actors, happens there. One
publication is in flight at a time: the next one waits for it, and so do :meth:`flush` (a
checkpoint names only stored versions), :meth:`publish` and :meth:`close`; a publication's
error is raised by the first of them. It keeps the bound: the rendezvous stores a
version only once the actors hold ``version - max_policy_lag`` or newer, so the acting lag
stays within it. While the actors hold a publication back the learner goes on for one more
``publish_every`` steps and then waits at the next hand-over: it runs at most one
publication (``publish_every`` gradient steps) further ahead of the actors than if it had
waited in the step, and its :attr:`~DQNLearner.version` (the one handed over) leads the
stored one by at most that publication.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.checks import check_int, check_number
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner import distributed
from millpond.learner._common import (
    BatchSource,
    PublishAhead,
    PublishClock,
    PublishesAhead,
    adam,
    published_version,
)
from millpond.learner.client import ReplayClient
from millpond.learner.estimators import n_step_return

__all__ = ["DQNConfig", "DQNLearner"]


@dataclass(frozen=True)
class DQNConfig:
    """Hyperparameters of :class:`DQNLearner`. Exploration (epsilon) is the actors' business.

    Attributes:
        batch_size: transitions (1-step) or slices (n-step) per gradient step.
        lr: Adam learning rate.
        gamma: discount factor.
        n_step: steps summed in the target. ``1`` for uniform and prioritized tables; more
            needs a slices (or, prioritized, a prioritized slices) table with ``slice_len >=
            n_step``.
        target_tau: ``None`` for hard target updates; else the weight of the online network
            in a soft update of the target network after every step (e.g. ``0.005``).
        target_update_every: gradient steps between hard copies of the online network into
            the target network.
        double_dqn: choose the bootstrap action with the online network (Double DQN).
        huber: the Huber (smooth L1) loss instead of the squared TD error.
        max_grad_norm: gradients are clipped to this global norm; ``None`` for no clipping.
        prioritized: the table is prioritized (``n_step=1``) or prioritized slices: use its
            importance weights and send new priorities after every step.
        priority_eps: added to ``|TD error|`` so that no transition gets priority zero.
        publish_every: gradient steps between weight publications for the actors.
        observation_key: the batch key the Q-network reads.
        sample_timeout_s: how long :meth:`DQNLearner.step` waits for a batch (the rate
            limiter may hold it back); ``None``: the client's timeout.
        prefetch: sample requests kept in flight while the learner updates
            (:meth:`ReplayClient.iterate`), hiding the round trip; ``0`` samples each batch
            when it is needed. Prefetched batches were drawn with the priorities of their
            time, as with any asynchronous prefetch (Reverb, Acme).
        max_policy_lag: the acting policy trails the learner by at most this many versions,
            as PPO's: every publication waits (on the publishing thread) until each env
            actor acting holds ``version - max_policy_lag`` or newer (bounded staleness; see
            "Acting lag" and "Publishing ahead" in the module docstring). Old replay is
            still sampled: off-policy learning reuses it by design. ``None``: no bound.
        metrics_every: gradient steps between the statistics a step reports (``loss``,
            ``td_error``, ``q_value`` and the sample age). Read off every step they cost
            a CartPole learner ~10% of its step on batches at hand and 5-8% in a launch
            (each a reduction and a read of its value), so a fast job reads them every few
            steps, as CleanRL logs its loss every 100. Their means over the steps that
            report them are a sample of every step's.
    """

    batch_size: int = 128
    lr: float = 2.5e-4
    gamma: float = 0.99
    n_step: int = 1
    target_update_every: int = 500
    target_tau: float | None = None
    double_dqn: bool = True
    huber: bool = True
    max_grad_norm: float | None = 10.0
    prioritized: bool = False
    priority_eps: float = 1e-6
    publish_every: int = 10
    observation_key: str = "observation"
    sample_timeout_s: float | None = None
    prefetch: int = 0
    max_policy_lag: int | None = None
    metrics_every: int = 1

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "n_step",
            "target_update_every",
            "publish_every",
            "metrics_every",
        ):
            check_int(name, getattr(self, name), 1)
        check_int("prefetch", self.prefetch, 0)
        if self.max_policy_lag is not None:
            # 0 would let the learner publish only while no actor acts at all
            check_int("max_policy_lag", self.max_policy_lag, 1)
        if self.target_tau is not None:
            check_number("target_tau", self.target_tau)
            if not 0 < self.target_tau <= 1:
                raise InvalidConfigError(f"target_tau ({self.target_tau!r}) must be in (0, 1]")
        check_number("lr", self.lr, positive=True)
        check_number("gamma", self.gamma)
        if not 0 <= self.gamma <= 1:
            raise InvalidConfigError(f"gamma ({self.gamma!r}) must be in [0, 1]")
        check_number("priority_eps", self.priority_eps)
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm, positive=True)
        if self.sample_timeout_s is not None:
            check_number("sample_timeout_s", self.sample_timeout_s)
        for name in ("double_dqn", "huber", "prioritized"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} ({getattr(self, name)!r}) must be a bool")
        if not isinstance(self.observation_key, str) or not self.observation_key:
            raise InvalidConfigError(
                f"observation_key ({self.observation_key!r}) must be a non-empty string"
            )


class DQNLearner(PublishesAhead):
    """DQN with a target network, n-step targets, Double DQN and prioritized replay.

    Implements :class:`millpond.roles.Learner`.

    Args:
        client: the replay client.
        table: a uniform or prioritized table (``n_step=1``), or a slices or prioritized
            slices table with ``slice_len >= n_step``.
        config: hyperparameters.
        q_network: the module the actors run: observations -> ``Q(s, ·)``, ``[..., n]``.
        version: the last published weight version; every publication takes the next
            one. ``None``: the version the server holds now (``-1`` if none), so a restarted
            learner goes on counting.
        data_parallel: train as one rank of the initialised ``torch.distributed`` group
            (:mod:`millpond.learner.distributed`): every rank samples its own batch, the
            ranks' gradients are averaged before each step (so a step trains on the ranks'
            batches together), each rank updates the priorities of what it sampled, and
            rank 0 alone publishes. The network should start equal on every rank.

    Attributes:
        q_network: the online network.
        target_network: its copy, refreshed every ``target_update_every`` steps.
        optimizer: Adam over the online network's parameters.
        updates: gradient steps taken.
        version: the last version published, or handed to publication by :meth:`step`
            (the sample age is counted from it).
    """

    def __init__(
        self,
        client: ReplayClient,
        table: str,
        config: DQNConfig,
        q_network: nn.Module,
        *,
        version: int | None = None,
        data_parallel: bool = False,
    ) -> None:
        if not isinstance(config, DQNConfig):
            raise InvalidConfigError(f"config must be a DQNConfig, received {config!r}")
        if not isinstance(q_network, nn.Module):
            raise InvalidConfigError("q_network must be a torch nn.Module")
        if version is not None:
            check_int("version", version, -1)
        self.client = client
        self.table = table
        self.config = config
        self.q_network = q_network
        self.target_network = copy.deepcopy(q_network)
        self.target_network.requires_grad_(False)
        params = list(q_network.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.optimizer = adam(params, self.device, lr=config.lr)
        self.updates = 0
        self._batches = BatchSource(
            client, table, config.batch_size, config.prefetch, config.sample_timeout_s
        )
        self.version = published_version(client) if version is None else version
        self._clock = PublishClock(self.version)
        self.data_parallel = data_parallel
        self._turn = distributed.BatchTurn(data_parallel, self.device)
        self._publisher = PublishAhead(client, self._clock, data_parallel, config.max_policy_lag)

    # -- the update ----------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """Sample a batch, take one gradient step, update priorities, maybe sync and publish
        (on a thread of its own).

        Returns metrics: ``loss``, ``td_error`` (mean ``|y - Q(s, a)|``), ``q_value`` (mean
        ``Q(s, a)``) on every ``metrics_every``-th step, ``updates``, ``target_updated``
        (the target network was refreshed
        after this step), ``published`` (the version handed to publication after this
        step, or ``None``: it is stored on a thread of its own while the next steps run,
        see :meth:`flush`), ``publish_wait_s`` (seconds the publications waited at the
        rendezvous for the actors, ``max_policy_lag``, since the previous step: on the
        publishing thread, the learner's time only when the next hand-over waits for
        it), ``version``, ``priorities_applied`` (prioritized tables) and,
        when the batch records it (every ``metrics_every``-th step), its sample age:
        ``sample_age_mean`` / ``sample_age_max``
        (versions the steps' acting policy is behind the learner's) and
        ``sample_age_steps_mean`` / ``sample_age_steps_max`` (gradient steps taken since
        the acting version was published). Of a replay ring, that is mostly the age of the
        stored steps, not the actors' acting lag (see the module docstring).
        """
        c = self.config
        started = time.perf_counter()
        batch = self._turn.take(self._batches.next)
        sampled = time.perf_counter()
        if c.prioritized and "weight" not in batch:
            raise InvalidDataError(
                f"prioritized=True, but table {self.table!r} returned no importance weights: "
                "it needs a prioritized table (n_step=1) or a prioritized_slices table"
            )
        metrics: dict[str, Any] = {}
        # counted from the step this one takes, as updates is after it
        reports = (self.updates + 1) % c.metrics_every == 0
        if reports and "policy_version" in batch:
            acted = batch["policy_version"]
            metrics.update(self._clock.lag_metrics(acted, self.version, self.updates, "sample_age"))
        index = batch["index"] if batch.ndim == 1 else batch["index"][:, 0]
        if self.device.type != "cpu":  # samples arrive on the CPU; moving them there costs
            batch = batch.to(self.device)
        loss, td_error, q_value = self.loss(batch)
        self.optimizer.zero_grad()
        loss.backward()
        if self.data_parallel:
            distributed.average_gradients(self.q_network.parameters(), batch.shape[0])
        if c.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.q_network.parameters(), c.max_grad_norm)
        self.optimizer.step()
        self.updates += 1
        if c.prioritized:
            priorities = td_error.detach().abs().cpu() + c.priority_eps
            metrics["priorities_applied"] = self.client.update_priorities(
                self.table, index, priorities
            )
        if c.target_tau is not None:
            self.update_target(c.target_tau)
            metrics["target_updated"] = True
        else:
            metrics["target_updated"] = self.updates % c.target_update_every == 0
            if metrics["target_updated"]:
                self.update_target()
        self._publish_due(c.publish_every, metrics)
        if reports:
            metrics.update(
                loss=float(loss.detach()),
                td_error=float(td_error.detach().abs().mean()),
                q_value=float(q_value.detach().mean()),
            )
        metrics.update(updates=self.updates, version=self.version)
        metrics["sample_s"] = sampled - started
        metrics["update_s"] = time.perf_counter() - sampled
        return metrics

    def loss(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, td_error, Q(s, a))`` of a sampled batch, ``[B]`` transitions or ``[B, K]``
        slices (the first step of each row is trained, with the n-step target)."""
        y = self.target(batch)
        first = batch if batch.ndim == 1 else batch[:, 0]
        q = _q_values(self.q_network(first[self.config.observation_key]))
        action = first["action"].reshape(-1, 1).long()
        q_value = q.gather(-1, action).squeeze(-1)
        td_error = y - q_value
        weight = first.get("weight", None)
        if weight is None:
            # The mean taken by the loss's own op: fewer nodes in the graph (two, not four),
            # each of which costs a small network more than its arithmetic
            if self.config.huber:
                return nn.functional.smooth_l1_loss(q_value, y), td_error, q_value
            return 0.5 * nn.functional.mse_loss(q_value, y), td_error, q_value
        if self.config.huber:
            elementwise = nn.functional.smooth_l1_loss(q_value, y, reduction="none")
        else:
            elementwise = 0.5 * td_error**2
        return (elementwise * weight.reshape(-1).to(elementwise.dtype)).mean(), td_error, q_value

    @torch.no_grad()
    def target(self, batch: TensorDictBase) -> torch.Tensor:
        """The TD target ``y`` of each row's first step, ``[B]`` (see the module docstring)."""
        c = self.config
        if batch.ndim == 1:
            if c.n_step > 1:
                raise InvalidDataError(
                    f"n_step={c.n_step} needs slices [B, K] with K >= n_step; the table "
                    "returned single transitions [B] (use a slices table, or n_step=1)"
                )
            # One transition per row: n_step_return with m = 1, written out (the general
            # form's bookkeeping costs more than the update's arithmetic on small networks).
            after = batch.get("next")  # once: a nested key's lookup costs twice a plain one's
            next_value = self._next_value(after.get(c.observation_key))
            reward = after.get("reward").reshape(-1).to(next_value.dtype)
            alive = 1.0 - after.get("terminated").reshape(-1).to(next_value.dtype)
            return reward + (c.gamma * alive) * next_value
        elif batch.ndim == 2:
            if batch.shape[1] < c.n_step:
                raise InvalidDataError(
                    f"slices of {batch.shape[1]} steps are shorter than n_step ({c.n_step})"
                )
            batch = batch[:, : c.n_step]
        else:
            raise InvalidDataError(f"expected a batch [B] or [B, K], received {batch.shape}")
        next_value = self._next_value(batch["next", c.observation_key])
        shape = next_value.shape  # [B, n]
        G, _ = n_step_return(
            batch["next", "reward"].reshape(shape).to(next_value.dtype),
            next_value,
            batch["next", "terminated"].reshape(shape),
            batch["next", "truncated"].reshape(shape),
            c.gamma,
            batch.shape[1],
        )
        return G[:, 0]

    def _next_value(self, next_obs: torch.Tensor) -> torch.Tensor:
        """The target network's value of each next observation: ``max_a Q'(s', a)``, or
        with Double DQN ``Q'(s', argmax_a Q(s', a))``."""
        next_q_target = _q_values(self.target_network(next_obs))
        if self.config.double_dqn:
            best = _q_values(self.q_network(next_obs)).argmax(-1, keepdim=True)
            return next_q_target.gather(-1, best).squeeze(-1)
        return next_q_target.max(-1).values

    # -- networks ------------------------------------------------------------------------
    @torch.no_grad()
    def update_target(self, tau: float = 1.0) -> None:
        """Move the target network's weights towards the online network's by ``tau``
        (``1``: copy them)."""
        if tau == 1.0:
            self.target_network.load_state_dict(self.q_network.state_dict())
            return
        for target, online in zip(
            self.target_network.parameters(), self.q_network.parameters(), strict=True
        ):
            target.lerp_(online, tau)

    def _acting_module(self) -> nn.Module:
        return self.q_network


def _q_values(out: Any) -> torch.Tensor:
    """The action values of a network's output: a tensor, or a mapping with ``"logits"``
    or ``"action_value"`` (the actors read Q-values as logits)."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("action_value", "logits"):
        try:
            return out[key]
        except (KeyError, TypeError, IndexError):
            continue
    raise InvalidDataError(
        f"the Q-network returned {type(out).__name__}; DQN needs Q-values (a tensor, or a "
        "mapping with 'action_value' or 'logits')"
    )
