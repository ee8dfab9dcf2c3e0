"""Exploration noise for deterministic policies on ``Box`` actions (TD3's, DDPG's).

The noise is added in ``[-1, 1]`` units of each action element (``sigma`` times half the
element's range in the env's units), and the noisy action is clipped to the bounds, as
Stable-Baselines3's action noise is applied:

- :class:`GaussianNoise` draws ``sigma * N(0, 1)`` afresh at every step
  (Stable-Baselines3's ``NormalActionNoise``, TD3's exploration);
- :class:`OrnsteinUhlenbeckNoise` is a temporally correlated process, one per env lane and
  action element (DDPG's exploration, Lillicrap et al. 2016), in the Euler-Maruyama form
  that Stable-Baselines3's ``OrnsteinUhlenbeckActionNoise`` and TorchRL's
  ``OrnsteinUhlenbeckProcessModule`` step::

      x_{t+1} = x_t + theta (0 - x_t) dt + sigma sqrt(dt) N(0, 1),     x_0 = 0

  and the action is ``clip(a + x_{t+1}, -1, 1)``. The process's state is not clipped (only
  the action is), and a lane's state returns to ``x_0 = 0`` when that lane begins a new
  episode, the other lanes' going on (Stable-Baselines3 resets the noise of each env that
  is done, alone).

:class:`LaneNoise` holds the state of a policy's ``P`` lanes; the collection loop tells the
policy which lanes begin an episode (:meth:`~millpond.actors.ActorPolicy.reset_lanes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from millpond.box_actions import BoxScale
from millpond.errors import InvalidConfigError

__all__ = ["ActionNoise", "GaussianNoise", "LaneNoise", "OrnsteinUhlenbeckNoise"]


def _check_at_least(name: str, value: object, low: float, *, strict: bool = False) -> None:
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or value < low or (strict and value == low):  # type: ignore[operator]
        raise InvalidConfigError(
            f"{name} ({value!r}) must be a number {'>' if strict else '>='} {low}"
        )


@dataclass(frozen=True)
class GaussianNoise:
    """Gaussian exploration noise for ``Box`` action spaces (TD3's, DDPG's).

    Attributes:
        sigma: the noise's standard deviation in ``[-1, 1]`` units of each action element
            (``0.1``: a tenth of half its range).
    """

    sigma: float = 0.1

    def __post_init__(self) -> None:
        _check_at_least("sigma", self.sigma, 0)


@dataclass(frozen=True)
class OrnsteinUhlenbeckNoise:
    """Ornstein-Uhlenbeck exploration noise for ``Box`` action spaces (see the module
    docstring; defaults: Stable-Baselines3's and TorchRL's ``theta`` and ``dt``).

    Attributes:
        sigma: the process's diffusion scale in ``[-1, 1]`` units (its stationary standard
            deviation is about ``sigma / sqrt(2 theta)``).
        theta: how fast the process returns to 0, per unit of ``dt``.
        dt: the time step of the discretisation.
    """

    sigma: float = 0.2
    theta: float = 0.15
    dt: float = 1e-2

    def __post_init__(self) -> None:
        _check_at_least("sigma", self.sigma, 0)
        _check_at_least("theta", self.theta, 0)
        _check_at_least("dt", self.dt, 0, strict=True)


#: What ``noise=`` takes.
ActionNoise = GaussianNoise | OrnsteinUhlenbeckNoise


class LaneNoise:
    """The exploration noise of one policy's lanes, drawn from its seeded generator.

    Args:
        noise: which noise.
        box: the action space's bounds.
        generator: the policy's generator (every draw comes from it).
    """

    def __init__(self, noise: ActionNoise, box: BoxScale, generator: torch.Generator) -> None:
        if not isinstance(noise, GaussianNoise | OrnsteinUhlenbeckNoise):
            raise InvalidConfigError(
                f"noise ({noise!r}) must be a GaussianNoise or an OrnsteinUhlenbeckNoise"
            )
        self.noise = noise
        self.box = box
        self._generator = generator
        self._state: torch.Tensor | None = None  # OU's x_t [P, dim], from the first call

    def __call__(self, action: torch.Tensor, num: int) -> torch.Tensor:
        """``action`` (``[num, ...]``, the env's units) plus one step of noise, clipped to
        the bounds, ``[num, dim]``."""
        box, n = self.box, self.noise
        unit = box.to_unit(action.float().reshape(num, box.dim))
        draw = torch.randn(unit.shape, generator=self._generator)
        if isinstance(n, GaussianNoise):
            return box.to_env(torch.clamp(unit + n.sigma * draw, -1.0, 1.0))
        x = self._state
        if x is None or x.shape != unit.shape:
            x = torch.zeros_like(unit)
        x = x - n.theta * x * n.dt + n.sigma * math.sqrt(n.dt) * draw
        self._state = x
        return box.to_env(torch.clamp(unit + x, -1.0, 1.0))

    @property
    def state(self) -> torch.Tensor | None:
        """The Ornstein-Uhlenbeck state ``x_t`` of each lane, ``[P, dim]`` (``None`` before
        the first step, and for Gaussian noise)."""
        return None if self._state is None else self._state.clone()

    def reset(self, lanes: np.ndarray) -> None:
        """The lanes ``lanes`` (a bool mask ``[P]``) begin new episodes: their state
        returns to 0."""
        if self._state is not None:
            self._state[torch.tensor(np.asarray(lanes, dtype=bool))] = 0.0
