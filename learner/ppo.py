"""A reference PPO learner on a queue table, using only the public :class:`ReplayClient`.

Each :meth:`PPOLearner.step` is one PPO iteration (Schulman et al. 2017, Algorithm 1):

1. take one batch of steps from the queue (each step is delivered once, whole segments in
   order, see :meth:`ReplayClient.sample`);
2. drop the steps that a too old policy acted (``policy_version`` more than
   ``max_policy_lag`` versions behind the learner), and report the lag;
3. compute advantages with GAE (:func:`~millpond.learner.estimators.gae_from_batch`: the
   critic on every observation and on the real next observation where a trajectory stops,
   so truncations and chunk cuts bootstrap correctly);
4. run ``epochs`` passes of minibatch updates of the clipped surrogate objective, with an
   entropy bonus and a value loss;
5. bump the weight version and publish the policy's weights for the actors.

The probability ratio is taken against the ``sample_log_prob`` the actor recorded, the
behaviour policy's own log-probability: steps acted by a slightly older version are
corrected by the ratio (and its clipping) exactly as PPO's epochs correct for their own
drift; ``max_policy_lag`` bounds how far that is trusted.

The policy is the module actors run (e.g. :func:`millpond.learner.networks.mlp_policy`
under the factory name ``"millpond.learner.networks:mlp_policy"``): it maps the observation
tensor to logits over a ``Discrete(n)`` action space (start 0), returning a tensor or a
mapping with ``"logits"``; or, on a ``Box`` action space, to the ``"mean"`` and ``"std"``
of an unsquashed diagonal Gaussian (:class:`~millpond.learner.networks.GaussianPolicy`,
CleanRL's continuous PPO). The actors then clip each draw to the bounds for the env and
record the draw itself as ``"unclipped_action"``: the ratio is taken between the densities
of that draw (:func:`~millpond.box_actions.gaussian_log_prob`, the function the actors
recorded ``"sample_log_prob"`` with), the clipping counted as part of the env, as CleanRL's
``ClipAction`` wrapper does. The critic maps observations to ``V(s)``, ``[..., 1]``.

**Observation normalisation** (``normalize_observations``, CleanRL's continuous PPO uses
gymnasium's ``NormalizeObservation``): the policy and the critic read observations through
one :class:`~millpond.learner.obs_norm.RunningMeanStd` that the policy carries (its
``normalizer``: ``mlp_policy(..., normalize_observations=True)``, the critic wrapped in
:class:`~millpond.learner.obs_norm.ObservationNormalized` around the same one). Each
iteration merges the observations of every delivered step into it before GAE and the
updates; its statistics travel with the published weights, so each actor normalises with
those of the version it acts with. A step acted under older statistics is corrected by the
ratio like any other change of the policy. The replay keeps raw observations.

Data-parallel: with ``data_parallel=True`` in an initialised ``torch.distributed`` group
(:mod:`millpond.learner.distributed`), every rank runs this learner on batches of its own
from the same queue; each minibatch step averages the ranks' gradients weighted by their
rows, every rank takes the same number of minibatch steps (the most any rank's batch
needs; smaller batches are split into as many smaller parts), and rank 0 alone publishes.
Advantages are standardised per rank.

A minimal loop::

    client = ReplayClient("127.0.0.1:50051")
    client.create_table(TableConfig.queue("rollouts", capacity=100_000))
    learner = PPOLearner(client, "rollouts", PPOConfig(), mlp_policy(obs_space, act_space),
                         mlp_critic(obs_space))
    learner.publish()  # actors act with the learner's initial weights from their next sync
    while True:
        print(learner.step())
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.box_actions import gaussian_entropy, gaussian_log_prob
from millpond.checks import check_int, check_number
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner import distributed
from millpond.learner._common import PublishClock, adam, publish_module, published_version
from millpond.learner.client import ReplayClient
from millpond.learner.estimators import gae_from_batch
from millpond.learner.obs_norm import RunningMeanStd

__all__ = ["PPOConfig", "PPOLearner"]


@dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters of :class:`PPOLearner` (defaults: CleanRL's ``ppo.py`` for CartPole).

    Attributes:
        batch_size: steps asked of the queue per iteration. The queue delivers whole
            segments, so a batch holds at most this many (and waits until it can).
        epochs: passes over the batch per iteration (``K`` in the paper).
        minibatch_size: steps per gradient step.
        lr: Adam learning rate.
        gamma: discount factor.
        lmbda: GAE's lambda.
        clip_eps: the clipping range epsilon of the surrogate objective.
        entropy_coef: weight of the entropy bonus (``c_2``).
        value_coef: weight of the value loss (``c_1``).
        max_grad_norm: gradients are clipped to this global norm; ``None`` for no clipping.
        normalize_advantage: standardise the advantages of each batch.
        max_policy_lag: steps whose ``policy_version`` is older than the learner's version
            minus this are dropped; ``None`` keeps every step.
        observation_key: the batch key the policy and the critic read.
        sample_timeout_s: how long :meth:`PPOLearner.step` waits for a batch; ``None``: the
            client's timeout.
        normalize_observations: update the running observation statistics the policy
            carries (``policy.normalizer``, shared by the critic) from every batch (see the
            module docstring).
    """

    batch_size: int = 512
    epochs: int = 4
    minibatch_size: int = 128
    lr: float = 2.5e-4
    gamma: float = 0.99
    lmbda: float = 0.95
    clip_eps: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float | None = 0.5
    normalize_advantage: bool = True
    max_policy_lag: int | None = 4
    observation_key: str = "observation"
    sample_timeout_s: float | None = None
    normalize_observations: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "minibatch_size"):
            check_int(name, getattr(self, name), 1)
        if self.max_policy_lag is not None:
            check_int("max_policy_lag", self.max_policy_lag, 0)
        check_number("lr", self.lr, positive=True)
        for name in ("gamma", "lmbda"):
            value = getattr(self, name)
            check_number(name, value)
            if not 0 <= value <= 1:
                raise InvalidConfigError(f"{name} ({value!r}) must be in [0, 1]")
        check_number("clip_eps", self.clip_eps, positive=True)
        for name in ("entropy_coef", "value_coef"):
            check_number(name, getattr(self, name))
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm, positive=True)
        if self.sample_timeout_s is not None:
            check_number("sample_timeout_s", self.sample_timeout_s)
        if not isinstance(self.normalize_observations, bool):
            raise InvalidConfigError(
                f"normalize_observations ({self.normalize_observations!r}) must be a bool"
            )
        if not isinstance(self.observation_key, str) or not self.observation_key:
            raise InvalidConfigError(
                f"observation_key ({self.observation_key!r}) must be a non-empty string"
            )


