"""The collection loop stores exactly what the envs produced, in both autoreset modes.

The reference is independent of the loop: each lane is replayed on a *single* gymnasium
env, reset with the lane's seed, stepped with the actions the loop recorded (or chosen by
the same deterministic policy, computed here), and recorded with ``millpond.testing.rollout``
(the true next observation at every step, never a reset observation). Every row of every
chunk, and every step read back from a real :class:`millpond.Table` the loop wrote into,
must equal its reference row bit for bit, with nothing extra (no reset steps) and nothing
missing.
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDictBase

from millpond.actors import (
    EPISODES_PER_INCARNATION,
    Collector,
    episode_id_base,
)
from millpond.config import TableConfig
from millpond.errors import InvalidConfigError
from millpond.service import TableSink
from millpond.service.export import export_ted
from millpond.testing import CountingDictEnv, observation_keys, rollout, state_of

FLAGS = ("terminated", "truncated", "done")


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: {list(a.shape)} != {list(b.shape)}"
    assert bits(a) == bits(b), f"{what} differs"


def replay(actions: torch.Tensor):
    """A rollout policy that plays back recorded actions in order."""
    it = iter(actions)
    return lambda obs: next(it).numpy()


def reference_lanes(make_env, seed: int, lanes: TensorDictBase) -> list[TensorDictBase]:
    """Lane ``p`` replayed on ``make_env(p)`` reset with ``seed + p``, with its recorded actions."""
    return [
        rollout(make_env(p), lanes.shape[1], seed=seed + p, policy=replay(lanes[p]["action"]))
        for p in range(lanes.shape[0])
    ]


def obs_key_pairs(ref: TensorDictBase) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(collected key, reference key) per observation leaf.

    ``rollout`` nests a dict observation under ``"observation"``; the loop stores its keys
    at the root, as TorchRL's gym wrappers do.
    """
    pairs = []
    for key in observation_keys(ref):
        ours = key[1:] if len(key) > 1 and key[0] == "observation" else key
        pairs.append((ours, key))
    return pairs


def check_lanes(lanes: TensorDictBase, refs: list[TensorDictBase]) -> None:
    """Every row of the collected lanes ``[P, N]`` equals its reference row bit for bit."""
    for p, ref in enumerate(refs):
        got = lanes[p]
        for ours, key in obs_key_pairs(ref):
            assert_same(got[ours], ref[key], f"lane {p} {key}")
            assert_same(got[("next", *ours)], ref[("next", *key)], f"lane {p} next {key}")
        assert_same(got["action"], ref["action"], f"lane {p} action")
        assert_same(got["next", "reward"], ref["next", "reward"], f"lane {p} reward")
        for flag in FLAGS:
            assert_same(got["next", flag], ref["next", flag], f"lane {p} {flag}")
        assert torch.equal(got["collector", "step_count"], ref["step_count"])
        # Trajectory ids: a new id exactly where the reference starts a new episode.
        ids, ref_ids = got["collector", "traj_ids"], ref["collector", "traj_ids"]
        assert torch.equal(ids[1:] != ids[:-1], ref_ids[1:] != ref_ids[:-1])


def check_table(table, tmp_path, lanes: TensorDictBase, refs: list[TensorDictBase]) -> None:
    """The table holds exactly the collected steps, each equal to its reference row."""
    num_lanes, n = lanes.shape
    where = {}
    for p in range(num_lanes):
        ids = lanes[p]["collector", "traj_ids"].tolist()
        steps = lanes[p]["collector", "step_count"].tolist()
        for i, key in enumerate(zip(ids, steps)):
            where[key] = p * n + i
    assert len(where) == num_lanes * n, "a (traj_id, step) pair repeats across lanes"
    stored = export_ted(table, tmp_path / "export")
    keys = list(zip(stored["episode_id"].tolist(), stored["step"].tolist()))
    assert len(keys) == len(set(keys)) == num_lanes * n, "steps stored twice, or missing"
    index = torch.tensor([where[k] for k in keys])
    ref = torch.stack(refs).reshape(-1)[index]
    for ours, key in obs_key_pairs(ref):
        assert_same(stored[ours], ref[key], f"stored {key}")
        assert_same(stored[("next", *ours)], ref[("next", *key)], f"stored next {key}")
    assert_same(stored["action"], ref["action"], "stored action")
    assert_same(stored["next", "reward"], ref["next", "reward"], "stored reward")
    for flag in ("terminated", "truncated"):
        assert_same(stored["next", flag], ref["next", flag], f"stored {flag}")


