"""Observation normalisation for PPO: the running statistics against numpy over the same
observations, the normalised input against ``clip((obs - mean) / sqrt(var + eps))``, and a
PPO learner on real Pendulum experience through a real server: it merges every delivered
observation, publishes the statistics with the weights, and the actors' copy normalises
with them (the queue holding raw observations)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector
from millpond.errors import InvalidConfigError
from millpond.learner.networks import mlp_critic, mlp_policy
from millpond.learner.obs_norm import ObservationNormalized, RunningMeanStd
from millpond.learner.ppo import PPOConfig, PPOLearner
from tests.learner._helpers import write_chunk

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("shape", [(3,), (2, 4)])
def test_running_statistics_equal_numpy_over_all_observations(shape):
    rng = np.random.default_rng(0)
    norm = RunningMeanStd(gym.spaces.Box(-np.inf, np.inf, shape, np.float32))
    assert norm.mean.abs().sum() == 0 and bool((norm.var == 1).all())  # before any update
    seen = []
    for n in (1, 7, 0, 300, 2):  # an empty batch changes nothing
        x = (rng.normal(size=(n, *shape)) * [3.0] + 100.0).astype(np.float32)
        norm.update(torch.from_numpy(x))
        seen.append(x)
        every = np.concatenate(seen).astype(np.float64)
        assert float(norm.count) == len(every)
        np.testing.assert_allclose(norm.mean.numpy(), every.mean(0), rtol=1e-12)
        np.testing.assert_allclose(norm.var.numpy(), every.var(0), rtol=1e-9, atol=1e-12)


class _Inputs(torch.nn.Module):
    """Records what the network is given."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.seen = observation
        return observation.sum(-1, keepdim=True)


def test_the_network_reads_clipped_normalised_observations():
    space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    norm = RunningMeanStd(space, eps=1e-8, clip=5.0)
    rng = np.random.default_rng(1)
    norm.update(torch.from_numpy(rng.normal(size=(50, 3)).astype(np.float32) * 2 + 1))
    net = ObservationNormalized(_Inputs(), norm)
    obs = rng.normal(size=(6, 3)).astype(np.float32) * 2 + 1
    obs[0, 1] = 1e3  # far out: clipped to 5
    net(torch.from_numpy(obs))
    mean, var = norm.mean.numpy(), norm.var.numpy()
    expected = np.clip((obs - mean) / np.sqrt(var + 1e-8), -5.0, 5.0)
    np.testing.assert_allclose(net.net.seen.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert net.net.seen[0, 1] == 5.0
    assert set(net.state_dict()) == {"normalizer.mean", "normalizer.var", "normalizer.count"}


def pendulum_spaces() -> tuple[gym.Space, gym.Space]:
    env = gym.make("Pendulum-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    return spaces


FACTORY = "millpond.learner.networks:mlp_policy"


def test_ppo_merges_each_batch_and_publishes_the_statistics(client: ReplayClient):
    client.create_table(TableConfig.queue("rollouts", capacity=4096))
    obs_space, act_space = pendulum_spaces()
    torch.manual_seed(0)
    policy = mlp_policy(obs_space, act_space, (16,), normalize_observations=True)
    critic = ObservationNormalized(mlp_critic(obs_space, (16,)), policy.normalizer)
    config = PPOConfig(batch_size=256, minibatch_size=64, epochs=1, normalize_observations=True)
    learner = PPOLearner(client, "rollouts", config, policy, critic, version=-1)
    learner.publish()
    kwargs = {"hidden": (16,), "normalize_observations": True}
    with Collector(
        "Pendulum-v1",
        num_envs=4,
        chunk_len=64,
        policy=FACTORY,
        policy_kwargs=kwargs,
        weight_source=client,
        seed=3,
    ) as collector:
        chunks = [collector.collect() for _ in range(2)]
        for chunk in chunks:
            write_chunk(client, "rollouts", chunk)
        raw = [c["observation"].reshape(-1, 3).numpy().astype(np.float64) for c in chunks]
        for i in range(2):
            learner.step()
            every = np.concatenate(raw[: i + 1])  # the queue delivers each chunk whole
            norm = learner.normalizer
            assert norm is policy.normalizer and float(norm.count) == len(every)
            np.testing.assert_allclose(norm.mean.cpu().numpy(), every.mean(0), rtol=1e-9)
            np.testing.assert_allclose(norm.var.cpu().numpy(), every.var(0), rtol=1e-9)
        # what the queue stored is what the env returned: raw, never normalised
        assert float(np.abs(raw[0]).max()) > 1.0  # Pendulum's angular velocity
        weights, version = client.get_weights()
        assert version == learner.version == 2
        for name in ("mean", "var", "count"):
            assert torch.equal(weights[f"normalizer.{name}"], getattr(norm, name))
        assert collector.sync_weights()
        acting = collector.policy.module
        assert torch.equal(acting.normalizer.mean, norm.mean)
        obs = torch.from_numpy(raw[1][:5].astype(np.float32))
        with torch.no_grad():
            torch.testing.assert_close(acting(obs)["mean"], policy(obs)["mean"])


def test_ppo_refuses_networks_that_do_not_share_a_normalizer(client: ReplayClient):
    obs_space, act_space = pendulum_spaces()
    config = PPOConfig(normalize_observations=True)
    plain = mlp_policy(obs_space, act_space)
    with pytest.raises(InvalidConfigError, match="normalize_observations"):
        PPOLearner(client, "q", config, plain, mlp_critic(obs_space), version=-1)
    policy = mlp_policy(obs_space, act_space, normalize_observations=True)
    other = ObservationNormalized(mlp_critic(obs_space), RunningMeanStd(obs_space))
    with pytest.raises(InvalidConfigError, match="the same one"):
        PPOLearner(client, "q", config, policy, other, version=-1)
    with pytest.raises(InvalidConfigError, match="Box observation space"):
        mlp_policy(gym.spaces.Discrete(4), act_space, normalize_observations=True)


BOX = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)


def observations(rank: int, round_: int) -> np.ndarray:
    """Rank ``rank``'s batch of round ``round_``: unequal sizes, one rank empty once."""
    n = [[3, 5], [0, 4]][round_][rank]
    rng = np.random.default_rng(10 * round_ + rank)
    return (rng.normal(size=(n, 3)) * [1.0, 4.0, 0.5] + [0.0, 2.0, -3.0]).astype(np.float32)


def _rank_main(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        norm = RunningMeanStd(BOX)
        for round_ in range(2):
            norm.update(torch.from_numpy(observations(rank, round_)), data_parallel=True)
        results[rank] = {k: v.clone() for k, v in norm.state_dict().items()}
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_merge_every_ranks_batch(tmp_path):
    from tests.learner.test_distributed import run_two_ranks

    results = run_two_ranks(_rank_main, tmp_path)
    every = np.concatenate([observations(r, k) for k in range(2) for r in range(2)]).astype(
        np.float64
    )
    for rank in (0, 1):
        assert float(results[rank]["count"]) == len(every)
        np.testing.assert_allclose(results[rank]["mean"].numpy(), every.mean(0), rtol=1e-12)
        np.testing.assert_allclose(results[rank]["var"].numpy(), every.var(0), rtol=1e-9)
    for key in ("mean", "var", "count"):
        assert torch.equal(results[0][key], results[1][key])  # the ranks agree exactly
