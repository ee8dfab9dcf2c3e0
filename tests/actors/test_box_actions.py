"""Box actions in the collection loop: the tanh-squashed Gaussian policy (SAC's) keeps its
actions inside the space's bounds and records their log-probability as torch's own
``TanhTransform`` distribution gives it; the actions an env took come back exact, float32,
through a real in-process server."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tensordict import TensorDict
from torch import distributions as D

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector, GaussianNoise, make_policy
from millpond.box_actions import BoxScale
from millpond.errors import InvalidConfigError
from millpond.service.server import ServerConfig, create_server
from tests.learner._helpers import write_chunk

OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
LOW = np.array([-2.0, 0.0, -0.5], np.float32)
HIGH = np.array([2.0, 3.0, 0.5], np.float32)
ACT = gym.spaces.Box(LOW, HIGH)
FACTORY = "millpond.learner.box_networks:mlp_sac_actor"


class RecordingEnv(gym.Env):
    """A 3-D Box-action env that keeps every action it was given."""

    observation_space = OBS
    action_space = ACT

    def __init__(self) -> None:
        self.taken: list[np.ndarray] = []
        self._steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._steps = 0
        return self.np_random.standard_normal(4).astype(np.float32), {}

    def step(self, action):
        self.taken.append(np.array(action, copy=True))
        self._steps += 1
        obs = self.np_random.standard_normal(4).astype(np.float32)
        return obs, -float(np.square(action).sum()), self._steps % 7 == 0, False, {}


def policy(deterministic: bool = False, seed: int = 0, lanes: int = 6):
    torch.manual_seed(seed)
    return make_policy(
        FACTORY,
        OBS,
        ACT,
        lanes,
        policy_kwargs={"hidden": (16,)},
        deterministic=deterministic,
        seed=seed,
    )


def test_squashed_gaussian_actions_stay_in_bounds_with_their_log_prob():
    """Sampled actions are float32 inside [low, high]; their recorded log-probability is
    torch's ``TanhTransform`` density of the action in [-1, 1] (drawn from the same seeded
    noise); the deterministic policy acts ``tanh(loc)`` rescaled; a huge ``loc`` saturates
    at the bounds exactly, never past them."""
    obs = TensorDict({"observation": torch.randn(6, 4)}, [6])
    sampled = policy(seed=5)
    out = sampled(obs, frames=0)
    action = out["action"]
    assert action.dtype == torch.float32 and action.shape == (6, 3)
    assert bool(
        (action >= torch.from_numpy(LOW)).all() and (action <= torch.from_numpy(HIGH)).all()
    )

    with torch.no_grad():
        dist = sampled.module(obs["observation"])
    noise = torch.randn((6, 3), generator=torch.Generator().manual_seed(5))
    u = dist["loc"] + dist["scale"] * noise
    box = BoxScale(ACT)
    torch.testing.assert_close(action, box.to_env(torch.tanh(u)))
    reference = D.TransformedDistribution(D.Normal(dist["loc"], dist["scale"]), [D.TanhTransform()])
    expected = reference.log_prob(torch.tanh(u)).sum(-1)
    torch.testing.assert_close(out["sample_log_prob"], expected, rtol=1e-4, atol=1e-4)

    greedy = policy(deterministic=True, seed=5)
    torch.testing.assert_close(greedy(obs, 0)["action"], box.to_env(torch.tanh(dist["loc"])))

    with torch.no_grad():
        last = greedy.module.mlp.net[-1]
        last.bias[:3] = torch.tensor([1e4, -1e4, 1e4])  # loc of the three actions
    saturated = greedy(obs, 0)["action"]
    assert torch.equal(saturated, torch.tensor([[2.0, 0.0, 0.5]]).expand(6, 3))


@pytest.mark.parametrize("packed", [False, True])
def test_box_actions_round_trip_exactly_through_the_service(tmp_path, packed):
    """The collector records the actions each lane's env received (float32, bit for bit),
    and the rows sampled back from a uniform table hold those actions beside their
    observations, written segment by segment or (as env actors write) packed as columns."""
    envs = [RecordingEnv() for _ in range(3)]
    vector = SyncVectorEnv([lambda e=e: e for e in envs], autoreset_mode=AutoresetMode.SAME_STEP)
    server, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    client = ReplayClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        client.create_table(TableConfig.uniform("replay", capacity=1024, seed=2))
        with (
            client.writer("replay") as writer,
            Collector(
                vector,
                writer if packed else None,
                num_envs=3,
                chunk_len=20,
                policy=FACTORY,
                policy_kwargs={"hidden": (16,)},
                seed=1,
            ) as c,
        ):
            chunk = c.run_chunk() if packed else c.collect()
            writer.flush(timeout_s=10)
        if not packed:
            write_chunk(client, "replay", chunk)
        for lane, env in enumerate(envs):
            taken = torch.from_numpy(np.stack(env.taken))
            assert taken.dtype == torch.float32
            assert torch.equal(chunk["action"][lane], taken)
        batch = client.sample("replay", 64)
        assert batch["action"].dtype == torch.float32 and batch["action"].shape == (64, 3)
        flat_obs = chunk["observation"].reshape(-1, 4)
        flat_action = chunk["action"].reshape(-1, 3)
        for obs, action in zip(batch["observation"], batch["action"]):
            (row,) = (flat_obs == obs).all(-1).nonzero()[:, 0].tolist()
            assert torch.equal(action, flat_action[row])
    finally:
        client.close()
        server.stop(grace=0.5)


def test_gaussian_noise_is_added_in_unit_space_and_clipped_to_the_bounds():
    """TD3's deterministic policy with :class:`GaussianNoise`: without noise it acts its
    action; with ``sigma`` the action moves by ``sigma * N(0, 1)`` times half each
    element's range (drawn from the policy's seeded generator), clipped to the bounds."""
    from millpond.actors import GaussianNoise

    torch.manual_seed(0)
    obs = TensorDict({"observation": torch.randn(6, 4)}, [6])
    kwargs = {"policy_kwargs": {"hidden": (16,)}, "deterministic": True, "seed": 9}
    td3 = "millpond.learner.box_networks:mlp_td3_actor"
    torch.manual_seed(1)
    plain = make_policy(td3, OBS, ACT, 6, **kwargs)
    torch.manual_seed(1)
    noisy = make_policy(td3, OBS, ACT, 6, noise=GaussianNoise(0.5), **kwargs)
    clean = plain(obs, 0)["action"]
    with torch.no_grad():
        torch.testing.assert_close(clean, plain.module(obs["observation"]))
    out = noisy(obs, 0)
    assert "sample_log_prob" not in out
    box = BoxScale(ACT)
    noise = torch.randn((6, 3), generator=torch.Generator().manual_seed(9)) * 0.5
    expected = box.to_env(torch.clamp(box.to_unit(clean) + noise, -1, 1))
    torch.testing.assert_close(out["action"], expected)
    assert bool((out["action"] >= torch.from_numpy(LOW)).all())
    assert bool((out["action"] <= torch.from_numpy(HIGH)).all())
    huge = make_policy(td3, OBS, ACT, 6, noise=GaussianNoise(100.0), **kwargs)(obs, 0)["action"]
    assert bool(((huge == torch.from_numpy(LOW)) | (huge == torch.from_numpy(HIGH))).any())


def test_gaussian_noise_needs_a_bounded_float_box():
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(InvalidConfigError, match=r"Gaussian exploration noise: .*Discrete\(3\)"):
        make_policy(linear, OBS, gym.spaces.Discrete(3), 2, noise=GaussianNoise(0.1))
    unbounded = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    with pytest.raises(InvalidConfigError, match="infinite bounds"):
        make_policy(linear, OBS, unbounded, 2, noise=GaussianNoise(0.1))
    with pytest.raises(InvalidConfigError, match="sigma"):
        GaussianNoise(-1.0)