def collect_and_store(collector: Collector, chunks: int) -> tuple[TensorDictBase, list[np.ndarray]]:
    batches, surpluses = [], []
    for _ in range(chunks):
        batch = collector.run_chunk()
        assert batch.batch_size == (collector.num_envs, collector.chunk_len)
        batches.append(batch)
        surpluses.append(collector.surplus)
    return torch.cat(batches, 1), surpluses


@pytest.mark.parametrize("max_steps", [None, 12], ids=["cartpole", "cartpole-trunc12"])
@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_cartpole_every_stored_step_is_exact(make_table, tmp_path, mode, max_steps):
    num_envs, chunk_len, chunks, seed = 4, 40, 5, 11
    env_kwargs = {} if max_steps is None else {"max_episode_steps": max_steps}
    table = make_table(TableConfig.uniform("cartpole", capacity=4096))
    collector = Collector(
        "CartPole-v1",
        TableSink(table),
        num_envs=num_envs,
        chunk_len=chunk_len,
        autoreset_mode=mode,
        env_kwargs=env_kwargs,
        seed=seed,
    )
    assert collector.autoreset_mode == AutoresetMode(
        {"next_step": "NextStep", "same_step": "SameStep"}[mode]
    )
    lanes, surpluses = collect_and_store(collector, chunks)
    collector.close()

    refs = reference_lanes(lambda p: gym.make("CartPole-v1", **env_kwargs), seed, lanes)
    check_lanes(lanes, refs)
    check_table(table, tmp_path, lanes, refs)
    total = num_envs * chunk_len * chunks
    assert collector.frames == total + int(collector.surplus.sum())
    assert collector.steps_written == table.size == total
    ends = lanes["next", "done"].sum().item()
    assert ends >= 8, "the test needs episode ends"
    if max_steps is not None:
        assert lanes["next", "truncated"].any() and lanes["next", "terminated"].any()
    if mode == "next_step":
        # Every episode end cost one extra env step, and lanes drifted apart.
        assert collector.env_steps > chunk_len * chunks
        assert any(s.any() for s in surpluses), "the carry-over buffer was never used"
    else:
        assert collector.env_steps == chunk_len * chunks
        assert all(not s.any() for s in surpluses)


def single_cartpole_step(obs: torch.Tensor, action: int) -> tuple[np.ndarray, float, bool]:
    """One step of gymnasium's single CartPole from ``obs``: (next obs, reward, terminated)."""
    env = gym.make("CartPole-v1").unwrapped
    env.reset(seed=0)
    env.state = tuple(float(x) for x in obs)
    next_obs, reward, terminated, _, _ = env.step(action)
    env.close()
    return next_obs, float(reward), bool(terminated)


