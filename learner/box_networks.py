"""Networks for ``Box`` action spaces: SAC's squashed Gaussian policy and its twin Q-networks.

Like :mod:`millpond.learner.networks`, each builds a plain ``nn.Module`` from gymnasium
spaces, so the same call gives the learner its network and the actors theirs
(``"millpond.learner.box_networks:mlp_sac_actor"``), and the state dict the learner
publishes loads into every actor's copy. Layers are :class:`~millpond.learner.networks.MLP`
stacks with ReLU between them (the SAC paper's and Stable-Baselines3's networks).

- :class:`SquashedGaussianActor` maps observations to the ``"loc"`` and ``"scale"`` of a
  Gaussian over the pre-squash action ``u`` (``[..., *action_shape]``); the actors act
  ``tanh(u)`` rescaled to the action space's bounds (:mod:`millpond.box_actions`), the
  learner differentiates through the same draw. ``log(scale)`` is clamped to ``[-20, 2]``,
  as in the paper's code and Stable-Baselines3.
- :class:`DeterministicActor` (TD3's policy) maps observations to ``tanh`` of an MLP,
  rescaled to the bounds; the actors add Gaussian exploration noise
  (:class:`~millpond.actors.GaussianNoise`).
- :class:`TwinQ` holds two independent ``Q(s, a)`` networks (the clipped double-Q of
  Fujimoto et al. 2018 that SAC's second version uses). They read actions in ``[-1, 1]``
  (:meth:`~millpond.box_actions.BoxScale.to_unit`), so their inputs are on one scale
  whatever the env's bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import gymnasium as gym
import torch
from torch import nn

from millpond.box_actions import BoxScale
from millpond.errors import InvalidConfigError
from millpond.learner.networks import MLP

__all__ = [
    "LOG_STD_MAX",
    "LOG_STD_MIN",
    "DeterministicActor",
    "SquashedGaussianActor",
    "TwinQ",
    "mlp_sac_actor",
    "mlp_td3_actor",
]

#: Bounds of the policy's ``log(scale)`` (the paper's code, Stable-Baselines3).
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0


class SquashedGaussianActor(nn.Module):
    """``observation -> {"loc", "scale"}``, each ``[*B, *action_shape]``.

    Args:
        observation_space: a ``Box`` or ``Discrete`` space (as :class:`MLP` takes).
        action_space: a float ``Box`` with finite bounds.
        hidden: widths of the hidden layers.
        log_std_bounds: where ``log(scale)`` is clamped.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        hidden: Sequence[int] = (256, 256),
        log_std_bounds: tuple[float, float] = (LOG_STD_MIN, LOG_STD_MAX),
    ) -> None:
        super().__init__()
        scale = BoxScale(action_space)
        self.action_shape = scale.shape
        self.log_std_bounds = (float(log_std_bounds[0]), float(log_std_bounds[1]))
        self.mlp = MLP(observation_space, 2 * scale.dim, hidden, out_std=0.01, activation="relu")

    def forward(self, observation: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.mlp(observation)
        loc, log_std = out.chunk(2, dim=-1)
        log_std = log_std.clamp(*self.log_std_bounds)
        shape = (*out.shape[:-1], *self.action_shape)
        return {"loc": loc.reshape(shape), "scale": log_std.exp().reshape(shape)}


class DeterministicActor(nn.Module):
    """``observation -> action`` in the env's units, ``[*B, *action_shape]``: TD3's policy,
    ``tanh`` of an MLP rescaled to the action space's bounds.

    Args:
        observation_space: a ``Box`` or ``Discrete`` space (as :class:`MLP` takes).
        action_space: a float ``Box`` with finite bounds.
        hidden: widths of the hidden layers.
    """

    def __init__(
        self, observation_space: gym.Space, action_space: gym.Space, hidden: Sequence[int]
    ) -> None:
        super().__init__()
        self.box = BoxScale(action_space)
        self.mlp = MLP(observation_space, self.box.dim, hidden, out_std=0.01, activation="relu")

    def unit(self, observation: torch.Tensor) -> torch.Tensor:
        """The action in ``[-1, 1]``, ``[*B, dim]`` (what the critic reads)."""
        return torch.tanh(self.mlp(observation))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        unit = self.unit(observation)
        if unit.device != self.box.low.device:
            self.box = self.box.to(unit.device)
        return self.box.to_env(unit).reshape(*unit.shape[:-1], *self.box.shape)


class _ContinuousQ(nn.Module):
    """``Q(s, a)``: one MLP over the flattened observation and the action in ``[-1, 1]``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        inputs = gym.spaces.Box(-math.inf, math.inf, (obs_dim + act_dim,))
        self.mlp = MLP(inputs, 1, hidden, out_std=1.0, activation="relu")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features).squeeze(-1)


class TwinQ(nn.Module):
    """Two independent Q-networks: ``(observation [B, *obs], action [B, dim] in [-1, 1]) ->
    Q [2, B]``.

    Args:
        observation_space: a ``Box`` (flattened, cast to float32).
        action_space: the float ``Box`` whose actions (rescaled to ``[-1, 1]``) it reads.
        hidden: widths of each network's hidden layers.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        hidden: Sequence[int] = (256, 256),
    ) -> None:
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Box):
            raise InvalidConfigError(
                f"SAC's Q-networks take Box observations, not {observation_space}"
            )
        self.obs_shape = tuple(observation_space.shape)
        obs_dim = math.prod(self.obs_shape)
        act_dim = BoxScale(action_space).dim
        self.q1 = _ContinuousQ(obs_dim, act_dim, hidden)
        self.q2 = _ContinuousQ(obs_dim, act_dim, hidden)

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        batch = observation.shape[: observation.ndim - len(self.obs_shape)]
        x = torch.cat([observation.reshape(*batch, -1).float(), action.float()], dim=-1)
        return torch.stack([self.q1(x), self.q2(x)])


def mlp_sac_actor(
    observation_space: gym.Space, action_space: gym.Space, hidden: Sequence[int] = (256, 256)
) -> SquashedGaussianActor:
    """SAC's policy for a ``Box`` action space (an actor factory: the actors sample its
    squashed Gaussian, or act its mode with ``deterministic=True``)."""
    return SquashedGaussianActor(observation_space, action_space, hidden)


def mlp_td3_actor(
    observation_space: gym.Space, action_space: gym.Space, hidden: Sequence[int] = (256, 256)
) -> DeterministicActor:
    """TD3's policy for a ``Box`` action space (an actor factory: the actors add
    :class:`~millpond.actors.GaussianNoise` to its actions while they collect)."""
    return DeterministicActor(observation_space, action_space, hidden)
