"""SACLearner: its three losses on one fixed batch against TorchRL's own ``SACLoss`` with the
same weights, its Polyak update against a plain loop, and steps on real Pendulum
experience collected by the real :class:`millpond.actors.Collector` through a real
in-process server.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, TanhNormal
from torchrl.objectives import SACLoss, ValueEstimators

from millpond import ReplayClient, TableConfig
from millpond.box_actions import BoxScale
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner.box_networks import TwinQ, mlp_sac_actor
from millpond.learner.sac import SACConfig, SACLearner, polyak_update
from millpond.learner.td3 import TD3Config
from tests.learner._helpers import assert_published, write_chunk

pytestmark = pytest.mark.usefixtures("one_thread")

OBS = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
# two actions with different bounds, so that the rescaling to [-1, 1] is exercised
ACT = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 3.0], np.float32))


def make_learner(client: ReplayClient, config: SACConfig, seed: int = 0) -> SACLearner:
    torch.manual_seed(seed)
    policy = mlp_sac_actor(OBS, ACT, (32, 32))
    critic = TwinQ(OBS, ACT, (32, 32))
    return SACLearner(client, "replay", config, policy, critic, ACT, version=-1)


def fixed_batch(n: int = 64, seed: int = 1) -> TensorDict:
    """Transitions ``[n]`` in the env's units, some terminated, some truncated."""
    g = torch.Generator().manual_seed(seed)
    box = BoxScale(ACT)
    terminated = torch.rand(n, generator=g) < 0.3
    truncated = (torch.rand(n, generator=g) < 0.3) & ~terminated
    return TensorDict(
        {
            "observation": torch.randn(n, 5, generator=g),
            "action": box.to_env(torch.rand(n, 2, generator=g) * 2 - 1),
            "next": {
                "observation": torch.randn(n, 5, generator=g),
                "reward": torch.randn(n, 1, generator=g),
                "terminated": terminated.unsqueeze(-1),
                "truncated": truncated.unsqueeze(-1),
                "done": (terminated | truncated).unsqueeze(-1),
            },
        },
        [n],
    )


class _LocScale(nn.Module):
    """The learner's policy as TorchRL's actor reads it: ``(loc, scale)``."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.policy(observation)
        return out["loc"], out["scale"]


class _OneQ(nn.Module):
    """One of the twin Q-networks as TorchRL's Q-value network: ``Q(s, a) [..., 1]``."""

    def __init__(self, q: nn.Module) -> None:
        super().__init__()
        self.q = q

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.q(torch.cat([observation, action], -1)).unsqueeze(-1)


def torchrl_qvalue_nets(critic: TwinQ) -> list[TensorDictModule]:
    """The twin critic's two Q-networks as TorchRL's Q-value modules."""
    return [
        TensorDictModule(_OneQ(q), ["observation", "action"], ["state_action_value"])
        for q in (critic.q1, critic.q2)
    ]


@torch.no_grad()
def copy_params(params, module: nn.Module, prefix: tuple[str, ...]) -> None:
    """``module``'s parameters into a loss's parameter TensorDict under ``prefix``; for a
    :class:`TwinQ`, Q-network ``i`` into row ``i`` of TorchRL's stacked parameters."""
    nets = [(None, module)] if not isinstance(module, TwinQ) else enumerate((module.q1, module.q2))
    for index, net in nets:
        for name, p in net.named_parameters():
            target = params[(*prefix, *name.split("."))]
            (target if index is None else target[index]).copy_(p)


