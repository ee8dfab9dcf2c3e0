"""Observation normalisation with running statistics, as gymnasium's ``NormalizeObservation``
(with the clipping CleanRL's ``ppo_continuous_action.py`` adds), for a policy that many
actors run.

The statistics live in the policy module itself, as buffers of a :class:`RunningMeanStd`:
the learner updates them from the observations of each batch it samples, and publishes
them with the weights (a module's state dict holds its buffers), so that every actor
normalises with the statistics of the weights it acts with, a checkpoint holds them, and
``millpond eval`` / :func:`millpond.load_policy` normalise as the run's actors did. The
replay stores raw observations: normalisation happens inside the networks, never on the
wire. A policy and a critic share one :class:`RunningMeanStd` (:class:`ObservationNormalized`
around each), so the learner's values and the actors' actions see the same inputs.

The statistics are those of every observation the learner was delivered, merged batch by
batch (Chan et al.'s parallel update, in float64): the mean and the population variance
of all of them together. A data-parallel group merges every rank's batch, in rank order,
so the ranks keep equal statistics. Before any update the mean is 0 and the variance 1.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from torch import nn

from millpond.checks import check_number
from millpond.errors import InvalidConfigError
from millpond.learner import distributed

__all__ = ["ObservationNormalized", "RunningMeanStd"]


class RunningMeanStd(nn.Module):
    """Running mean and variance of observations, and the normalisation they define::

        normalize(obs) = clip((obs - mean) / sqrt(var + eps), -clip, clip)

    Args:
        observation_space: a ``Box`` space (the statistics are per element).
        eps: added to the variance (gymnasium's 1e-8).
        clip: the normalised observation is clipped to ``[-clip, clip]`` (CleanRL's 10).

    Attributes:
        mean, var: float64 buffers of the observation's shape.
        count: observations merged so far (a float64 buffer).
    """

    def __init__(self, observation_space: gym.Space, eps: float = 1e-8, clip: float = 10.0) -> None:
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Box):
            raise InvalidConfigError(
                f"observation normalisation needs a Box observation space, not {observation_space}"
            )
        check_number("eps", eps, positive=True)
        check_number("clip", clip, positive=True)
        self.shape = tuple(observation_space.shape)
        self.eps, self.clip = float(eps), float(clip)
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(self.shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, observation: torch.Tensor, data_parallel: bool = False) -> None:
        """Merge a batch of observations ``[*B, *shape]`` into the statistics; in a
        data-parallel group, every rank's batch (a collective call on every rank)."""
        x = observation.reshape(-1, *self.shape).to(self.mean.device, torch.float64)
        n = torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device)
        mean = x.mean(0) if x.shape[0] else torch.zeros_like(self.mean)
        m2 = (x - mean).pow(2).sum(0)
        moments = torch.cat([n.reshape(1), mean.reshape(-1), m2.reshape(-1)])
        for part in distributed.gather(moments) if data_parallel else [moments]:
            self._merge(part)

    def _merge(self, moments: torch.Tensor) -> None:
        """Merge one batch's ``(count, mean, M2)`` (Chan et al.'s pairwise update)."""
        d = self.mean.numel()
        n = moments[0]
        if float(n) == 0:
            return
        mean = moments[1 : 1 + d].reshape(self.shape)
        m2 = moments[1 + d :].reshape(self.shape)
        total = self.count + n
        delta = mean - self.mean
        merged_m2 = self.var * self.count + m2 + delta.pow(2) * self.count * n / total
        self.mean += delta * n / total
        self.var.copy_(merged_m2 / total)
        self.count.copy_(total)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        """The normalised observations (float32, the shape of ``observation``)."""
        mean, var = self.mean.float(), self.var.float()
        return ((observation.float() - mean) / torch.sqrt(var + self.eps)).clamp(
            -self.clip, self.clip
        )


class ObservationNormalized(nn.Module):
    """``net(normalizer(observation))``: a network reading normalised observations.

    Args:
        net: the network (a policy or a critic).
        normalizer: the :class:`RunningMeanStd` (share one between a policy and its critic).

    Its state dict holds the normalizer's buffers (``normalizer.mean``, ...) beside the
    network's parameters (``net.*``), so publishing the weights publishes them.
    """

    def __init__(self, net: nn.Module, normalizer: RunningMeanStd) -> None:
        super().__init__()
        if not isinstance(normalizer, RunningMeanStd):
            raise InvalidConfigError(f"normalizer must be a RunningMeanStd, not {normalizer!r}")
        self.net = net
        self.normalizer = normalizer

    def forward(self, observation: torch.Tensor) -> Any:
        """The network's output (whatever it returns) for the normalised observations."""
        return self.net(self.normalizer(observation))