def test_cartpole_vector_entry_point_stores_single_env_steps(make_table, tmp_path):
    """CartPole-v1's own vector env (``vectorization_mode="vector_entry_point"``), whose
    lanes share one generator, so no lane replays on a seeded single env: instead every
    stored transition is re-stepped from its observation on gymnasium's single CartPole
    (its next observation to float32 rounding, its reward and termination exactly), every
    episode starts in the reset range, runs on (``next`` is the following step's
    observation, bit for bit) and is truncated at ``max_episode_steps``; no reset step of
    the NEXT_STEP vector env is stored, and the table holds what was collected."""
    num_envs, chunk_len, chunks, max_steps = 4, 40, 3, 15
    table = make_table(TableConfig.uniform("vec", capacity=4096))
    collector = Collector(
        "CartPole-v1",
        TableSink(table),
        num_envs=num_envs,
        chunk_len=chunk_len,
        vectorization_mode="vector_entry_point",
        autoreset_mode=None,  # its own: NEXT_STEP
        env_kwargs={"max_episode_steps": max_steps},
        seed=2,
    )
    assert type(collector.env.unwrapped).__name__ == "CartPoleVectorEnv"
    assert collector.autoreset_mode == AutoresetMode.NEXT_STEP
    lanes, _ = collect_and_store(collector, chunks)
    collector.close()

    obs, nxt = lanes["observation"], lanes["next", "observation"]
    steps = lanes["collector", "step_count"]
    ids = lanes["collector", "traj_ids"]
    assert (steps == 0).sum() >= 8, "the test needs episode starts"
    assert lanes["next", "terminated"].any() and lanes["next", "truncated"].any()
    for p in range(num_envs):
        for t in range(lanes.shape[1]):
            want_obs, want_reward, want_terminated = single_cartpole_step(
                obs[p, t], int(lanes["action"][p, t])
            )
            torch.testing.assert_close(nxt[p, t], torch.from_numpy(want_obs), rtol=0, atol=1e-5)
            assert float(lanes["next", "reward"][p, t]) == want_reward
            assert bool(lanes["next", "terminated"][p, t]) == want_terminated
            step = int(steps[p, t])
            assert bool(lanes["next", "truncated"][p, t]) == (step + 1 == max_steps)
            if step == 0:
                assert obs[p, t].abs().max() <= 0.05  # the reset range
            elif t > 0:
                assert ids[p, t] == ids[p, t - 1] and int(steps[p, t - 1]) == step - 1
                assert_same(obs[p, t], nxt[p, t - 1], f"lane {p} step {t}")
    stored = export_ted(table, tmp_path / "export")
    assert len(stored) == num_envs * chunk_len * chunks == table.size
    flat = lanes.reshape(-1)
    order = {k: i for i, k in enumerate(zip(ids.reshape(-1).tolist(), steps.reshape(-1).tolist()))}
    index = torch.tensor(
        [order[k] for k in zip(stored["episode_id"].tolist(), stored["step"].tolist())]
    )
    for key in ("observation", ("next", "observation"), "action", ("next", "reward")):
        assert_same(stored[key], flat[key][index], f"stored {key}")


