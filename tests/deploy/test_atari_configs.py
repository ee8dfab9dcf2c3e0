"""The Atari configs: env wrappers by import path, the Nature CNN, real ALE frames stored exactly.

Both shipped Atari configs load, their wrappers give ``uint8[4, 84, 84]`` observations, and
the env actor path they configure (the launch's ``ActorConfig``: the same env, wrappers and
policy network) runs on a real ALE game into a real table for a few hundred frames. Every
stored step, its next observation included, equals the same lane replayed on a single env
built from the config, with the recorded actions (the reference does not use the loop).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("ale_py", reason="needs the atari extra: pip install 'millpond[atari]'")
pytest.importorskip("cv2", reason="AtariPreprocessing needs opencv (the atari extra)")

from millpond.actors import Collector
from millpond.actors.envs import WrapperSpec, check_wrappers, make_env
from millpond.actors.ray_actor import ActorConfig
from millpond.config import TableConfig
from millpond.deploy.launch import Launch
from millpond.deploy.launch_config import load_config
from millpond.errors import InvalidConfigError
from millpond.learner.networks import (
    CNNHead,
    nature_cnn_actor_critic,
    nature_cnn_policy,
    network_for,
)
from millpond.service.export import export_ted
from millpond.testing import lane_positions, replay_lanes

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
SHAPE = (4, 84, 84)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def actor_config(tmp_path, name: str, overrides=()) -> ActorConfig:
    """The ActorConfig `millpond launch` gives its env actors for a shipped config."""
    config = load_config(CONFIGS / name, list(overrides))
    launch = Launch(config, run_dir=tmp_path / "run")
    launch.table = config.replay.table_config().name
    return launch._actor_config()


@pytest.mark.parametrize(
    ("name", "game", "algorithm"),
    [("atari-ppo.yaml", "ALE/Pong-v5", "ppo"), ("atari-dqn.yaml", "ALE/Breakout-v5", "dqn")],
)
def test_shipped_atari_configs_load(name, game, algorithm):
    config = load_config(CONFIGS / name)
    assert config.env.id == game and config.learner.algorithm == algorithm
    assert config.env.kwargs["frameskip"] == 1
    paths = [w.path for w in config.env.wrappers]
    assert paths == [
        "gymnasium.wrappers:AtariPreprocessing",
        "gymnasium.wrappers:FrameStackObservation",
    ]
    assert config.env.wrappers[0].kwargs["terminal_on_life_loss"] is False
    env = make_env(config.env.id, config.env.kwargs, config.env.wrappers)
    try:
        space = env.observation_space
        assert space.shape == SHAPE and space.dtype == np.uint8
        assert network_for(space, "auto") == "nature_cnn" == config.learner.network
    finally:
        env.close()


@pytest.mark.parametrize(
    ("name", "policy"),
    [("atari-ppo.yaml", "nature_cnn_policy"), ("atari-dqn.yaml", "nature_cnn_q")],
)
def test_real_frames_reach_a_table_exactly(
    make_table, actor_lanes, tmp_path, restore_threads, name, policy
):
    # Short time limits (in emulator frames, before the 4-frame skip) put episode ends,
    # whose next observation is the real final one, inside a few hundred frames.
    config = actor_config(tmp_path, name, ["env.kwargs.max_episode_steps=160"])
    assert config.policy == f"millpond.learner.networks:{policy}"
    assert len(config.env_wrappers) == 2
    num_envs, chunk_len, chunks, seed = 2, 48, 3, 5
    # the config's table declaration: each frame of the stacks stored once
    stacks = load_config(CONFIGS / name).replay.table_config().frame_stacks
    assert stacks == {("observation",): 4}
    table = make_table(TableConfig.uniform("atari", capacity=1024, frame_stacks=stacks))
    lanes = actor_lanes(
        config, table, num_envs=num_envs, chunk_len=chunk_len, chunks=chunks, seed=seed
    )
    obs = lanes["observation"]
    assert obs.dtype == torch.uint8 and tuple(obs.shape) == (num_envs, chunk_len * chunks, *SHAPE)
    assert lanes["next", "truncated"].any(), "the test needs episode ends"

    # Each lane replayed on a single env built from the config, with the recorded actions.
    refs = replay_lanes(
        lanes, lambda: make_env(config.env, config.env_kwargs, config.env_wrappers), seed
    )
    for p, ref in enumerate(refs):
        assert torch.equal(lanes[p]["observation"], ref["observation"]), f"lane {p}"
        assert torch.equal(lanes[p]["next", "observation"], ref["next", "observation"])
        assert torch.equal(lanes[p]["next", "truncated"], ref["next", "truncated"])

    # The table rebuilds every step's next observation from the stored segments.
    where = lane_positions(lanes)
    stored = export_ted(table, tmp_path / "export")
    assert stored.shape[0] == table.size == num_envs * chunk_len * chunks
    assert stored["observation"].dtype == torch.uint8
    assert tuple(stored["next", "observation"].shape[1:]) == SHAPE
    for row, key in enumerate(zip(stored["episode_id"].tolist(), stored["step"].tolist())):
        p, i = where[key]
        assert torch.equal(stored["observation"][row], refs[p]["observation"][i])
        assert torch.equal(stored["next", "observation"][row], refs[p]["next", "observation"][i])
    sample = table.sample(16)
    assert sample["next", "observation"].dtype == torch.uint8
    assert tuple(sample["next", "observation"].shape) == (16, *SHAPE)


def test_nature_cnn_shapes_and_a_shared_torso():
    env = make_env(
        "ALE/Pong-v5",
        {"frameskip": 1},
        [
            WrapperSpec("gymnasium.wrappers:AtariPreprocessing", {"frame_skip": 4}),
            {"path": "gymnasium.wrappers.FrameStackObservation", "kwargs": {"stack_size": 4}},
        ],
    )
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    policy, critic = nature_cnn_actor_critic(obs_space, act_space)
    assert isinstance(critic, CNNHead) and critic.torso is policy.torso
    frames = torch.randint(0, 256, (3, 5, *SHAPE), dtype=torch.uint8)
    assert policy(frames).shape == (3, 5, act_space.n) and critic(frames).shape == (3, 5, 1)
    # The actors' factory has the learner policy's parameter names.
    actor = nature_cnn_policy(obs_space, act_space)
    actor.load_state_dict(policy.state_dict())
    assert torch.equal(actor(frames), policy(frames))
    convs = [m for m in policy.torso.convs if isinstance(m, torch.nn.Conv2d)]
    assert [(m.out_channels, m.kernel_size, m.stride) for m in convs] == [
        (32, (8, 8), (4, 4)),
        (64, (4, 4), (2, 2)),
        (64, (3, 3), (1, 1)),
    ]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{path: gymnasium.wrappers:NoSuchWrapper}",
            "env.wrappers[0].path: wrapper 'gymnasium.wrappers:NoSuchWrapper': "
            "'gymnasium.wrappers' has no 'NoSuchWrapper'",
        ),
        (
            "{path: nosuchpkg.wrappers:Stack}",
            "env.wrappers[0].path: wrapper 'nosuchpkg.wrappers:Stack': cannot import 'nosuchpkg",
        ),
        (
            "{path: gymnasium.wrappers:FrameStackObservation, kwargs: {stack: 4}}",
            "env.wrappers[0].kwargs: FrameStackObservation(env, stack_size, *, "
            "padding_type='reset') has no argument 'stack'",
        ),
        ("{kwargs: {}}", "env.wrappers[0].path: missing"),
        ("{path: a.b:C, kwarg: {}}", "env.wrappers[0].kwarg: unknown key"),
    ],
)
def test_bad_wrappers_are_refused_when_the_config_loads(tmp_path, entry, message):
    path = tmp_path / "job.yaml"
    path.write_text("")
    with pytest.raises(InvalidConfigError) as info:
        load_config(path, [f"env.wrappers=[{entry}]"])
    assert str(info.value).startswith(message)
    with pytest.raises(InvalidConfigError):  # and from Python
        check_wrappers([yaml.safe_load(entry)])


def test_wrappers_need_an_env_id():
    with pytest.raises(InvalidConfigError, match="wrappers apply to an env built from an id"):
        Collector(
            lambda: None,
            env_wrappers=[
                WrapperSpec("gymnasium.wrappers:FrameStackObservation", {"stack_size": 4})
            ],
        )
