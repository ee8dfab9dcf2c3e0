"""PPO on ``Box`` actions: the Gaussian's density against torch's ``Normal``, the actors'
clipped actions and recorded draws, and the learner's loss on a Box batch against a plain
PyTorch loop (CleanRL's ``ppo_continuous_action.py`` update), on Pendulum experience the
real :class:`millpond.actors.Collector` acted with weights pulled from a real server.
"""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector
from millpond.actors.policies import make_policy
from millpond.box_actions import gaussian_entropy, gaussian_log_prob
from millpond.errors import InvalidDataError
from millpond.learner.estimators import gae_from_batch
from millpond.learner.networks import GaussianPolicy, mlp_critic, mlp_policy
from millpond.learner.ppo import PPOConfig, PPOLearner
from tests.learner._helpers import write_chunk

pytestmark = pytest.mark.usefixtures("one_thread")

FACTORY = "millpond.learner.networks:mlp_policy"
QUEUE = "rollouts"


def pendulum_spaces() -> tuple[gym.Space, gym.Space]:
    env = gym.make("Pendulum-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    return spaces


@pytest.fixture
def client(client: ReplayClient) -> ReplayClient:
    client.create_table(TableConfig.queue(QUEUE, capacity=4096))
    return client


def make_learner(client: ReplayClient, config: PPOConfig) -> PPOLearner:
    torch.manual_seed(0)
    obs_space, act_space = pendulum_spaces()
    policy = mlp_policy(obs_space, act_space)
    with torch.no_grad():  # a wide Gaussian: many draws leave the bounds [-2, 2]
        policy.log_std.fill_(0.8)
    return PPOLearner(client, QUEUE, config, policy, mlp_critic(obs_space))


def collect(client: ReplayClient) -> TensorDict:
    with Collector(
        "Pendulum-v1", num_envs=4, chunk_len=64, policy=FACTORY, weight_source=client, seed=3
    ) as collector:
        return collector.collect()


@pytest.mark.parametrize("shape", [(5, 1), (3, 4, 6)])
def test_gaussian_log_prob_and_entropy_match_torch_normal(shape):
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(shape, generator=g) * 2
    std = torch.rand(shape, generator=g) * 3 + 0.05
    sample = mean + std * torch.randn(shape, generator=g) * 2
    normal = torch.distributions.Normal(mean, std)
    torch.testing.assert_close(
        gaussian_log_prob(mean, std, sample), normal.log_prob(sample).sum(-1)
    )
    torch.testing.assert_close(gaussian_entropy(std), normal.entropy().sum(-1))


def test_mlp_policy_on_box_is_cleanrls_gaussian():
    obs_space, act_space = pendulum_spaces()
    policy = mlp_policy(obs_space, act_space)
    assert isinstance(policy, GaussianPolicy)
    out = policy(torch.zeros(7, 3))
    assert out["mean"].shape == out["std"].shape == (7, 1)
    assert torch.equal(out["std"], torch.ones(7, 1))  # log-std starts at 0, state-independent
    assert "log_std" in dict(policy.named_parameters())


def test_actors_clip_the_draw_and_record_it_with_its_log_prob():
    obs_space, act_space = pendulum_spaces()
    module = mlp_policy(obs_space, act_space)
    with torch.no_grad():
        module.log_std.fill_(1.0)
    obs = TensorDict({"observation": torch.randn(64, 3)}, [64])
    out = make_policy(module, obs_space, act_space, 64, seed=1)(obs, 0)
    with torch.no_grad():
        ref = module(obs["observation"])
    draw = out["unclipped_action"]
    assert draw.shape == out["action"].shape == (64, 1)
    assert (draw.abs() > 2).any() and (draw.abs() < 2).any()  # some draws were clipped
    torch.testing.assert_close(out["action"], draw.clamp(-2.0, 2.0))
    normal = torch.distributions.Normal(ref["mean"], ref["std"])
    torch.testing.assert_close(out["sample_log_prob"], normal.log_prob(draw).sum(-1))
    greedy = make_policy(module, obs_space, act_space, 64, deterministic=True)(obs, 0)
    torch.testing.assert_close(greedy["action"], ref["mean"].clamp(-2.0, 2.0))


def cleanrl_loss(policy, critic, batch: TensorDict, c: PPOConfig) -> dict[str, torch.Tensor]:
    """CleanRL's ppo_continuous_action.py minibatch loss, written out with torch's Normal."""
    mean = policy.mean(batch["observation"])
    std = torch.exp(policy.log_std.expand_as(mean))
    dist = torch.distributions.Normal(mean, std)
    new_log_prob = dist.log_prob(batch["unclipped_action"]).sum(1)
    entropy = dist.entropy().sum(1)
    log_ratio = new_log_prob - batch["sample_log_prob"]
    ratio = log_ratio.exp()
    adv = batch["advantage"]
    pg_loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - c.clip_eps, 1 + c.clip_eps))
    v_loss = 0.5 * ((critic(batch["observation"]).view(-1) - batch["value_target"]) ** 2).mean()
    loss = pg_loss.mean() - c.entropy_coef * entropy.mean() + v_loss * c.value_coef
    return {"loss": loss, "loss_policy": pg_loss.mean(), "entropy": entropy.mean()}