@pytest.mark.parametrize(
    ("env_id", "kwargs", "match"),
    [
        ("Acrobot-v1", {}, "registers no vector env"),
        (
            "CartPole-v1",
            {
                "env_wrappers": [
                    {"path": "gymnasium.wrappers:ClipReward", "kwargs": {"min_reward": 0}}
                ]
            },
            "wrappers",
        ),
        ("CartPole-v1", {"autoreset_mode": "same_step"}, r"own autoreset mode \(NextStep\)"),
    ],
)
def test_vector_entry_point_is_refused_where_it_cannot_run(env_id, kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        Collector(
            env_id,
            None,
            num_envs=2,
            chunk_len=4,
            vectorization_mode="vector_entry_point",
            **kwargs,
        )


def counting_vector_env(num_envs: int, mode: AutoresetMode, stride: int = 1000):
    return gym.vector.SyncVectorEnv(
        [
            functools.partial(CountingDictEnv, pixel_shape=(3, 4, 4), episode_offset=p * stride)
            for p in range(num_envs)
        ],
        autoreset_mode=mode,
    )


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_dict_observations_are_exact(make_table, tmp_path, mode):
    num_envs, chunk_len, chunks, seed = 3, 25, 4, 5
    table = make_table(TableConfig.uniform("dict", capacity=4096))
    collector = Collector(
        lambda: counting_vector_env(num_envs, mode),
        TableSink(table),
        chunk_len=chunk_len,
        seed=seed,
    )
    lanes, _ = collect_and_store(collector, chunks)
    collector.close()
    assert set(observation_keys(lanes)) == {("pixels",), ("state",)}
    # The observations encode (episode, step): a terminal step's next observation is the
    # episode's real last one, never the next episode's first.
    state, next_state = lanes["state"], lanes["next", "state"]
    assert torch.equal(next_state[..., 0], state[..., 0])
    assert torch.equal(next_state[..., 1], state[..., 1] + 1)
    assert torch.equal(state[..., 1].long(), lanes["collector", "step_count"])
    assert state[0, 0, :2].tolist() == list(state_of(0, 0)[:2])

    refs = reference_lanes(
        lambda p: CountingDictEnv(pixel_shape=(3, 4, 4), episode_offset=p * 1000), seed, lanes
    )
    check_lanes(lanes, refs)
    check_table(table, tmp_path, lanes, refs)


class Greedy(torch.nn.Module):
    """A fixed CartPole policy: logits linear in the observation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[0.0, 0.0, -1.0, -0.5], [0.0, 0.0, 1.0, 0.5]]))
            self.linear.bias.zero_()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs)


def test_async_env_with_a_deterministic_policy_matches_an_independent_rollout(make_table, tmp_path):
    """Async vectorization, NEXT_STEP; the reference chooses its own actions."""
    num_envs, chunk_len, seed = 2, 30, 7
    table = make_table(TableConfig.uniform("async", capacity=1024))
    policy = Greedy()
    collector = Collector(
        "CartPole-v1",
        TableSink(table),
        num_envs=num_envs,
        chunk_len=chunk_len,
        vectorization_mode="async",
        autoreset_mode="next_step",
        env_kwargs={"max_episode_steps": 20},
        policy=policy,
        deterministic=True,
        seed=seed,
    )
    assert isinstance(collector.env, gym.vector.AsyncVectorEnv)
    lanes, _ = collect_and_store(collector, 2)
    collector.close()

    def act(obs):
        with torch.no_grad():
            return policy(torch.as_tensor(obs)).argmax(-1).numpy()

    refs = [
        rollout(
            gym.make("CartPole-v1", max_episode_steps=20), 2 * chunk_len, seed=seed + p, policy=act
        )
        for p in range(num_envs)
    ]
    check_lanes(lanes, refs)
    check_table(table, tmp_path, lanes, refs)
    assert lanes["next", "done"].any()
    assert (lanes["sample_log_prob"] <= 0).all()


def test_traj_ids_are_unique_across_actors_and_restarts():
    ids = {}
    for actor, incarnation in [(0, 0), (1, 0), (0, 1)]:
        with Collector(
            "CartPole-v1",
            None,
            num_envs=2,
            chunk_len=30,
            env_kwargs={"max_episode_steps": 10},
            episode_id_base=episode_id_base(actor, incarnation),
            seed=1,  # the same seed everywhere: only the base tells them apart
        ) as c:
            batch = c.collect()
            ids[actor, incarnation] = set(batch["collector", "traj_ids"].unique().tolist())
            base = episode_id_base(actor, incarnation)
            assert min(ids[actor, incarnation]) == base
            assert max(ids[actor, incarnation]) < base + c.episodes
            assert len(ids[actor, incarnation]) >= 6  # 2 lanes x 30 steps, 10-step episodes
    a, b, c = ids.values()
    assert not (a & b) and not (a & c) and not (b & c)


def test_episode_id_base_layout():
    assert episode_id_base(0) == 0
    assert episode_id_base(1) == 2**44
    assert episode_id_base(3, 2) == 3 * 2**44 + 2 * EPISODES_PER_INCARNATION
    assert episode_id_base(2**17 - 1, 2**12 - 1) + EPISODES_PER_INCARNATION <= 2**61
    for bad in [(-1, 0), (2**17, 0), (0, 2**12), (0, -1), (True, 0), (1.0, 0)]:
        with pytest.raises(InvalidConfigError, match=r"actor_index|incarnation"):
            episode_id_base(*bad)


def test_disabled_autoreset_is_rejected():
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")], autoreset_mode=AutoresetMode.DISABLED
    )
    with pytest.raises(InvalidConfigError, match="DISABLED"):
        Collector(env, None, chunk_len=4)
    env.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_envs": None}, "num_envs is needed"),
        ({"chunk_len": 0}, "chunk_len"),
        ({"vectorization_mode": "threads"}, "vectorization_mode"),
        ({"autoreset_mode": "disabled"}, "autoreset_mode"),
        ({"sink": object()}, "write_segment"),
        ({"weight_source": object()}, "get_weights"),
    ],
)
def test_bad_arguments_are_reported(kwargs, match):
    args = {"num_envs": 2, "chunk_len": 4, "sink": None, **kwargs}
    with pytest.raises(InvalidConfigError, match=match):
        Collector("CartPole-v1", **args)


class VersionedWeights:
    """A weight source: the latest published state dict and its version (the loop's input)."""

    def __init__(self) -> None:
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.version = -1
        self.requests: list[int] = []
        self.scheduled: tuple[Any, ...] = ()  # (request number, state dict, version)

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.state_dict = {k: v.clone() for k, v in state_dict.items()}
        self.version = version

    def get_weights(self, min_version: int = 0, timeout_s: float = 0):
        self.requests.append(min_version)
        if self.scheduled and len(self.requests) == self.scheduled[0]:
            self.publish(*self.scheduled[1:])  # as a learner would, just before this check
        if self.state_dict is None or self.version < min_version:
            return None, self.version
        return self.state_dict, self.version


def test_weights_are_pulled_every_k_steps_and_the_acting_version_is_recorded(make_table):
    every, chunk_len = 5, 12
    source = VersionedWeights()
    left = {"linear.weight": torch.zeros(2, 4), "linear.bias": torch.tensor([5.0, 0.0])}
    right = {"linear.weight": torch.zeros(2, 4), "linear.bias": torch.tensor([0.0, 5.0])}
    source.publish(left, 0)
    table = make_table(TableConfig.uniform("weights", capacity=256))
    collector = Collector(
        "CartPole-v1",
        TableSink(table),
        num_envs=2,
        chunk_len=chunk_len,
        policy=Greedy,
        deterministic=True,
        weight_source=source,
        weight_sync_every=every,
        seed=0,
    )
    policy = collector.policy.module
    first = collector.run_chunk()  # rows 0..11: checks at the start, before 5 and 10, at the end
    assert (first["policy_version"] == 0).all()
    assert (first["action"] == 0).all()
    assert torch.equal(policy.linear.bias, left["linear.bias"])
    assert source.requests == [0, 1, 1, 1]

    source.scheduled = (6, right, 3)  # published at the chunk's second check: before row 5
    second = collector.run_chunk()
    loaded_at = every
    assert (second["policy_version"][:, :loaded_at] == 0).all()
    assert (second["policy_version"][:, loaded_at:] == 3).all()
    assert (second["action"][:, :loaded_at] == 0).all()
    assert (second["action"][:, loaded_at:] == 1).all()
    assert torch.equal(policy.linear.bias, right["linear.bias"])
    assert collector.policy_version == 3
    assert source.requests == [0, 1, 1, 1, 1, 1, 4, 4]  # one cheap call per check
    assert second["policy_version"].dtype == torch.int64
    # The version is stored with every step.
    batch = table.sample(64)
    assert set(batch["policy_version"].unique().tolist()) <= {0, 3}
    # Of the 48 frames, rows 0..4 of the second chunk (2 lanes) were acted by version 0
    # while version 3 was the newest at the check that ended them: 10 frames of lag 3.
    assert collector.acting_lag.drain() == {"frames": 48, "total": 30, "max": 3}
    collector.close()
