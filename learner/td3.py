"""A reference TD3 learner on a uniform or prioritized table, using only the public
:class:`ReplayClient`.

Each :meth:`TD3Learner.step` is one gradient step of TD3 (Fujimoto et al. 2018, "Addressing
Function Approximation Error in Actor-Critic Methods", Algorithm 1) on one sampled batch of
transitions ``(s, a, r, s', terminated)``, actions in ``[-1, 1]``:

- **target policy smoothing**: the next action is the *target* policy's, plus clipped
  Gaussian noise, clipped to the bounds::

      a' = clip(pi'(s') + clip(eps, -c, c), -1, 1),   eps ~ N(0, sigma)

- **clipped double Q-learning**: both critics regress onto the smaller target value
  (a truncation bootstraps: only ``terminated`` ends the return)::

      y = r + gamma (1 - terminated) min_i Q'_i(s', a')
      J_Q = sum_i E[(Q_i(s, a) - y)^2]

  (on a prioritized table the expectation is weighted by the importance weights and the
  sampled transitions get new priorities, :mod:`millpond.learner._actor_critic`)

- **delayed policy updates**: every ``policy_delay`` steps the policy ascends ``Q_1``
  (the deterministic policy gradient, the critic's parameters held fixed for it), and only
  then do the target networks move by Polyak averaging::

      J_pi = -E[Q_1(s, pi(s))]
      theta'_i <- tau theta_i + (1 - tau) theta'_i,   phi' <- tau phi + (1 - tau) phi'

As for :class:`~millpond.learner.SACLearner`, the critic's and the policy's losses are taken
at the same parameters and backpropagated together (as TorchRL's ``TD3Loss`` is used), the
table's ``samples_per_insert`` sets the update-to-data ratio, and the actors run the same
policy network (``"millpond.learner.box_networks:mlp_td3_actor"``) with Gaussian
exploration noise (:class:`~millpond.actors.GaussianNoise`, ``actors.exploration_noise``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torch import nn

from millpond.checks import check_int, check_number
from millpond.learner._actor_critic import ActorCriticConfig, ActorCriticLearner, polyak_update

__all__ = ["TD3Config", "TD3Learner"]


@dataclass(frozen=True)
class TD3Config(ActorCriticConfig):
    """Hyperparameters of :class:`TD3Learner` (defaults: Stable-Baselines3's TD3, its
    learning rate 1e-3): the fields of
    :class:`~millpond.learner._actor_critic.ActorCriticConfig` and

    Attributes:
        policy_delay: critic steps per policy step (and target update).
        target_noise: standard deviation of the target policy's smoothing noise, in
            ``[-1, 1]`` action units.
        target_noise_clip: the smoothing noise is clipped to ``[-c, c]``.
    """

    lr: float = 1e-3
    policy_delay: int = 2
    target_noise: float = 0.2
    target_noise_clip: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("policy_delay", self.policy_delay, 1)
        check_number("target_noise", self.target_noise)
        check_number("target_noise_clip", self.target_noise_clip)


class TD3Learner(ActorCriticLearner):
    """TD3: twin Q-networks, target policy smoothing, delayed policy and target updates.

    Implements :class:`millpond.roles.Learner`; takes the arguments of
    :class:`~millpond.learner._actor_critic.ActorCriticLearner`, its ``policy`` mapping
    observations to actions in the env's units, with a ``unit(observations)`` method giving
    them in ``[-1, 1]`` (:func:`~millpond.learner.box_networks.mlp_td3_actor`).

    Attributes:
        target_policy: the policy's Polyak-averaged copy (beside ``target_critic`` and the
            other attributes of :class:`~millpond.learner._actor_critic.ActorCriticLearner`).
    """

    config_type = TD3Config

    def _setup(self) -> list[list[nn.Parameter]]:
        self.target_policy = copy.deepcopy(self.policy)
        self.target_policy.requires_grad_(False)
        return []

    def losses(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """The losses of a batch of transitions ``[B]`` at the current parameters:
        ``loss_critic`` always, ``loss_actor`` on the steps that update the policy (the
        next step is one when ``updates + 1`` is a multiple of ``policy_delay``); detached
        ``td_error`` and ``q_value`` ``[2, B]`` and ``target`` ``[B]``. Draws the target
        smoothing noise from torch's global generator."""
        obs, action = self._transitions(batch)
        y = self.target(batch)
        q = self.critic(obs, action)
        td_error = y - q
        out = {
            "loss_critic": self._critic_loss(td_error, batch),
            "td_error": td_error.detach(),
            "q_value": q.detach(),
            "target": y,
        }
        if (self.updates + 1) % self.config.policy_delay == 0:
            out["loss_actor"] = -self._frozen_critic_q(obs, self.policy.unit(obs))[0].mean()
        return out

    @torch.no_grad()
    def target(self, batch: TensorDictBase) -> torch.Tensor:
        """The TD target ``y`` of each transition, ``[B]`` (module docstring)."""
        c = self.config
        next_obs = batch["next", c.observation_key]
        next_action = self.target_policy.unit(next_obs)
        noise = (torch.randn_like(next_action) * c.target_noise).clamp(
            -c.target_noise_clip, c.target_noise_clip
        )
        next_action = (next_action + noise).clamp(-1.0, 1.0)
        next_q = self.target_critic(next_obs, next_action).min(0).values
        return self._bootstrap(batch, next_q)

    def update_targets(self) -> bool:
        """The target policy and critic move by ``tau`` after each policy step."""
        if self.updates % self.config.policy_delay != 0:
            return False
        polyak_update(self.target_critic, self.critic, self.config.tau)
        polyak_update(self.target_policy, self.policy, self.config.tau)
        return True