class PPOLearner:
    """Clipped-surrogate PPO over a queue table (see the module docstring).

    Implements :class:`millpond.roles.Learner`.

    Args:
        client: the replay client.
        table: a queue table the actors write into.
        config: hyperparameters.
        policy: the module the actors run: observations -> logits ``[..., n]``, or a
            Gaussian's ``"mean"`` and ``"std"`` on ``Box`` actions.
        critic: observations -> ``V(s)``, ``[..., 1]``.
        version: the last published weight version; every publication takes the next
            one. ``None``: the version the server holds now (``-1`` if none), so a restarted
            learner goes on counting.
        data_parallel: train as one rank of the initialised ``torch.distributed`` group
            (see the module docstring); the modules should start equal on every rank.

    Attributes:
        version: the last published version: the learner's policy, as far as actors know it.
        optimizer: Adam over the policy's and the critic's parameters (each once, when they
            share a torso).
        updates: minibatch gradient steps taken.
        normalizer: the policy's :class:`~millpond.learner.obs_norm.RunningMeanStd` with
            ``normalize_observations``, else ``None``.
    """

    def __init__(
        self,
        client: ReplayClient,
        table: str,
        config: PPOConfig,
        policy: nn.Module,
        critic: nn.Module,
        *,
        version: int | None = None,
        data_parallel: bool = False,
    ) -> None:
        if not isinstance(config, PPOConfig):
            raise InvalidConfigError(f"config must be a PPOConfig, received {config!r}")
        if not isinstance(policy, nn.Module) or not isinstance(critic, nn.Module):
            raise InvalidConfigError("policy and critic must be torch nn.Modules")
        if version is not None:
            check_int("version", version, -1)
        self.client = client
        self.table = table
        self.config = config
        self.policy = policy
        self.critic = critic
        self.version = published_version(client) if version is None else version
        self.updates = 0
        self._clock = PublishClock(self.version)
        # A torso shared by the policy and the critic (the Nature CNN's) is optimised once.
        params = list({id(p): p for p in [*policy.parameters(), *critic.parameters()]}.values())
        self.device = params[0].device if params else torch.device("cpu")
        self.optimizer = adam(params, self.device, lr=config.lr, eps=1e-5)
        self.data_parallel = data_parallel
        self._turn = distributed.BatchTurn(data_parallel, self.device)
        self.normalizer = (
            _shared_normalizer(policy, critic) if config.normalize_observations else None
        )

    # -- the iteration -------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One PPO iteration: sample, drop stale steps, GAE, ``epochs`` of updates, publish.

        Returns metrics: ``sampled`` (steps delivered), ``steps`` (kept and trained on),
        ``dropped``, ``policy_lag_mean`` / ``policy_lag_max`` (learner version minus the
        steps' ``policy_version``, over the delivered steps), ``policy_lag_steps_mean`` /
        ``policy_lag_steps_max`` (the same lag in minibatch gradient steps), the means over the update's
        minibatches of ``loss_policy`` (the clipped surrogate, to minimise), ``loss_value``,
        ``entropy``, ``approx_kl`` and ``clip_fraction``, and ``version`` (the published
        one), ``sample_s`` (seconds waiting for the batch) and ``update_s`` (the rest). When
        every step was dropped nothing is trained or published.
        """
        c = self.config
        started = time.perf_counter()
        batch = self._turn.take(
            lambda: self.client.sample(self.table, c.batch_size, timeout_s=c.sample_timeout_s)
        )
        sampled = time.perf_counter()
        if self.normalizer is not None:  # every delivered step's observation, stale or not
            self.normalizer.update(batch[c.observation_key], self.data_parallel)
        batch, metrics = self.drop_stale(batch)
        metrics["sample_s"] = sampled - started
        rows = batch.shape[0] > 0
        if not (distributed.any_true(rows, self.device) if self.data_parallel else rows):
            metrics.update(version=self.version, update_s=0.0)
            return metrics
        batch = batch.to(self.device)
        if not rows:  # another rank has rows: this one takes part with empty minibatches
            metrics.update(self.update(batch))
            metrics["version"] = self.publish()
            metrics["update_s"] = time.perf_counter() - sampled
            return metrics
        advantage, _ = gae_from_batch(
            batch, self.critic, c.gamma, c.lmbda, obs_key=c.observation_key
        )
        if c.normalize_advantage and advantage.numel() > 1:
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        batch.set("advantage", advantage)
        metrics.update(self.update(batch))
        metrics["version"] = self.publish()
        metrics["update_s"] = time.perf_counter() - sampled
        return metrics

    def drop_stale(self, batch: TensorDictBase) -> tuple[TensorDictBase, dict[str, Any]]:
        """``batch`` without the steps older than ``max_policy_lag`` versions, and the lag.

        Dropping rows is safe for GAE: a kept step whose successor was dropped ends its
        trajectory there and bootstraps from its own ``("next", obs)``.
        """
        n = batch.shape[0]
        metrics: dict[str, Any] = {"sampled": n}
        if "policy_version" not in batch:
            raise InvalidDataError(
                "the batch has no 'policy_version': write it with millpond's actors, or record "
                "the version of the policy that acted"
            )
        acted = batch["policy_version"].reshape(n)
        if n:
            metrics.update(self._clock.lag_metrics(acted, self.version, self.updates))
        else:
            metrics.update(dict.fromkeys(("policy_lag_mean", "policy_lag_steps_mean"), 0.0))
            metrics.update(dict.fromkeys(("policy_lag_max", "policy_lag_steps_max"), 0))
        if self.config.max_policy_lag is not None:
            batch = batch[self.version - acted <= self.config.max_policy_lag]
        metrics["steps"] = batch.shape[0]
        metrics["dropped"] = n - batch.shape[0]
        return batch, metrics

    def update(self, batch: TensorDictBase) -> dict[str, float]:
        """``epochs`` passes of shuffled minibatch updates on a batch holding ``"advantage"``
        and ``"value_target"``; returns the mean of each loss term over the minibatches."""
        c = self.config
        n = batch.shape[0]
        if self.data_parallel:
            return self._update_data_parallel(batch)
        columns = self._columns(batch)  # plain tensors: indexing them is cheap
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        sums: list[torch.Tensor] = []
        for _ in range(c.epochs):
            order = torch.randperm(n, device=batch.device)
            for start in range(0, n, c.minibatch_size):
                rows = order[start : start + c.minibatch_size]
                losses = self._loss(*(column[rows] for column in columns))
                self.optimizer.zero_grad(set_to_none=True)
                losses["loss"].backward()
                if c.max_grad_norm is not None:
                    nn.utils.clip_grad_norm_(params, c.max_grad_norm, foreach=True)
                self.optimizer.step()
                self.updates += 1
                sums.append(torch.stack([v.detach() for v in losses.values()]))
        # One host sync for the whole update, not one per term and minibatch.
        means = torch.stack(sums).mean(0).tolist()
        return dict(zip(_LOSS_TERMS, means))

    def _update_data_parallel(self, batch: TensorDictBase) -> dict[str, float]:
        c = self.config
        n = batch.shape[0]
        parts = int(distributed.global_max(-(-n // c.minibatch_size), self.device))
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        columns = self._columns(batch)
        totals: dict[str, float] = {}
        count = 0
        for _ in range(c.epochs):
            order = torch.randperm(n, device=batch.device)
            for rows in torch.tensor_split(order, parts):
                self.optimizer.zero_grad()
                if rows.numel():
                    losses = self._loss(*(column[rows] for column in columns))
                    losses["loss"].backward()
                    for name, value in losses.items():
                        totals[name] = totals.get(name, 0.0) + float(value.detach())
                    count += 1
                distributed.average_gradients(params, rows.numel())
                if c.max_grad_norm is not None:
                    nn.utils.clip_grad_norm_(params, c.max_grad_norm)
                self.optimizer.step()
        return {name: total / count for name, total in totals.items()} if count else {}

    def loss(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """PPO's loss terms on ``batch`` (``"advantage"``, ``"value_target"``,
        ``"sample_log_prob"``, the action and the observation)::

            ratio_t   = pi_theta(a_t | s_t) / pi_old(a_t | s_t)
            L^CLIP    = E[min(ratio_t A_t, clip(ratio_t, 1 - eps, 1 + eps) A_t)]
            L^VF      = E[(V(s_t) - V^targ_t)^2] / 2
            loss      = -L^CLIP + c_1 L^VF - c_2 E[entropy]

        Returns ``loss``, ``loss_policy`` (``-L^CLIP``), ``loss_value``, ``entropy``,
        ``approx_kl`` (``E[(ratio - 1) - log ratio]``) and ``clip_fraction``.
        """
        return self._loss(*self._columns(batch))

    def _columns(self, batch: TensorDictBase) -> tuple[torch.Tensor, ...]:
        """What :meth:`_loss` reads of ``batch``, one tensor each, a row per step: the
        action is the Gaussian's draw ``[n, d]`` where the actors recorded one, else the
        categorical index ``[n]``."""
        n = batch.shape[0]
        if "unclipped_action" in batch:
            action = batch["unclipped_action"].reshape(n, -1).float()
        else:
            action = batch["action"].reshape(-1).long()
        return (
            batch[self.config.observation_key],
            action,
            batch["sample_log_prob"].reshape(-1),
            batch["advantage"].reshape(-1),
            batch["value_target"].reshape(-1),
        )

    def _loss(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantage: torch.Tensor,
        value_target: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        c = self.config
        new_log_prob, entropy = _log_prob_entropy(self.policy(obs), action)
        log_ratio = new_log_prob - old_log_prob
        ratio = log_ratio.exp()
        pg_loss1 = -advantage * ratio
        pg_loss2 = -advantage * torch.clamp(ratio, 1 - c.clip_eps, 1 + c.clip_eps)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        value = self.critic(obs).reshape(-1)
        v_loss = 0.5 * ((value - value_target) ** 2).mean()
        entropy = entropy.mean()
        loss = pg_loss - c.entropy_coef * entropy + c.value_coef * v_loss
        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean()
            clip_fraction = ((ratio - 1).abs() > c.clip_eps).float().mean()
        return {
            "loss": loss,
            "loss_policy": pg_loss,
            "loss_value": v_loss,
            "entropy": entropy,
            "approx_kl": approx_kl,
            "clip_fraction": clip_fraction,
        }

    # -- weights -------------------------------------------------------------------------
    def publish(self) -> int:
        """Publish the policy's weights as version :attr:`version` ``+ 1``; returns it.

        :meth:`step` calls it after every update. Call it once before the actors start, so
        that they act with the learner's initial weights. Data-parallel ranks other than 0
        take the next version without sending anything.
        """
        # In the step, not on a thread of its own as the off-policy learners publish: the
        # next batch is what the actors act after this publication, so it is the iteration's
        # critical path. With max_policy_lag 0 the next iteration can train on nothing
        # before the actors hold it, so sending it ahead hides nothing; with a larger bound,
        # a publication stored later leaves them acting longer with the previous version,
        # and the next batch holds more steps a version old (more off-policy, or dropped).
        # One publication per iteration of epochs x minibatches is a small share of it.
        self.version = publish_module(
            self.client, self.policy, self.version, self._clock, self.updates, self.data_parallel
        )
        return self.version


def _shared_normalizer(policy: nn.Module, critic: nn.Module) -> RunningMeanStd:
    """The :class:`RunningMeanStd` the policy carries and the critic reads through too."""
    normalizer = getattr(policy, "normalizer", None)
    if not isinstance(normalizer, RunningMeanStd) or getattr(critic, "normalizer", None) is not (
        normalizer
    ):
        raise InvalidConfigError(
            "normalize_observations: the policy must carry a RunningMeanStd as its "
            "'normalizer' (mlp_policy(..., normalize_observations=True)) and the critic read "
            "through the same one (ObservationNormalized(critic, policy.normalizer))"
        )
    return normalizer


#: The loss terms :meth:`PPOLearner.loss` returns, in its order.
_LOSS_TERMS = ("loss", "loss_policy", "loss_value", "entropy", "approx_kl", "clip_fraction")


def _log_prob_entropy(out: Any, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each row's action and the entropy, ``[n]`` each, under the
    policy's output: a Gaussian (``"mean"``, ``"std"``) on the recorded draws ``[n, d]``,
    else a categorical on the logits and the action indices ``[n]``."""
    gaussian = isinstance(out, Mapping | TensorDictBase) and out.get("mean") is not None
    if gaussian != action.is_floating_point():
        raise InvalidDataError(
            "the policy returns a Gaussian ('mean', 'std') and the batch has no "
            "'unclipped_action' (record it with millpond's actors)"
            if gaussian
            else "the batch holds Gaussian draws ('unclipped_action'), and the policy returns "
            "logits: PPO on Box actions needs a Gaussian policy (networks.mlp_policy)"
        )
    if gaussian:
        mean = out["mean"].reshape(action.shape)
        std = out["std"].reshape(action.shape)
        return gaussian_log_prob(mean, std, action), gaussian_entropy(std)
    dist = torch.distributions.Categorical(logits=_logits(out))
    return dist.log_prob(action), dist.entropy()


def _logits(out: Any) -> torch.Tensor:
    """The logits of a policy's output: a tensor, or a mapping holding ``"logits"``."""
    if isinstance(out, torch.Tensor):
        return out
    try:
        return out["logits"]
    except (KeyError, TypeError, IndexError):
        raise InvalidDataError(
            f"the policy returned {type(out).__name__}; PPO needs logits (a tensor, or a "
            "mapping with 'logits')"
        ) from None
