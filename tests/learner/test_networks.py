"""The MLPs' initial weights: CleanRL's PPO's orthogonal layers, or ``nn.Linear``'s own as
CleanRL's DQN leaves them (``init="torch"``), against networks built without millpond."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from millpond.errors import InvalidConfigError
from millpond.learner.networks import MLP, mlp_q

OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
ACTIONS = gym.spaces.Discrete(2)


def _cleanrl_q_network() -> nn.Sequential:
    """CleanRL's ``dqn.py`` Q-network for CartPole, layer for layer."""
    return nn.Sequential(
        nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2)
    )


def test_torch_init_is_the_network_cleanrl_dqn_builds_from_the_same_seed():
    torch.manual_seed(3)
    reference = _cleanrl_q_network()
    torch.manual_seed(3)
    q = mlp_q(OBS, ACTIONS, (120, 84), activation="relu", init="torch")
    ours = [p for _, p in q.named_parameters()]
    theirs = [p for _, p in reference.named_parameters()]
    assert [p.shape for p in ours] == [p.shape for p in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    obs = torch.randn(7, 4)
    assert torch.equal(q(obs), reference(obs))


def test_orthogonal_init_has_orthogonal_weights_of_the_gains_and_zero_biases():
    q = mlp_q(OBS, ACTIONS, (120, 84), activation="relu")
    linears = [m for m in q.modules() if isinstance(m, nn.Linear)]
    gains = [2**0.5, 2**0.5, 1.0]
    for layer, gain in zip(linears, gains, strict=True):
        w = layer.weight.detach() / gain
        small = min(w.shape)
        gram = w @ w.T if w.shape[0] == small else w.T @ w
        assert torch.allclose(gram, torch.eye(small), atol=1e-5)
        assert not layer.bias.any()


def test_a_dueling_head_takes_the_init_too():
    torch.manual_seed(0)
    q = mlp_q(OBS, ACTIONS, (16,), dueling=True, init="torch")
    out = [m for m in q.modules() if isinstance(m, nn.Linear)][-1]
    assert out.bias.abs().min() > 0  # nn.Linear's own biases, not zeros
    assert out.weight.abs().max() <= 1 / 16**0.5


def test_an_unknown_init_is_refused_by_name():
    with pytest.raises(InvalidConfigError, match=r"init \('xavier'\) must be one of"):
        MLP(OBS, 2, (8,), init="xavier")
