"""TD3Learner: its critic and actor losses on one fixed batch against TorchRL's own
``TD3Loss`` with the same weights, its delayed policy and target updates, and steps on
real Pendulum experience collected with Gaussian exploration noise through a real
in-process server."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.objectives import TD3Loss, ValueEstimators

from millpond import ReplayClient, TableConfig
from millpond.actors import GaussianNoise
from millpond.learner.box_networks import TwinQ, mlp_td3_actor
from millpond.learner.td3 import TD3Config, TD3Learner
from tests.learner._helpers import assert_published, write_chunk
from tests.learner.test_sac import ACT, OBS, copy_params, fixed_batch, torchrl_qvalue_nets

pytestmark = pytest.mark.usefixtures("one_thread")


def make_learner(client: ReplayClient, config: TD3Config, seed: int = 0) -> TD3Learner:
    torch.manual_seed(seed)
    policy = mlp_td3_actor(OBS, ACT, (32, 32))
    return TD3Learner(client, "replay", config, policy, TwinQ(OBS, ACT, (32, 32)), ACT, version=-1)


class _Unit(nn.Module):
    """The learner's policy as TorchRL's actor reads it: actions in [-1, 1]."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.policy.unit(observation)


def torchrl_loss(learner: TD3Learner) -> TD3Loss:
    """TorchRL's ``TD3Loss`` on the learner's networks in ``[-1, 1]`` action units, its
    target policy and critic copied in."""
    c = learner.config
    actor = TensorDictModule(_Unit(learner.policy), ["observation"], ["action"])
    loss = TD3Loss(
        actor,
        torchrl_qvalue_nets(learner.critic),
        bounds=(-1.0, 1.0),
        num_qvalue_nets=2,
        policy_noise=c.target_noise,
        noise_clip=c.target_noise_clip,
        loss_function="l2",
    )
    loss.make_value_estimator(ValueEstimators.TD0, gamma=c.gamma)
    copy_params(loss.target_actor_network_params, learner.target_policy, ("module", "policy"))
    copy_params(loss.target_qvalue_network_params, learner.target_critic, ("module", "q"))
    return loss


def test_losses_match_torchrl_td3loss(client):
    """On one fixed batch, with the same weights and the same smoothing noise, the critic
    loss (squared errors summed over the two Q's) and the actor loss (``-Q_1``) equal
    TorchRL's ``TD3Loss``'s. The target networks differ from the online ones, so the
    target uses them."""
    config = TD3Config(batch_size=64, gamma=0.97, target_noise=0.3, target_noise_clip=0.4)
    learner = make_learner(client, config)
    learner.updates = 1  # the next step updates the policy: the actor loss is there
    with torch.no_grad():
        for p in [*learner.target_critic.parameters(), *learner.target_policy.parameters()]:
            p.add_(0.05 * torch.randn_like(p))
    batch = fixed_batch()
    theirs_batch = batch.clone()
    theirs_batch["action"] = learner.box.to_unit(batch["action"])
    theirs = torchrl_loss(learner)

    torch.manual_seed(7)
    ours = learner.losses(batch.clone())
    torch.manual_seed(7)
    out = theirs(theirs_batch)
    torch.testing.assert_close(ours["loss_critic"], out["loss_qvalue"])
    torch.testing.assert_close(ours["loss_actor"], out["loss_actor"])
    torch.testing.assert_close(ours["target"], out["target_value"])


def test_policy_and_targets_move_only_every_policy_delay_steps(client):
    """With ``policy_delay=3``, steps 1 and 2 train the critic alone (the policy and both
    target networks stay as they were); step 3 moves the policy and then both targets by
    ``tau`` towards the online networks."""
    client.create_table(TableConfig.uniform("replay", capacity=1024, seed=1))
    write_chunk(client, "replay", _pendulum_chunk(client, publish=None))
    env = gym.make("Pendulum-v1")
    torch.manual_seed(0)
    config = TD3Config(batch_size=16, policy_delay=3, tau=0.1)
    learner = TD3Learner(
        client,
        "replay",
        config,
        mlp_td3_actor(env.observation_space, env.action_space, (16,)),
        TwinQ(env.observation_space, env.action_space, (16,)),
        env.action_space,
    )
    env.close()

    def snapshot(module):
        return [p.detach().clone() for p in module.parameters()]

    for step in (1, 2, 3):
        policy, critic = snapshot(learner.policy), snapshot(learner.critic)
        t_policy, t_critic = snapshot(learner.target_policy), snapshot(learner.target_critic)
        metrics = learner.step()
        assert metrics["target_updated"] is (step == 3)
        assert ("loss_actor" in metrics) is (step == 3)
        assert not all(torch.equal(a, b) for a, b in zip(critic, learner.critic.parameters()))
        moved = not all(torch.equal(a, b) for a, b in zip(policy, learner.policy.parameters()))
        assert moved is (step == 3)
        if step < 3:
            assert all(
                torch.equal(a, b) for a, b in zip(t_policy, learner.target_policy.parameters())
            )
            assert all(
                torch.equal(a, b) for a, b in zip(t_critic, learner.target_critic.parameters())
            )
    for before, t, o in zip(
        t_policy, learner.target_policy.parameters(), learner.policy.parameters()
    ):
        torch.testing.assert_close(t, torch.lerp(before, o, 0.1))
    for before, t, o in zip(
        t_critic, learner.target_critic.parameters(), learner.critic.parameters()
    ):
        torch.testing.assert_close(t, torch.lerp(before, o, 0.1))


def _pendulum_chunk(client: ReplayClient, publish: int | None):
    from millpond.actors import Collector

    with Collector(
        "Pendulum-v1",
        num_envs=2,
        chunk_len=64,
        policy="millpond.learner.box_networks:mlp_td3_actor",
        policy_kwargs={"hidden": (16,)},
        noise=GaussianNoise(0.3),
        weight_source=client if publish is not None else None,
        seed=3,
    ) as collector:
        chunk = collector.collect()
        if publish is not None:
            assert collector.policy.version == publish
    return chunk


def test_steps_on_pendulum_experience_collected_with_noise_and_publishes(client):
    env = gym.make("Pendulum-v1")
    torch.manual_seed(0)
    learner = TD3Learner(
        client,
        "replay",
        TD3Config(batch_size=32, publish_every=4),
        mlp_td3_actor(env.observation_space, env.action_space, (16,)),
        TwinQ(env.observation_space, env.action_space, (16,)),
        env.action_space,
    )
    env.close()
    client.create_table(TableConfig.uniform("replay", capacity=1024, seed=1))
    assert learner.publish() == 0
    chunk = _pendulum_chunk(client, publish=0)
    assert float(chunk["action"].abs().max()) <= 2.0 and chunk["action"].dtype == torch.float32
    write_chunk(client, "replay", chunk)
    for _ in range(8):
        metrics = learner.step()
    assert metrics["published"] == learner.version == 2 and learner.updates == 8
    assert_published(client, learner, 2, learner.policy)