def torchrl_loss(learner: SACLearner) -> SACLoss:
    """TorchRL's ``SACLoss`` (version 2: no value network) on the learner's own networks, in
    the learner's ``[-1, 1]`` action units, its target critic and temperature copied in."""
    actor = ProbabilisticActor(
        TensorDictModule(_LocScale(learner.policy), ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        # the exact tanh (not TorchRL's clamped "safe" one), as the paper writes it
        distribution_kwargs={"low": -1.0, "high": 1.0, "tanh_loc": False, "safe_tanh": False},
        return_log_prob=True,
    )
    loss = SACLoss(
        actor,
        torchrl_qvalue_nets(learner.critic),
        num_qvalue_nets=2,
        loss_function="l2",
        alpha_init=float(learner.temperature.alpha),
        target_entropy=learner.target_entropy,
    )
    loss.make_value_estimator(ValueEstimators.TD0, gamma=learner.config.gamma)
    copy_params(loss.target_qvalue_network_params, learner.target_critic, ("module", "q"))
    return loss


def test_losses_match_torchrl_sacloss(client):
    """On one fixed batch, with the same weights and the same noise, the critic, actor and
    alpha losses equal TorchRL's ``SACLoss``'s; TorchRL's ``"l2"`` Q loss is the squared
    error summed over the two Q's, twice the paper's ``1/2 E[(Q - y)^2]`` (which
    Stable-Baselines3 also uses), hence the factor 2. The target critic differs from the
    online one (a few Polyak steps towards perturbed weights), so the target uses it."""
    config = SACConfig(batch_size=64, gamma=0.97, alpha_init=0.3)
    learner = make_learner(client, config)
    with torch.no_grad():
        for p in learner.target_critic.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = fixed_batch()
    ours_batch = batch.clone()
    theirs_batch = batch.clone()
    theirs_batch["action"] = learner.box.to_unit(batch["action"])
    theirs = torchrl_loss(learner)

    torch.manual_seed(123)  # both draw the next actions' noise, then the actions'
    ours = learner.losses(ours_batch)
    torch.manual_seed(123)
    out = theirs(theirs_batch)

    torch.testing.assert_close(2 * ours["loss_critic"], out["loss_qvalue"])
    torch.testing.assert_close(ours["loss_actor"], out["loss_actor"])
    torch.testing.assert_close(ours["loss_alpha"], out["loss_alpha"])
    torch.testing.assert_close(ours["entropy"], out["entropy"])
    torch.testing.assert_close(ours["alpha"], out["alpha"])


def test_polyak_update_matches_a_plain_loop():
    """``theta' <- tau theta + (1 - tau) theta'``, element by element, for every parameter
    of the twin critic (written out over Python floats)."""
    torch.manual_seed(0)
    online, target = TwinQ(OBS, ACT, (8, 8)), TwinQ(OBS, ACT, (8, 8))
    tau = 0.005
    expected = {
        name: [tau * o + (1 - tau) * t for o, t in zip(p.flatten().tolist(), tp.flatten().tolist())]
        for (name, p), tp in zip(online.named_parameters(), target.parameters())
    }
    polyak_update(target, online, tau)
    for name, p in target.named_parameters():
        torch.testing.assert_close(p.flatten(), torch.tensor(expected[name]), rtol=1e-6, atol=1e-7)
    before = [p.clone() for p in online.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, online.parameters()))  # untouched


@pytest.mark.parametrize(
    ("config", "kwargs", "field"),
    [
        (SACConfig, {"tau": 0.0}, "tau"),
        (SACConfig, {"tau": 1.5}, "tau"),
        (SACConfig, {"gamma": -0.1}, "gamma"),
        (SACConfig, {"batch_size": 0}, "batch_size"),
        (SACConfig, {"alpha_init": 0.0}, "alpha_init"),
        (SACConfig, {"target_entropy": "auto"}, "target_entropy"),
        (SACConfig, {"autotune_alpha": 1}, "autotune_alpha"),
        (TD3Config, {"policy_delay": 0}, "policy_delay"),
        (TD3Config, {"target_noise": -0.1}, "target_noise"),
        (TD3Config, {"gamma": 1.5}, "gamma"),
    ],
)
def test_configs_are_checked(config, kwargs, field):
    with pytest.raises(InvalidConfigError, match=rf"^{field} \("):
        config(**kwargs)


def test_steps_on_collected_pendulum_experience_and_publishes_the_policy(client):
    """The real collector acts with the learner's published policy on Pendulum-v1 (its
    actions in the env's [-2, 2], float32), the steps go into a uniform table, and the
    learner trains on them: each step moves the target critic by Polyak averaging, the
    temperature is learned, and the weights published load into the actors."""
    from millpond.actors import Collector

    env = gym.make("Pendulum-v1")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    client.create_table(TableConfig.uniform("replay", capacity=4096, seed=1))
    torch.manual_seed(0)
    config = SACConfig(batch_size=32, publish_every=5, lr=1e-3)
    learner = SACLearner(
        client,
        "replay",
        config,
        mlp_sac_actor(obs_space, act_space, (32, 32)),
        TwinQ(obs_space, act_space, (32, 32)),
        act_space,
    )
    assert learner.publish() == 0
    with Collector(
        "Pendulum-v1",
        num_envs=2,
        chunk_len=64,
        policy="millpond.learner.box_networks:mlp_sac_actor",
        policy_kwargs={"hidden": (32, 32)},
        weight_source=client,
        seed=3,
    ) as collector:
        chunk = collector.collect()
        assert collector.policy.version == 0
    assert chunk["action"].dtype == torch.float32 and chunk["action"].shape == (2, 64, 1)
    assert float(chunk["action"].abs().max()) <= 2.0
    write_chunk(client, "replay", chunk)

    log_alpha = float(learner.temperature.log_alpha)
    for _ in range(10):
        target_before = [p.clone() for p in learner.target_critic.parameters()]
        metrics = learner.step()
        for t, o, before in zip(
            learner.target_critic.parameters(), learner.critic.parameters(), target_before
        ):
            torch.testing.assert_close(t, torch.lerp(before, o, config.tau))
        assert metrics["policy_lag_max"] >= 0 and np.isfinite(metrics["loss"])
    assert learner.updates == 10 and metrics["published"] == learner.version == 2
    assert float(learner.temperature.log_alpha) != log_alpha
    assert_published(client, learner, 2, learner.policy)


def test_refuses_weighted_or_slice_batches(client):
    learner = make_learner(client, SACConfig())
    batch = fixed_batch(8)
    with pytest.raises(InvalidDataError, match="uniform table"):
        learner.losses(batch.clone().set("weight", torch.ones(8)))
    with pytest.raises(InvalidDataError, match=r"transitions \[B\]"):
        learner.losses(torch.stack([batch, batch], 1))
