"""Ape-X initial priorities: each step's absolute n-step TD error under the actor's own Q-network.

In Ape-X (Horgan et al. 2018) the actors, not the learner, give new experience its first
priority, so that a prioritized table does not start every new step at the largest priority
seen so far. An env actor computes, for each step ``t`` of what it writes, with its current
Q-network standing in for the target network::

    p_t = |sum_{i<m} gamma^i r_{t+i} + gamma^m (1 - terminated_{t+m-1}) max_a Q(s_{t+m}, a)
           - Q(s_t, a_t)| + eps

with ``m = min(n_step, steps left in the segment from t)``: the sum stops at the segment's
end, which is the episode's end or the end of the actor's chunk (an actor sees no further),
and bootstraps there from the segment's tail observation. ``n_step = 1`` gives the 1-step
TD error ``|r_t + gamma (1 - terminated_t) max_a Q(s_{t+1}, a) - Q(s_t, a_t)| + eps``. A
truncated episode bootstraps (a truncation is no termination). The learner replaces these
priorities with its own TD errors once it samples the steps.

:class:`ApexPriorities` is what a :class:`~millpond.actors.Collector` takes as
``priorities``; :func:`td_priorities` is the computation on plain arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.checks import check_int, check_number
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.segments import PackedSegments
from millpond.spec import TERMINATED, Key

from .policies import ActorPolicy

__all__ = ["ApexPriorities", "td_priorities"]

_ACTION: Key = ("action",)
_REWARD: Key = ("next", "reward")


@dataclass(frozen=True)
class ApexPriorities:
    """Initial priorities of an Ape-X actor (see the module docstring).

    Attributes:
        gamma: the discount factor (the learner's).
        n_step: steps summed before bootstrapping (the learner's ``n_step``).
        eps: added to every ``|TD error|`` (the learner's ``priority_eps``), so that no step
            starts at priority zero.
    """

    gamma: float = 0.99
    n_step: int = 1
    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_number("gamma", self.gamma)
        if not 0 <= self.gamma <= 1:
            raise InvalidConfigError(f"gamma ({self.gamma!r}) must be in [0, 1]")
        check_int("n_step", self.n_step, 1)
        check_number("eps", self.eps)
        if self.eps < 0:
            raise InvalidConfigError(f"eps ({self.eps!r}) must be >= 0")

    def __call__(self, policy: ActorPolicy, packed: PackedSegments) -> np.ndarray:
        """The priority of every step of ``packed`` under ``policy``'s current network (its
        :meth:`~millpond.actors.policies.ModulePolicy.action_values`)."""
        values = getattr(policy, "action_values", None)
        if values is None:
            raise InvalidConfigError(
                f"Ape-X priorities need a policy with action values (a Q-network), not "
                f"{type(policy).__name__}"
            )
        start = int(getattr(policy.action_space, "start", 0))  # type: ignore[attr-defined]
        return self.priorities(values, packed, start)

    def priorities(
        self,
        action_values: Callable[[TensorDictBase], torch.Tensor],
        packed: PackedSegments,
        action_start: int = 0,
    ) -> np.ndarray:
        """The priority of every step of ``packed`` (float64 ``[num_steps]``).

        ``action_values(observations)`` maps a TensorDict ``[N]`` of observation keys to
        ``Q(s, .)``, ``[N, n]`` (:meth:`~millpond.actors.policies.ModulePolicy.action_values`);
        actions are ``action_start``-based, as in a ``Discrete(n, start)`` space.
        """
        n, segments = packed.num_steps, len(packed)
        q_steps = action_values(_observations(packed.steps, packed.tails, n)).double()
        q_tails = action_values(_observations(packed.tails, packed.tails, segments)).double()
        actions = packed.steps[_ACTION].reshape(n).long() - action_start
        if q_steps.dim() != 2 or q_steps.shape[0] != n:
            raise InvalidDataError(
                f"the Q-network gave shape {list(q_steps.shape)} for {n} observations, "
                f"expected [{n}, actions]"
            )
        if actions.min() < 0 or actions.max() >= q_steps.shape[1]:
            raise InvalidDataError(
                f"actions outside the Q-network's {q_steps.shape[1]} action values"
            )
        taken = q_steps.gather(1, actions.unsqueeze(1)).squeeze(1)
        # The value of each step's next observation: the next row's, or the segment's tail.
        next_max = torch.roll(q_steps.max(1).values, -1)
        next_max[torch.from_numpy(np.cumsum(packed.lengths) - 1)] = q_tails.max(1).values
        return td_priorities(
            taken.numpy(),
            next_max.numpy(),
            packed.steps[_REWARD].reshape(n).double().numpy(),
            packed.steps[TERMINATED].reshape(n).numpy(),
            packed.lengths,
            self.gamma,
            self.n_step,
            self.eps,
        )


def td_priorities(
    q_taken: np.ndarray,
    next_max: np.ndarray,
    rewards: np.ndarray,
    terminated: np.ndarray,
    lengths: np.ndarray,
    gamma: float,
    n_step: int,
    eps: float,
) -> np.ndarray:
    """``|n-step target - Q(s_t, a_t)| + eps`` for each step, the n-step sum stopping at its
    segment's end (see the module docstring).

    Args:
        q_taken: ``Q(s_t, a_t)`` of each step, ``[N]``, segment after segment.
        next_max: ``max_a Q(s_{t+1}, a)`` of each step, ``[N]``.
        rewards: ``r_t``, ``[N]``.
        terminated: bool ``[N]``: the step ends its episode by termination.
        lengths: steps of each segment (``sum == N``).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.arange(len(q_taken))
    seg_end = np.repeat(np.cumsum(lengths), lengths)  # one past each step's segment's last row
    m = np.minimum(n_step, seg_end - rows)  # steps summed from each row
    target = np.zeros(len(q_taken), dtype=np.float64)
    for i in range(n_step):
        summed = i < m
        target[summed] += gamma**i * rewards[rows[summed] + i]
    last = rows + m - 1
    target += gamma**m * np.where(terminated[last], 0.0, next_max[last])
    return np.abs(target - q_taken) + eps


def _observations(
    columns: dict[Key, torch.Tensor], tails: dict[Key, torch.Tensor], n: int
) -> TensorDict:
    """The observation keys (the tails' keys) of ``columns`` as a TensorDict ``[n]``."""
    td = TensorDict(batch_size=[n])
    for key in tails:
        td.set(key, columns[key])
    return td
