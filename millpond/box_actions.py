"""Box actions: the map between a ``Box`` space's bounds and ``[-1, 1]``, and the
tanh-squashed Gaussian that the actors' policy and SAC's learner both draw from.

A squashed Gaussian (Haarnoja et al. 2018, appendix C) draws ``u ~ N(loc, scale)`` and acts
``tanh(u)``, a point of ``[-1, 1]^d`` that :class:`BoxScale` maps onto the space's bounds
``[low, high]``. Its log-density in ``[-1, 1]`` is the paper's eq. 21::

    log pi(a | s) = sum_i [ log N(u_i; loc_i, scale_i) - log(1 - tanh(u_i)^2) ]

with ``log(1 - tanh(u)^2)`` written as ``2 (log 2 - u - softplus(-2u))``, which is exact and
finite for any ``u`` (torch's ``TanhTransform`` uses the same form). The density is that
of the action in ``[-1, 1]``, not in the env's units: the entropy the temperature tunes (and
SAC's target entropy ``-dim(A)``) is then the same for any bounds, as in Stable-Baselines3,
whose buffers hold actions rescaled to ``[-1, 1]``.

PPO's policy on ``Box`` actions is instead an unsquashed diagonal Gaussian (CleanRL's
``ppo_continuous_action.py``): :func:`gaussian_log_prob` and :func:`gaussian_entropy` are its
log-density and entropy, in the env's units.

Both sides import them from here (the ground floor), so that the actions an actor takes and
the actions the learner differentiates through are one distribution.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

from millpond.errors import InvalidConfigError

__all__ = ["BoxScale", "gaussian_entropy", "gaussian_log_prob", "squashed_gaussian"]

_LOG_2 = math.log(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class BoxScale:
    """The affine map between ``[-1, 1]`` and a ``Box`` space's bounds, per element.

    Args:
        space: a float ``Box`` with finite bounds (``low < high`` everywhere).
        device: where the bound tensors live.

    Attributes:
        shape: the action's shape (the space's).
        dim: elements per action, ``prod(shape)``.
        low, high: the bounds, float32, flattened to ``[dim]``.
    """

    def __init__(self, space: gym.Space, device: torch.device | str = "cpu") -> None:
        if not isinstance(space, gym.spaces.Box) or not np.issubdtype(space.dtype, np.floating):
            raise InvalidConfigError(f"a float Box action space is needed, not {space}")
        low = np.asarray(space.low, dtype=np.float64).reshape(-1)
        high = np.asarray(space.high, dtype=np.float64).reshape(-1)
        if not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise InvalidConfigError(
                f"the action space {space} has infinite bounds: squashed actions need finite "
                "low and high (rescale the env, e.g. gymnasium.wrappers:RescaleAction)"
            )
        if not (low < high).all():
            raise InvalidConfigError(f"the action space {space} needs low < high everywhere")
        self.shape: tuple[int, ...] = tuple(space.shape)
        self.dim = int(low.size)
        self.low = torch.as_tensor(low, dtype=torch.float32, device=device)
        self.high = torch.as_tensor(high, dtype=torch.float32, device=device)
        self._mid = (self.high + self.low) / 2
        self._half = (self.high - self.low) / 2

    def to_env(self, unit: torch.Tensor) -> torch.Tensor:
        """Actions in the env's units ``[..., dim]`` from actions in ``[-1, 1]``, clamped to
        the bounds (so that rounding never leaves them)."""
        return torch.clamp(self._mid + self._half * unit, self.low, self.high)

    def to_unit(self, action: torch.Tensor) -> torch.Tensor:
        """Actions ``[..., dim]`` in the env's units mapped to ``[-1, 1]``."""
        return (action - self._mid) / self._half

    def to(self, device: torch.device | str) -> BoxScale:
        """The same map with its tensors on ``device``."""
        out = object.__new__(BoxScale)
        out.shape, out.dim = self.shape, self.dim
        for name in ("low", "high", "_mid", "_half"):
            setattr(out, name, getattr(self, name).to(device))
        return out


def squashed_gaussian(
    loc: torch.Tensor, scale: torch.Tensor, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tanh(u), log pi)`` for ``u = loc + scale * noise`` (reparameterised: gradients flow
    to ``loc`` and ``scale``); ``noise=None`` takes the mode's image ``tanh(loc)``.

    ``loc``, ``scale`` and ``noise`` are ``[..., d]``; the action is ``[..., d]`` in
    ``[-1, 1]`` and the log-probability ``[...]`` is its density there (module docstring).
    """
    u = loc if noise is None else loc + scale * noise
    z = torch.zeros_like(u) if noise is None else noise
    gaussian = -0.5 * z.pow(2) - torch.log(scale) - _LOG_SQRT_2PI
    log_det = 2.0 * (_LOG_2 - u - torch.nn.functional.softplus(-2.0 * u))
    return torch.tanh(u), (gaussian - log_det).sum(-1)


def gaussian_log_prob(mean: torch.Tensor, std: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """``sum_i log N(sample_i; mean_i, std_i)``: the log-density ``[...]`` of a diagonal
    Gaussian at ``sample`` (all three ``[..., d]``)."""
    z = (sample - mean) / std
    return (-0.5 * z.pow(2) - torch.log(std) - _LOG_SQRT_2PI).sum(-1)


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """The entropy ``[...]`` of a diagonal Gaussian with scales ``std`` ``[..., d]``."""
    return (0.5 + _LOG_SQRT_2PI + torch.log(std)).sum(-1)
