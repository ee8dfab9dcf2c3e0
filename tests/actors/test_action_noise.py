"""Ornstein-Uhlenbeck exploration noise: the process against a plain-Python recurrence on the
same normal draws, its state reset per lane when that lane begins an episode (in the real
collection loop, both autoreset modes), and the bounds honoured."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

from millpond.actors import Collector, OrnsteinUhlenbeckNoise
from millpond.actors.action_noise import LaneNoise
from millpond.box_actions import BoxScale
from millpond.errors import InvalidConfigError

SPACE = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 3.0], np.float32))


def ou_reference(draws, theta, sigma, dt, resets):
    """``x_{t+1} = x_t + theta (0 - x_t) dt + sigma sqrt(dt) eps_t`` per lane and element,
    in plain Python floats; ``resets[t]``: the lanes whose state is 0 again after step ``t``.
    Returns each step's state."""
    lanes, dim = len(draws[0]), len(draws[0][0])
    x = [[0.0] * dim for _ in range(lanes)]
    out = []
    for t, eps in enumerate(draws):
        x = [
            [x[p][i] + theta * (0.0 - x[p][i]) * dt + sigma * math.sqrt(dt) * eps[p][i]
             for i in range(dim)]
            for p in range(lanes)
        ]  # fmt: skip
        out.append([row[:] for row in x])
        for p in resets.get(t, ()):
            x[p] = [0.0] * dim
    return out


def test_process_matches_a_plain_recurrence_and_resets_one_lane():
    noise = OrnsteinUhlenbeckNoise(sigma=3.0, theta=0.7, dt=0.2)  # large: the bounds bite
    box = BoxScale(SPACE)
    lanes, steps = 3, 12
    lane_noise = LaneNoise(noise, box, torch.Generator().manual_seed(5))
    draws_gen = torch.Generator().manual_seed(5)
    draws = [torch.randn(lanes, 2, generator=draws_gen).tolist() for _ in range(steps)]
    resets = {4: (1,), 8: (0, 2)}
    expected = ou_reference(draws, noise.theta, noise.sigma, noise.dt, resets)

    action = box.to_env(torch.tensor([[0.5, -0.25]] * lanes))  # the policy's action
    clipped = 0
    for t in range(steps):
        got = lane_noise(action, lanes)
        state = torch.tensor(expected[t])
        torch.testing.assert_close(lane_noise.state, state, rtol=1e-5, atol=1e-5)
        want = box.to_env(torch.clamp(box.to_unit(action) + state, -1.0, 1.0))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert bool((got >= box.low).all() and (got <= box.high).all())
        clipped += int((got == box.low).sum() + (got == box.high).sum())
        mask = np.zeros(lanes, dtype=bool)
        mask[list(resets.get(t, ()))] = True
        lane_noise.reset(mask)
    assert clipped > 0  # the bounds were reached, and the state kept beyond them


class _Zero(torch.nn.Module):
    """A deterministic policy acting 0 (the middle of Pendulum's bounds)."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros(observation.shape[0], 1)


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP])
def test_collector_resets_a_lanes_process_when_that_lane_begins_an_episode(mode):
    """Two Pendulum lanes with episodes of 3 and 5 steps: every recorded action is the
    plain recurrence's, each lane's process starting again from 0 with each of its own
    episodes (with NEXT_STEP the reset call draws too, its action ignored)."""
    lengths, steps, seed = (3, 5), 16, 11
    noise = OrnsteinUhlenbeckNoise(sigma=0.8, theta=0.3, dt=0.5)
    env = gym.vector.SyncVectorEnv(
        [lambda n=n: gym.make("Pendulum-v1", max_episode_steps=n) for n in lengths],
        autoreset_mode=mode,
    )
    with Collector(
        env, num_envs=2, chunk_len=steps, policy=_Zero(), noise=noise, seed=seed
    ) as collector:
        chunk = collector.collect()
        env_steps = collector.env_steps

    gen = torch.Generator().manual_seed(seed)
    draws = [torch.randn(2, 1, generator=gen).tolist() for _ in range(env_steps)]
    # Which env steps of each lane are real, and after which its process restarts.
    real = {p: [] for p in range(2)}
    resets: dict[int, list[int]] = {}
    for p, n in enumerate(lengths):
        period = n if mode == AutoresetMode.SAME_STEP else n + 1  # + the reset call
        for t in range(env_steps):
            k = t % period
            if k < n:
                real[p].append(t)
            if k == period - 1:
                resets.setdefault(t, []).append(p)
    states = ou_reference(draws, noise.theta, noise.sigma, noise.dt, resets)
    for p in range(2):
        want = [2.0 * max(-1.0, min(1.0, states[t][p][0])) for t in real[p][:steps]]
        got = chunk["action"][p].reshape(-1)
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5)
    # a lane's episodes of its own length: lane 0 restarts where lane 1 does not
    assert chunk["next", "done"][0].reshape(-1)[:3].tolist() == [False, False, True]
    assert not bool(chunk["next", "done"][1].reshape(-1)[:3].any())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"sigma": -1}, "sigma"), ({"theta": -0.1}, "theta"), ({"dt": 0}, "dt"), ({"dt": True}, "dt")],
)
def test_parameters_are_checked(kwargs, field):
    with pytest.raises(InvalidConfigError, match=field):
        OrnsteinUhlenbeckNoise(**kwargs)
