"""Ape-X initial priorities: the actor's n-step TD errors, checked against a plain loop, and
the collector writing them into a prioritized table."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from millpond.actors import ApexPriorities, Collector, ModulePolicy, StepFilter
from millpond.config import TableConfig
from millpond.errors import InvalidConfigError
from millpond.segmenting import cut_batch
from millpond.segments import Segment, pack
from millpond.service import TableSink
from millpond.testing import stored_segments


def q_network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def segment(ep: int, n: int, terminated: bool = False, truncated: bool = False) -> Segment:
    g = torch.Generator().manual_seed(ep)
    obs = torch.randn(n + 1, 3, generator=g)
    end = torch.zeros(n, 1, dtype=torch.bool)
    td = TensorDict(
        {
            "observation": obs[:-1],
            "action": torch.randint(0, 2, (n,), generator=g),
            "next": {
                "reward": torch.randn(n, 1, generator=g),
                "terminated": end.clone().index_fill_(0, torch.tensor([n - 1]), terminated),
                "truncated": end.clone().index_fill_(0, torch.tensor([n - 1]), truncated),
            },
        },
        [n],
    )
    return Segment(td, TensorDict({"observation": obs[-1]}, []), ep, 0)


def reference(q: nn.Module, segments: list[Segment], gamma: float, n_step: int, eps: float):
    """The Ape-X priorities, step by step in plain Python."""
    out = []
    for s in segments:
        obs = torch.cat([s.steps["observation"], s.tail["observation"].unsqueeze(0)])
        rewards = s.steps["next", "reward"].reshape(-1).tolist()
        terminated = s.steps["next", "terminated"].reshape(-1).tolist()
        length = len(rewards)
        with torch.no_grad():
            values = q(obs).double()
        for t in range(length):
            g, m = 0.0, 0
            while m < n_step and t + m < length:
                g += gamma**m * rewards[t + m]
                m += 1
            bootstrap = 0.0 if terminated[t + m - 1] else float(values[t + m].max())
            target = g + gamma**m * bootstrap
            out.append(abs(target - float(values[t, int(s.steps["action"][t])])) + eps)
    return np.array(out)


@pytest.mark.parametrize("n_step", [1, 3])
def test_priorities_are_the_n_step_td_errors_of_a_plain_loop(n_step):
    net = q_network()
    space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    policy = ModulePolicy(net, space, gym.spaces.Discrete(2))
    segments = [segment(1, 5, terminated=True), segment(2, 2, truncated=True), segment(3, 4)]
    apex = ApexPriorities(gamma=0.9, n_step=n_step, eps=1e-3)
    got = apex(policy, pack(segments))
    np.testing.assert_allclose(got, reference(net, segments, 0.9, n_step, 1e-3), rtol=1e-12)
    assert got.dtype == np.float64 and got.shape == (11,)


def test_a_policy_without_action_values_is_refused():
    with pytest.raises(InvalidConfigError, match="priorities need a policy"):
        Collector("CartPole-v1", num_envs=2, priorities=ApexPriorities())


def _cartpole_q(observation_space, action_space):
    torch.manual_seed(1)
    return nn.Linear(observation_space.shape[0], int(action_space.n))


@pytest.mark.parametrize(
    "processors", [None, [StepFilter(lambda ted: torch.ones(len(ted), dtype=torch.bool))]]
)
def test_the_collector_writes_each_step_at_its_ape_x_priority(make_table, processors):
    table = make_table(TableConfig.prioritized("t", 2000, seed=0))
    apex = ApexPriorities(gamma=0.99, n_step=2)
    with Collector(
        "CartPole-v1",
        TableSink(table),
        num_envs=2,
        chunk_len=16,
        policy=_cartpole_q,
        deterministic=True,
        processors=processors,
        priorities=apex,
        seed=0,
    ) as collector:
        batch = collector.run_chunk()
    assert table.size == 32
    # The same priorities again, from the chunk the loop returned, per stored segment.
    segments = cut_batch(batch)
    want = apex(collector.policy, pack(segments))
    stored = {(ep, first): start for (ep, first, _, start) in stored_segments(table)}
    got = np.concatenate(
        [
            np.asarray(table.sampler.priorities)[
                stored[(s.episode_id, s.first_step)] + np.arange(s.steps.batch_size[0])
            ]
            for s in segments
        ]
    )
    np.testing.assert_array_equal(got, want)
    assert not np.all(got == got[0])  # not one priority for all
