"""Small MLP networks for the reference learners, usable as actor policy factories.

Each function builds a plain ``nn.Module`` from gymnasium spaces, so the same call gives the
learner its network and the actors theirs: name it as ``"millpond.learner.networks:mlp_policy"``
(or ``mlp_q``) in an actor config, and the loop passes ``observation_space=`` and
``action_space=`` (see :mod:`millpond.actors.policies`). The parameter names of a module
built here depend only on the spaces and ``hidden``, so the state dict a learner publishes
loads into every actor's copy.

- :func:`mlp_policy` returns logits for a ``Discrete`` action space: actors sample from
  them and record ``"sample_log_prob"``, which PPO's ratio needs.
- :func:`mlp_critic` returns ``V(s)``, ``[..., 1]`` (learner side only).
- :func:`mlp_q` returns ``Q(s, ·)``, ``[..., n]``. Actors treat the output as logits, so
  run them with ``deterministic=True`` (``argmax Q``) and an
  :class:`~millpond.actors.EpsilonGreedy` schedule for exploration.

Observations may be ``Box`` (flattened, cast to float32) or ``Discrete`` (one-hot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import gymnasium as gym
import torch
from torch import nn

from millpond.errors import InvalidConfigError

__all__ = ["MLP", "mlp_critic", "mlp_policy", "mlp_q"]


class MLP(nn.Module):
    """``observation -> features -> Linear/Tanh stack -> out_features``.

    Args:
        observation_space: a ``Box`` (flattened to ``prod(shape)`` floats) or a
            ``Discrete(n)`` space (one-hot over ``n``).
        out_features: width of the output layer.
        hidden: widths of the hidden layers.
        out_std: orthogonal-init gain of the output layer (CleanRL: 0.01 for policy logits,
            1.0 for values).

    ``forward`` accepts a batch of observations ``[*B, *obs_shape]`` in the env's dtype and
    returns ``[*B, out_features]``.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        out_features: int,
        hidden: Sequence[int] = (64, 64),
        out_std: float = 1.0,
    ) -> None:
        super().__init__()
        if isinstance(observation_space, gym.spaces.Box):
            self.obs_shape: tuple[int, ...] = tuple(observation_space.shape)
            self.num_categories: int | None = None
            in_features = math.prod(self.obs_shape)
        elif isinstance(observation_space, gym.spaces.Discrete):
            self.obs_shape = ()
            self.num_categories = int(observation_space.n)
            self.category_start = int(observation_space.start)
            in_features = self.num_categories
        else:
            raise InvalidConfigError(
                f"MLP networks take Box or Discrete observations, not {observation_space}"
            )
        widths = [int(h) for h in hidden]
        if any(h < 1 for h in widths):
            raise InvalidConfigError(f"hidden ({tuple(hidden)!r}) must be positive widths")
        layers: list[nn.Module] = []
        width = in_features
        for h in widths:
            layers += [_layer(width, h, math.sqrt(2)), nn.Tanh()]
            width = h
        layers.append(_layer(width, out_features, out_std))
        self.net = nn.Sequential(*layers)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        if self.num_categories is not None:
            index = observation.long() - self.category_start
            x = nn.functional.one_hot(index, self.num_categories).float()
        else:
            batch = observation.shape[: observation.ndim - len(self.obs_shape)]
            x = observation.reshape(*batch, -1).float()
        return self.net(x)


def mlp_policy(
    observation_space: gym.Space, action_space: gym.Space, hidden: Sequence[int] = (64, 64)
) -> MLP:
    """Policy logits ``[..., n]`` for a ``Discrete(n)`` action space (an actor factory)."""
    return MLP(observation_space, _num_actions(action_space), hidden, out_std=0.01)


def mlp_critic(observation_space: gym.Space, hidden: Sequence[int] = (64, 64)) -> MLP:
    """State values ``V(s)``, ``[..., 1]``."""
    return MLP(observation_space, 1, hidden, out_std=1.0)


def mlp_q(
    observation_space: gym.Space, action_space: gym.Space, hidden: Sequence[int] = (64, 64)
) -> MLP:
    """Action values ``Q(s, ·)``, ``[..., n]`` for a ``Discrete(n)`` action space (an actor
    factory: act with ``deterministic=True`` and epsilon-greedy exploration)."""
    return MLP(observation_space, _num_actions(action_space), hidden, out_std=1.0)


def _num_actions(action_space: gym.Space) -> int:
    if not isinstance(action_space, gym.spaces.Discrete):
        raise InvalidConfigError(f"these networks need a Discrete action space, not {action_space}")
    return int(action_space.n)


def _layer(in_features: int, out_features: int, std: float) -> nn.Linear:
    """A linear layer with orthogonal weights (gain ``std``) and zero bias, as in CleanRL."""
    layer = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer
