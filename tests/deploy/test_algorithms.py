"""Which action spaces each launch algorithm takes (``millpond.deploy.algorithms``)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from millpond.deploy.algorithms import check_action_space
from millpond.errors import InvalidConfigError

BOX = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


@pytest.mark.parametrize(
    ("algorithm", "space", "message"),
    [
        (
            "dqn",
            BOX,
            r"dqn needs a Discrete action space, and env 'E' has Box.* \(for this space: ppo or "
            r"sac or td3\)",
        ),
        (
            "ppo",
            gym.spaces.Box(0, 5, (2,), np.int64),
            r"ppo needs a Discrete or Box action space, and env 'E' has Box\(0, 5",
        ),
        (
            "sac",
            gym.spaces.Discrete(3),
            r"sac needs a Box action space, .*Discrete\(3\) \(for this space: dqn or ppo\)",
        ),
        ("sac", gym.spaces.Box(0, 5, (2,), np.int64), r"sac needs a Box action space"),
        (
            "sac",
            gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
            r"sac squashes its actions .* infinite ones",
        ),
        ("ppo", gym.spaces.MultiDiscrete([2, 3]), r"ppo needs a Discrete or Box action space"),
    ],
)
def test_misfits_name_the_algorithm_and_the_space(algorithm, space, message):
    with pytest.raises(InvalidConfigError, match=rf"^learner.algorithm: {message}"):
        check_action_space(algorithm, space, "E")


def test_fits_pass():
    check_action_space("sac", BOX, "E")
    check_action_space("ppo", gym.spaces.Discrete(2), "E")
    check_action_space("ppo", BOX, "E")  # continuous PPO: a Gaussian clipped to the bounds
    check_action_space("ppo", gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), "E")
    check_action_space("dqn", gym.spaces.Discrete(2, start=1), "E")
    check_action_space("a2c", BOX, "E")  # unknown: the config check names it
