"""The cost-cutting parts of the SAC/TD3 step, each against the plain computation it
replaces: the critic with detached parameters against ``torch.func.functional_call``, the
fused Adam against the per-tensor one, and a publication sent on its own thread: the weights
of the step that handed it over, stored once flushed, its refusal raised at the next wait.
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import ReplayClient, TableConfig
from millpond.errors import InvalidDataError
from millpond.learner._actor_critic import detached_view
from millpond.learner.box_networks import TwinQ, mlp_sac_actor, mlp_td3_actor
from millpond.learner.sac import SACConfig, SACLearner
from millpond.learner.td3 import TD3Config, TD3Learner
from tests.learner._helpers import Gated

pytestmark = pytest.mark.usefixtures("one_thread")

OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)


def fill(client: ReplayClient, n: int = 200) -> None:
    """A uniform table ``replay`` of ``n`` random transitions (one episode, truncated)."""
    client.create_table(TableConfig.uniform("replay", capacity=1024, seed=1))
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(n + 1, 3, generator=g)
    truncated = torch.zeros(n, 1, dtype=torch.bool)
    truncated[-1] = True
    client.extend(
        "replay",
        TensorDict(
            {
                "observation": obs[:-1],
                "action": torch.rand(n, 1, generator=g) * 4 - 2,
                "next": {
                    "observation": obs[1:],
                    "reward": torch.randn(n, 1, generator=g),
                    "terminated": torch.zeros(n, 1, dtype=torch.bool),
                    "truncated": truncated,
                },
            },
            [n],
        ),
    )


def sac(client: Any, **config) -> SACLearner:
    torch.manual_seed(0)
    return SACLearner(
        client,
        "replay",
        SACConfig(batch_size=16, **config),
        mlp_sac_actor(OBS, ACT, (16, 16)),
        TwinQ(OBS, ACT, (16, 16)),
        ACT,
        version=-1,
    )


def test_detached_view_is_functional_call_with_detached_parameters():
    """The same Q's; a gradient to the action and none to the critic; and the view follows
    the critic's parameters as an optimizer updates them in place."""
    torch.manual_seed(0)
    critic = TwinQ(OBS, ACT, (16, 16))
    view = detached_view(critic)
    obs = torch.randn(8, 3)
    optimizer = torch.optim.Adam(critic.parameters(), lr=0.1)
    for _ in range(2):
        action = torch.rand(8, 1, requires_grad=True)
        params = {k: p.detach() for k, p in critic.named_parameters()}
        expected = torch.func.functional_call(critic, params, (obs, action))
        q = view(obs, action)
        torch.testing.assert_close(q, expected, rtol=0, atol=0)
        q.sum().backward()
        assert action.grad is not None and action.grad.abs().sum() > 0
        assert all(p.grad is None for p in critic.parameters())
        critic(obs, action.detach()).pow(2).mean().backward()  # move the critic in place
        optimizer.step()
        optimizer.zero_grad()


def test_a_step_is_the_per_tensor_adam_update(client):
    """The learner's fused Adam moves every parameter as a per-tensor Adam from the same
    state does on the same gradients."""
    fill(client)
    learner = sac(client, publish_every=10**6)
    learner.step()  # Adam's moments are not zero
    batch = client.sample("replay", 16)
    modules = (learner.policy, learner.critic, learner.temperature)
    reference = copy.deepcopy(modules)
    params = [p for m in reference for p in m.parameters() if p.requires_grad]
    plain = torch.optim.Adam(
        [{"params": list(m.parameters())} for m in reference], lr=1e-3, foreach=False
    )
    plain.load_state_dict(copy.deepcopy(learner.optimizer.state_dict()))
    for group in plain.param_groups:
        group["foreach"] = group["fused"] = False
    state = torch.random.get_rng_state()
    losses = learner.losses(batch)
    learner.optimizer.zero_grad()
    (losses["loss_critic"] + losses["loss_actor"] + losses["loss_alpha"]).backward()
    grads = [p.grad.clone() for m in modules for p in m.parameters() if p.requires_grad]
    learner.optimizer.step()
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    plain.step()
    torch.random.set_rng_state(state)
    for ours, theirs in zip(
        (p for m in modules for p in m.parameters() if p.requires_grad), params, strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["sac", "td3"])
def test_a_step_publishes_its_weights_on_a_thread_of_its_own(client, algorithm):
    """The version a step hands over is stored with that step's weights (not those of the
    steps taken while it travels); ``flush`` waits for it."""
    fill(client)
    gated = Gated(client)
    torch.manual_seed(0)
    if algorithm == "sac":
        learner = sac(gated, publish_every=2)
    else:
        learner = TD3Learner(
            gated,
            "replay",
            TD3Config(batch_size=16, publish_every=2, policy_delay=1),
            mlp_td3_actor(OBS, ACT, (16, 16)),
            TwinQ(OBS, ACT, (16, 16)),
            ACT,
            version=-1,
        )
    gated.open.set()
    assert learner.publish() == 0
    gated.open.clear()
    learner.step()
    metrics = learner.step()
    assert metrics["published"] == learner.version == 1
    handed = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    learner.step()  # moves the policy while version 1 is held
    assert client.get_weights()[1] == 0
    gated.open.set()
    learner.flush()
    weights, version = client.get_weights(min_version=1)
    assert version == 1 and weights is not None and weights.keys() == handed.keys()
    for name, tensor in handed.items():
        assert torch.equal(weights[name], tensor), name
    moved = learner.policy.state_dict()
    assert not all(torch.equal(moved[k], v) for k, v in handed.items())
    learner.step()  # the next publication, version 2, waits for nothing
    assert learner.version == 2
    learner.close()  # waits for it
    assert client.get_weights()[1] == 2


def test_a_refused_publication_is_raised_at_the_next_wait(client):
    fill(client)
    learner = sac(client, publish_every=1)
    assert learner.publish() == 0
    client.publish_weights(learner.policy.state_dict(), 5)  # a newer version from elsewhere
    assert learner.step()["published"] == 1  # handed over; refused on its thread
    with pytest.raises(InvalidDataError, match="not newer"):
        learner.flush()
    learner.flush()  # raised once
    learner.close()
