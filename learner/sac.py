"""A reference SAC learner on a uniform or prioritized table, using only the public
:class:`ReplayClient`.

Each :meth:`SACLearner.step` is one gradient step of Soft Actor-Critic (Haarnoja et al.
2018, "Soft Actor-Critic Algorithms and Applications": two Q-functions, no value network,
a learned temperature) on one sampled batch of transitions ``(s, a, r, s', terminated)``:

- **the critic**: twin Q-networks ``Q_1, Q_2`` regress onto the soft TD target, the
  next action drawn from the current policy and valued by the *target* networks::

      a' ~ pi(. | s'),   y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a' | s'))
      J_Q = sum_i 1/2 E[(Q_i(s, a) - y)^2]                       (the paper's eq. 5, per Q)

  (a truncation bootstraps: only ``terminated`` ends the return; on a prioritized table
  the expectation is weighted by the importance weights and the sampled transitions get
  new priorities, :mod:`millpond.learner._actor_critic`);
- **the policy**: a tanh-squashed Gaussian (:mod:`millpond.box_actions`), its action drawn
  by the reparameterisation ``a = tanh(loc + scale * noise)`` so that the gradient flows
  through the critic (the critic's parameters are held fixed for this term)::

      J_pi = E[alpha log pi(a | s) - min_i Q_i(s, a)]            (eq. 12 with eq. 21's log pi)

- **the temperature** (automatic entropy tuning, section 5), learned as ``log alpha`` (as
  the authors' code, Stable-Baselines3 and TorchRL do) towards the target entropy
  ``H = -dim(A)``::

      J(alpha) = E[-log alpha (log pi(a | s) + H)]               (eq. 18)

- **target networks**: ``theta' <- tau theta + (1 - tau) theta'`` after every
  ``target_update_every`` steps (Polyak averaging).

The three losses are taken at the same parameters (one backward pass: their parameters
are disjoint) and one Adam over their parameter groups steps them, as TorchRL's ``SACLoss`` is
used. Actions are stored as the env took them (its units); the learner maps them to
``[-1, 1]`` (:class:`~millpond.box_actions.BoxScale`), where the critic reads them and where
``log pi`` is a density.

**Pacing.** As for :class:`~millpond.learner.DQNLearner`: the learner just samples, and the
table's ``samples_per_insert`` sets the update-to-data ratio (``batch_size`` per frame:
one gradient step per env step, Stable-Baselines3's ``train_freq=1, gradient_steps=1``).

The actors run ``"millpond.learner.box_networks:mlp_sac_actor"`` (the same policy network),
sampling the squashed Gaussian while they collect (``deterministic=True`` acts its mode,
for evaluation), and pick up the weights published every ``publish_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.box_actions import squashed_gaussian
from millpond.checks import check_int, check_number
from millpond.errors import InvalidConfigError
from millpond.learner._actor_critic import ActorCriticConfig, ActorCriticLearner, polyak_update

__all__ = ["SACConfig", "SACLearner", "Temperature", "polyak_update"]


@dataclass(frozen=True)
class SACConfig(ActorCriticConfig):
    """Hyperparameters of :class:`SACLearner` (defaults: Stable-Baselines3's SAC): the
    fields of :class:`~millpond.learner._actor_critic.ActorCriticConfig` and

    Attributes:
        alpha_init: the temperature at the start (Stable-Baselines3: 1.0).
        autotune_alpha: learn the temperature towards ``target_entropy``; ``False`` keeps
            ``alpha_init``.
        target_entropy: the entropy the temperature aims at; ``None``: ``-dim(A)``.
        target_update_every: gradient steps between target updates.
    """

    alpha_init: float = 1.0
    autotune_alpha: bool = True
    target_entropy: float | None = None
    target_update_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("target_update_every", self.target_update_every, 1)
        check_number("alpha_init", self.alpha_init, positive=True)
        if self.target_entropy is not None and (
            isinstance(self.target_entropy, bool)
            or not isinstance(self.target_entropy, int | float)
        ):
            raise InvalidConfigError(f"target_entropy ({self.target_entropy!r}) must be a number")
        if not isinstance(self.autotune_alpha, bool):
            raise InvalidConfigError(f"autotune_alpha ({self.autotune_alpha!r}) must be a bool")


class Temperature(nn.Module):
    """SAC's temperature ``alpha``, held as ``log_alpha`` (a parameter when learned)."""

    def __init__(self, alpha: float, learned: bool = True) -> None:
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(float(alpha)).log(), requires_grad=learned)

    @property
    def alpha(self) -> torch.Tensor:
        """``exp(log_alpha)``, detached (the policy and critic losses treat it as given)."""
        return self.log_alpha.detach().exp()


