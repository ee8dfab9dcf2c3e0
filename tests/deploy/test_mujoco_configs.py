"""The MuJoCo configs: HalfCheetah-v5 for SAC and TD3, real physics stored exactly.

Both shipped configs load, pass the launcher's checks (the env made as every lane makes it,
its ``Box(-1, 1, (6,))`` actions fit the algorithm), and the env actor path they configure
(the launch's ``ActorConfig``: the same env, policy network and exploration) runs on the
real env into a real table for a few hundred frames. Every stored action is within the
env's bounds and is the one the env took: the same lane replayed on a single env with the
recorded actions (the reference does not use the loop) gives the same observations and
rewards, and the table holds exactly those steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco", reason="needs the mujoco extra: pip install 'millpond[mujoco]'")

from millpond.actors.envs import make_env
from millpond.actors.ray_actor import ActorConfig
from millpond.config import TableConfig
from millpond.deploy.launch import Launch
from millpond.deploy.launch_config import load_config
from millpond.deploy.preflight import check_job
from millpond.service.export import export_ted
from millpond.testing import lane_positions, replay_lanes

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
ENV = "HalfCheetah-v5"


@pytest.fixture(autouse=True)
def _mujoco_log_in_tmp(tmp_path, monkeypatch):
    # MuJoCo appends its warnings to MUJOCO_LOG.TXT in the working directory.
    monkeypatch.chdir(tmp_path)


def actor_config(tmp_path, name: str) -> ActorConfig:
    """The ActorConfig `millpond launch` gives its env actors for a shipped config."""
    config = load_config(CONFIGS / name)
    launch = Launch(config, run_dir=tmp_path / "run")
    launch.table = config.replay.table_config().name
    return launch._actor_config()


@pytest.mark.parametrize(
    ("name", "algorithm", "hidden"),
    [("halfcheetah-sac.yaml", "sac", [256, 256]), ("halfcheetah-td3.yaml", "td3", [400, 300])],
)
def test_shipped_mujoco_configs_load_and_pass_the_checks(name, algorithm, hidden):
    config = load_config(CONFIGS / name)
    assert config.env.id == ENV and config.learner.algorithm == algorithm
    assert list(config.learner.hidden_sizes) == hidden
    table = config.replay.table_config()
    # rl-zoo's learning_starts, and one 256-transition gradient step per frame
    assert table.min_size == 10_000 and table.samples_per_insert == 256
    # each 8-step segment takes one more slot: the ring holds 300,000 transitions
    assert table.capacity >= 300_000 * 9 // 8
    checked = check_job(config)  # the action-space check the launcher runs before Ray
    space = checked.action_space
    assert space.shape == (6,) and (space.low == -1).all() and (space.high == 1).all()
    assert checked.observation_space.shape == (17,)


@pytest.mark.parametrize(
    ("name", "policy", "noise"),
    [
        ("halfcheetah-sac.yaml", "mlp_sac_actor", None),
        ("halfcheetah-td3.yaml", "mlp_td3_actor", 0.1),
    ],
)
def test_real_halfcheetah_steps_reach_a_table_exactly(
    make_table, actor_lanes, tmp_path, name, policy, noise
):
    config = actor_config(tmp_path, name)
    assert config.policy == f"millpond.learner.box_networks:{policy}"
    # SAC samples its squashed Gaussian; TD3 acts its deterministic policy plus N(0, 0.1)
    assert config.deterministic == (noise is not None)
    assert (config.noise and config.noise.sigma) == noise
    num_envs, chunk_len, chunks, seed = 2, 50, 3, 11
    table = make_table(TableConfig.uniform("mujoco", capacity=1024))
    lanes = actor_lanes(
        config,
        table,
        num_envs=num_envs,
        chunk_len=chunk_len,
        chunks=chunks,
        seed=seed,
        env_kwargs={**config.env_kwargs, "max_episode_steps": 120},  # episode ends inside
    )
    actions = lanes["action"]
    assert actions.dtype == torch.float32 and tuple(actions.shape[-1:]) == (6,)
    assert ((actions >= -1) & (actions <= 1)).all(), "actions outside the env's bounds"
    assert actions.std() > 0.05, "the policy acts, not a constant"
    assert lanes["next", "truncated"].any(), "the test needs episode ends"

    # Each lane replayed on a single env with the recorded actions: the env took them.
    refs = replay_lanes(lanes, lambda: make_env(ENV, {"max_episode_steps": 120}), seed)
    for p, ref in enumerate(refs):
        assert torch.equal(lanes[p]["observation"], ref["observation"]), f"lane {p}"
        assert torch.equal(lanes[p]["next", "observation"], ref["next", "observation"])
        assert torch.equal(lanes[p]["next", "reward"], ref["next", "reward"])
        assert torch.equal(lanes[p]["next", "truncated"], ref["next", "truncated"])

    # The table holds every step as the lanes have it, actions bit for bit.
    where = lane_positions(lanes)
    stored = export_ted(table, tmp_path / "export")
    assert stored.shape[0] == table.size == num_envs * chunk_len * chunks
    stored_actions = stored["action"].numpy()
    assert np.all(stored_actions >= -1) and np.all(stored_actions <= 1)
    for row, key in enumerate(zip(stored["episode_id"].tolist(), stored["step"].tolist())):
        p, i = where[key]
        assert torch.equal(stored["action"][row], lanes[p]["action"][i])
        assert torch.equal(stored["observation"][row], refs[p]["observation"][i])
        assert torch.equal(stored["next", "observation"][row], refs[p]["next", "observation"][i])
