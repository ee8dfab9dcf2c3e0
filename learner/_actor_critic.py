"""What the off-policy actor-critic learners for ``Box`` actions (SAC, TD3) share: a policy
the actors run, twin Q-networks with a Polyak-averaged target copy, one Adam over every
parameter group, and one step that samples, backpropagates the sum of the algorithm's
losses (their parameters are disjoint), updates, moves the targets and publishes.

**Prioritized replay** (Schaul et al. 2016; ``prioritized=True`` on a prioritized table):
the critic's squared TD errors are weighted by the batch's importance weights
``batch["weight"]`` (PER's correction of the bias of the TD update; the policy's and the
temperature's losses are not TD updates and stay unweighted), and after each step the
sampled transitions get the priority ``max_i |y - Q_i(s, a)| + priority_eps``: PER's
``|delta|``, with two critics the larger of their errors, as TorchRL's ``SACLoss`` and
``TD3Loss`` write their priorities (``max`` over the Q-networks): a transition that either
critic fits badly is replayed more (the mean would halve one critic's large error). They
go through :meth:`ReplayClient.update_priorities` with the batch's ``index``, so a slot
overwritten since it was sampled keeps its new step's priority; the table raises each
priority to its ``alpha``.

The step's fixed costs are kept off its work (``benchmarks/sac_learner.py`` measures it
against Stable-Baselines3's): the targets move in one fused ``lerp`` over all their
parameters, Adam is the fused kernel, the critic the policy's loss reads through is one
made once with its parameters detached (not re-parametrised per step), the step's
scalars leave the device in one transfer, and weights publish on a thread of their own
(:class:`~millpond.learner._common.PublishAhead`) while the next steps run.

Each algorithm names its config class (``config_type``) and gives
:meth:`ActorCriticLearner._setup` (what it holds beyond the shared networks),
:meth:`ActorCriticLearner.losses` (its losses on one batch, at the current parameters, as
TorchRL's loss modules compute them) and :meth:`ActorCriticLearner.update_targets` (which
target networks move after a step).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.box_actions import BoxScale
from millpond.checks import check_int, check_number
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner import distributed
from millpond.learner._common import (
    BatchSource,
    PublishAhead,
    PublishClock,
    PublishesAhead,
    adam,
    check_learner_args,
    published_version,
)
from millpond.learner.client import ReplayClient

__all__ = ["ActorCriticConfig", "ActorCriticLearner", "detached_view", "polyak_update"]

#: The losses a step backpropagates, those of them an algorithm's ``losses`` returns.
LOSS_KEYS = ("loss_critic", "loss_actor", "loss_alpha")


@dataclass(frozen=True)
class ActorCriticConfig:
    """The hyperparameters SAC and TD3 share (their configs add their own).

    Attributes:
        batch_size: transitions per gradient step.
        lr: Adam learning rate of every network (and SAC's temperature).
        sample_timeout_s: how long a step waits for a batch (the rate limiter may hold it
            back); ``None``: the client's timeout.
        gamma: discount factor.
        tau: Polyak weight of the online networks in each target update.
        publish_every: gradient steps between weight publications for the actors.
        observation_key: the batch key the networks read.
        prefetch: sample requests kept in flight while the learner updates
            (:meth:`ReplayClient.iterate`); ``0`` samples each batch when it is needed.
        prioritized: the table is prioritized: weight the critic's loss by the importance
            weights and send new priorities after every step (see the module docstring).
        priority_eps: added to ``|TD error|`` so that no transition gets priority zero.
    """

    batch_size: int = 256
    lr: float = 3e-4
    sample_timeout_s: float | None = None
    gamma: float = 0.99
    tau: float = 0.005
    publish_every: int = 10
    observation_key: str = "observation"
    prefetch: int = 0
    prioritized: bool = False
    priority_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("batch_size", "publish_every"):
            check_int(name, getattr(self, name), 1)
        check_int("prefetch", self.prefetch, 0)
        check_number("lr", self.lr, positive=True)
        check_number("gamma", self.gamma)
        check_number("tau", self.tau, positive=True)  # 0: the targets would never move
        for name in ("gamma", "tau"):
            if getattr(self, name) > 1:
                raise InvalidConfigError(f"{name} ({getattr(self, name)!r}) must be <= 1")
        if self.sample_timeout_s is not None:
            check_number("sample_timeout_s", self.sample_timeout_s)
        check_number("priority_eps", self.priority_eps)
        if not isinstance(self.prioritized, bool):
            raise InvalidConfigError(f"prioritized ({self.prioritized!r}) must be a bool")
        if not isinstance(self.observation_key, str) or not self.observation_key:
            raise InvalidConfigError(
                f"observation_key ({self.observation_key!r}) must be a non-empty string"
            )


@torch.no_grad()
def polyak_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """``theta' <- tau theta + (1 - tau) theta'`` for every parameter of ``target``."""
    targets, onlines = list(target.parameters()), list(online.parameters())
    if len(targets) != len(onlines):
        raise InvalidDataError(
            f"polyak_update: the target has {len(targets)} parameters, the online network "
            f"{len(onlines)}"
        )
    torch._foreach_lerp_(targets, onlines, tau)


def detached_view(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are ``module``'s own, detached: the
    same storage (an optimizer's in-place updates show in it), no gradient to them, while a
    gradient still flows to its inputs. ``torch.func.functional_call`` with detached
    parameters computes the same, re-parametrising the module on every call."""
    memo: dict[int, Any] = {id(p): p.detach() for p in module.parameters()}
    memo.update({id(b): b for b in module.buffers()})
    return copy.deepcopy(module, memo)


class ActorCriticLearner(PublishesAhead):
    """The shared body of :class:`~millpond.learner.sac.SACLearner` and
    :class:`~millpond.learner.td3.TD3Learner` (see the module docstring).

    Args:
        client: the replay client.
        table: a uniform table of transitions (prioritized with ``prioritized=True``).
        config: the algorithm's config (``batch_size``, ``lr``, ``publish_every``,
            ``observation_key``, ``sample_timeout_s``, ``prefetch`` among its fields).
        policy: the module the actors run.
        critic: ``(observations, actions in [-1, 1]) -> Q [2, B]``
            (:class:`~millpond.learner.box_networks.TwinQ`).
        action_space: the env's float ``Box`` action space (its bounds rescale actions).
        version: the last published weight version; ``None``: the server's (``-1`` if none).
        data_parallel: train as one rank of the initialised ``torch.distributed`` group
            (each rank samples its own batch, gradients are averaged, rank 0 publishes).

    Attributes:
        policy, critic: the online networks.
        target_critic: the critic's Polyak-averaged copy.
        box: the map between the env's action units and ``[-1, 1]``.
        optimizer: one Adam over the parameter groups (Adam is per parameter: the same as
            one optimizer each).
        updates: gradient steps taken.
        version: the last version published, or handed to publication by :meth:`step`.
    """

    #: The algorithm's config class.
    config_type: ClassVar[type] = object

    def __init__(
        self,
        client: ReplayClient,
        table: str,
        config: Any,
        policy: nn.Module,
        critic: nn.Module,
        action_space: Any,
        *,
        version: int | None = None,
        data_parallel: bool = False,
    ) -> None:
        check_learner_args(config, self.config_type, version, policy=policy, critic=critic)
        self.client = client
        self.table = table
        self.config = config
        self.policy = policy
        self.critic = critic
        params = list(policy.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.box = BoxScale(action_space, self.device)
        self.target_critic = copy.deepcopy(critic)
        self.target_critic.requires_grad_(False)
        self.updates = 0
        self.version = published_version(client) if version is None else version
        self._clock = PublishClock(self.version)
        self.data_parallel = data_parallel
        self._turn = distributed.BatchTurn(data_parallel, self.device)
        self._batches = BatchSource(
            client, table, config.batch_size, config.prefetch, config.sample_timeout_s
        )
        self._publisher = PublishAhead(client, self._clock, data_parallel)
        self._frozen_critic = detached_view(critic)
        groups = [self.policy.parameters(), self.critic.parameters(), *self._setup()]
        self.optimizer = adam([{"params": list(g)} for g in groups], self.device, lr=config.lr)

    def _setup(self) -> list[list[nn.Parameter]]:
        """Build what the algorithm holds beyond the policy, the critic and its target;
        the parameter groups it trains besides theirs."""
        return []

    # -- the update ----------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """Sample a batch, take one gradient step of the algorithm's losses, move its target
        networks, maybe publish.

        Returns metrics: ``loss`` (the critic's), the algorithm's other losses and scalars
        (:meth:`losses`), ``td_error`` (mean ``|y - Q_i(s, a)|`` over both Q's),
        ``q_value`` (mean ``Q_i(s, a)``), ``updates``, ``target_updated``, ``published``
        (the version handed to publication after this step, or ``None``: it is stored on
        a thread of its own while the next steps run, see :meth:`flush`),
        ``publish_wait_s`` (``0``: these publications wait for no actor), ``version``,
        ``sample_s`` / ``update_s``, ``priorities_applied`` (prioritized tables) and, when
        the batch records it, the policy lag (``policy_lag_mean`` / ``_max`` in versions,
        ``policy_lag_steps_mean`` / ``_max`` in gradient steps).
        """
        started = time.perf_counter()
        batch = self._turn.take(self._batches.next)
        sampled = time.perf_counter()
        metrics: dict[str, Any] = {}
        if "policy_version" in batch:
            metrics.update(
                self._clock.lag_metrics(batch["policy_version"], self.version, self.updates)
            )
        index = batch.get("index", None)
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        losses = self.losses(batch)
        self.optimizer.zero_grad()
        sum(losses[k] for k in LOSS_KEYS if k in losses).backward()
        if self.data_parallel:  # the same parameters have gradients on every rank
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            distributed.average_gradients([p for p in params if p.grad is not None], len(batch))
        self.optimizer.step()
        self.updates += 1
        if self.config.prioritized:
            metrics["priorities_applied"] = self.client.update_priorities(
                self.table, index, self.priorities(losses["td_error"])
            )
        metrics["target_updated"] = self.update_targets()
        self._publish_due(self.config.publish_every, metrics)
        # the scalars in one transfer: one device sync a step, not one each
        names = [k for k, v in losses.items() if v.ndim == 0]
        values = torch.stack(
            [losses[k].detach().float() for k in names]
            + [losses["td_error"].abs().mean(), losses["q_value"].mean()]
        ).tolist()
        for key, value in zip(names, values[: len(names)], strict=True):
            metrics["loss" if key == "loss_critic" else key] = value
        metrics.update(
            td_error=values[-2],
            q_value=values[-1],
            updates=self.updates,
            version=self.version,
        )
        metrics["sample_s"] = sampled - started
        metrics["update_s"] = time.perf_counter() - sampled
        return metrics

    def losses(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """The algorithm's losses of a batch of transitions ``[B]`` (with gradients, among
        :data:`LOSS_KEYS`) and detached diagnostics: ``td_error`` ``[2, B]`` and
        ``q_value`` ``[2, B]`` at least."""
        raise NotImplementedError

    def update_targets(self) -> bool:
        """Move the target networks after step :attr:`updates`; whether any moved."""
        raise NotImplementedError

    def priorities(self, td_error: torch.Tensor) -> torch.Tensor:
        """The new priority of each transition from the TD errors ``[2, B]`` of both
        critics: ``max_i |td_i| + priority_eps``, ``[B]`` on the CPU (module docstring)."""
        return td_error.detach().abs().max(0).values.cpu() + self.config.priority_eps

    def _critic_loss(self, td_error: torch.Tensor, batch: TensorDictBase) -> torch.Tensor:
        """``sum_i E[w (y - Q_i(s, a))^2]`` over the two critics, ``w`` the batch's
        importance weights on a prioritized table (else 1)."""
        squared = td_error.pow(2)
        if self.config.prioritized:
            squared = squared * batch["weight"].reshape(1, -1).to(squared.dtype)
        return squared.mean(-1).sum()

    def _transitions(self, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """``(observations, actions in [-1, 1] [B, dim])`` of a batch, refused unless it is
        transitions ``[B]``, with importance weights exactly when ``prioritized``."""
        if batch.ndim != 1:
            raise InvalidDataError(
                f"{type(self).__name__} trains on transitions [B]; the table returned "
                f"{list(batch.shape)} (use a uniform or prioritized table)"
            )
        if ("weight" in batch) != self.config.prioritized:
            raise InvalidDataError(
                f"table {self.table!r} returned importance weights; {type(self).__name__} "
                "with prioritized=False samples a uniform table"
                if self.config.prioritized is False
                else f"prioritized=True, but table {self.table!r} returned no importance "
                "weights: it needs a prioritized table"
            )
        action = batch["action"].reshape(batch.shape[0], self.box.dim)
        return batch[self.config.observation_key], self.box.to_unit(action)

    def _bootstrap(self, batch: TensorDictBase, next_value: torch.Tensor) -> torch.Tensor:
        """``r + gamma (1 - terminated) next_value``, ``[B]``: a truncation bootstraps."""
        reward = batch["next", "reward"].reshape(-1).to(next_value.dtype)
        alive = 1.0 - batch["next", "terminated"].reshape(-1).to(next_value.dtype)
        return reward + self.config.gamma * alive * next_value

    def _frozen_critic_q(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``Q [2, B]`` of the critic with its parameters detached: a policy's loss through
        it moves the policy only."""
        return self._frozen_critic(obs, action)

    def _acting_module(self) -> nn.Module:
        return self.policy