def test_the_loss_on_a_box_batch_matches_a_plain_pytorch_loop(client):
    """On the actors' own batch the ratio starts at exactly 1 (one density on both sides);
    after the policy moves, the loss and its gradients equal CleanRL's, term by term."""
    config = PPOConfig(entropy_coef=0.01)
    learner = make_learner(client, config)
    learner.publish()
    chunk = collect(client)
    write_chunk(client, QUEUE, chunk)
    batch = client.sample(QUEUE, chunk.numel(), timeout_s=10)
    assert (batch["action"] == batch["unclipped_action"].clamp(-2, 2)).all()
    assert (batch["action"] != batch["unclipped_action"]).any()
    advantage, _ = gae_from_batch(batch, learner.critic, 0.99, 0.95, obs_key="observation")
    batch.set("advantage", advantage)
    first = learner.loss(batch)
    assert float(first["approx_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert float(first["clip_fraction"]) == 0.0

    with torch.no_grad():
        for p in learner.policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = learner.loss(batch)
    flat = TensorDict(
        {
            "observation": batch["observation"],
            "unclipped_action": batch["unclipped_action"].reshape(-1, 1),
            "sample_log_prob": batch["sample_log_prob"].reshape(-1),
            "advantage": batch["advantage"].reshape(-1),
            "value_target": batch["value_target"].reshape(-1),
        },
        [batch.shape[0]],
    )
    ref = cleanrl_loss(learner.policy, learner.critic, flat, config)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name])
    params = list(learner.policy.parameters())
    got = torch.autograd.grad(ours["loss"], params)
    want = torch.autograd.grad(ref["loss"], params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_step_on_box_experience_trains_and_publishes(client):
    learner = make_learner(client, PPOConfig(batch_size=256, minibatch_size=64, epochs=2))
    learner.publish()
    write_chunk(client, QUEUE, collect(client))
    before = learner.policy.log_std.detach().clone()
    metrics = learner.step()
    assert metrics["steps"] == 256 and metrics["version"] == 1
    assert not torch.equal(before, learner.policy.log_std.detach())


def test_a_gaussian_policy_needs_the_recorded_draws(client):
    learner = make_learner(client, PPOConfig())
    learner.publish()
    chunk = collect(client)
    write_chunk(client, QUEUE, chunk)
    batch = client.sample(QUEUE, chunk.numel(), timeout_s=10)
    batch.set("advantage", torch.zeros(batch.shape[0]))
    batch.set("value_target", torch.zeros(batch.shape[0]))
    del batch["unclipped_action"]
    with pytest.raises(InvalidDataError, match="no 'unclipped_action'"):
        learner.loss(batch)