class SACLearner(ActorCriticLearner):
    """SAC with twin Q-networks, target networks and automatic entropy tuning.

    Implements :class:`millpond.roles.Learner`; takes the arguments of
    :class:`~millpond.learner._actor_critic.ActorCriticLearner`, its ``policy`` mapping
    observations to ``{"loc", "scale"}`` (:func:`~millpond.learner.box_networks.mlp_sac_actor`).

    Attributes:
        temperature: the :class:`Temperature`.
        target_entropy: the entropy the temperature aims at.
        optimizer: one Adam over the policy's, the critic's and (when learned) the
            temperature's parameters.

    The other attributes are :class:`~millpond.learner._actor_critic.ActorCriticLearner`'s
    (``policy``, ``critic``, ``target_critic``, ``updates``, ``version``...).
    """

    config_type = SACConfig

    def _setup(self) -> list[list[nn.Parameter]]:
        config = self.config
        self.temperature = Temperature(config.alpha_init, config.autotune_alpha).to(self.device)
        self.target_entropy = (
            float(-self.box.dim) if config.target_entropy is None else float(config.target_entropy)
        )
        return [[self.temperature.log_alpha]] if config.autotune_alpha else []

    def losses(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """The three losses of a batch of transitions ``[B]``, at the current parameters.

        Returns ``loss_critic``, ``loss_actor``, ``loss_alpha`` (scalars with gradients),
        and, detached: ``alpha``, ``entropy``, ``td_error`` ``[2, B]`` (``y - Q_i(s, a)``),
        ``q_value`` ``[2, B]``, ``target`` ``[B]``, ``log_prob`` ``[B]``. Draws two noise
        tensors from torch's global generator: the next actions', then the actions'.
        """
        obs, action = self._transitions(batch)
        alpha = self.temperature.alpha
        y = self.target(batch, alpha)
        q = self.critic(obs, action)  # [2, B]
        td_error = y - q
        loss_critic = 0.5 * self._critic_loss(td_error, batch)
        new_action, log_prob = self._draw(obs)
        loss_actor = (
            alpha * log_prob - self._frozen_critic_q(obs, new_action).min(0).values
        ).mean()
        log_prob = log_prob.detach()
        loss_alpha = -(self.temperature.log_alpha * (log_prob + self.target_entropy)).mean()
        return {
            "loss_critic": loss_critic,
            "loss_actor": loss_actor,
            "loss_alpha": loss_alpha,
            "alpha": alpha,
            "entropy": -log_prob.mean(),
            "td_error": td_error.detach(),
            "q_value": q.detach(),
            "target": y,
            "log_prob": log_prob,
        }

    @torch.no_grad()
    def target(self, batch: TensorDictBase, alpha: torch.Tensor | None = None) -> torch.Tensor:
        """The soft TD target ``y`` of each transition, ``[B]`` (module docstring)."""
        alpha = self.temperature.alpha if alpha is None else alpha
        next_obs = batch["next", self.config.observation_key]
        next_action, next_log_prob = self._draw(next_obs)
        next_q = self.target_critic(next_obs, next_action).min(0).values
        return self._bootstrap(batch, next_q - alpha * next_log_prob)

    def update_targets(self) -> bool:
        """The target critic moves by ``tau`` every ``target_update_every`` steps."""
        if self.updates % self.config.target_update_every != 0:
            return False
        polyak_update(self.target_critic, self.critic, self.config.tau)
        return True

    def _draw(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action of the policy in ``[-1, 1]`` ``[B, dim]``, and its
        log-probability ``[B]``."""
        out = self.policy(obs)
        n = obs.shape[0]
        loc = out["loc"].reshape(n, self.box.dim)
        scale = out["scale"].reshape(n, self.box.dim)
        return squashed_gaussian(loc, scale, torch.randn_like(loc))
