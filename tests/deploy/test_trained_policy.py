"""A run's trained policy: `load_policy(RUN_DIR)` and `millpond eval`.

The run directories here hold a real `config.yaml` and a `checkpoint.pt` written by the
launch's own learner code (`LearnerActor.checkpoint`, no Ray), its networks' weights moved
off their initial values. Every action is compared with the learner's own network called
directly (argmax of its output), and every evaluation with a plain gymnasium loop.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from millpond.cli import main
from millpond.deploy.config_mapping import to_mapping
from millpond.deploy.launch_config import load_config
from millpond.deploy.learner_actor import LearnerActor, make_learner
from millpond.deploy.preflight import env_spaces
from millpond.deploy.trained_policy import TrainedPolicy, load_policy
from millpond.errors import InvalidConfigError, InvalidDataError

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def trained_run(run_dir: Path, config_file: str, overrides=()) -> torch.nn.Module:
    """A run directory of ``config_file``; the learner's acting network (the reference)."""
    config = load_config(CONFIGS / config_file, overrides)
    obs_space, act_space = env_spaces(config)
    actor = LearnerActor(config, obs_space, act_space)
    actor.learner = make_learner(config, None, "t", obs_space, act_space, version=7)
    net = actor.learner.policy if config.learner.algorithm == "ppo" else actor.learner.q_network
    with torch.no_grad():
        for p in net.parameters():  # away from the near-uniform initial logits
            p.add_(torch.randn_like(p) * 0.5)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(config), sort_keys=False))
    actor.checkpoint(str(run_dir / "checkpoint.pt"))
    return net


def reference_episodes(net, episodes: int, seed: int, env_id="CartPole-v1"):
    """Returns and lengths of ``net``'s argmax policy, in a plain gymnasium loop."""
    env = gym.make(env_id)
    returns, lengths = [], []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, steps, done = 0.0, 0, False
        while not done:
            with torch.no_grad():
                action = int(net(torch.as_tensor(obs)[None]).argmax(-1))
            obs, reward, terminated, truncated, _ = env.step(action)
            total, steps, done = total + reward, steps + 1, terminated or truncated
        returns.append(total)
        lengths.append(steps)
    return returns, lengths


def observations(n: int, seed: int = 0) -> np.ndarray:
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    out = []
    rng = np.random.default_rng(seed)
    for _ in range(n):
        out.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(2)))
        if terminated or truncated:
            obs, _ = env.reset()
    return np.stack(out)


@pytest.mark.parametrize(
    "config_file", ["cartpole-ppo.yaml", "cartpole-dqn.yaml", "cartpole-rainbow.yaml"]
)
def test_load_policy_acts_by_the_argmax_of_the_learners_network(tmp_path, config_file):
    net = trained_run(tmp_path / "run", config_file)
    policy = load_policy(tmp_path / "run")
    assert isinstance(policy, TrainedPolicy) and isinstance(policy, torch.nn.Module)
    assert policy.version == 7 and policy.deterministic
    obs = observations(64)
    with torch.no_grad():
        expected = net(torch.as_tensor(obs)).argmax(-1).numpy()
    assert len(set(expected.tolist())) == 2  # both actions occur: the check means something
    batched = policy.act(obs)
    assert batched.dtype == np.int64 and batched.shape == (64,)
    np.testing.assert_array_equal(batched, expected)
    np.testing.assert_array_equal([policy.act(o) for o in obs], expected)
    np.testing.assert_array_equal(policy(torch.as_tensor(obs)).numpy(), expected)


def test_evaluation_plays_the_episodes_of_a_plain_loop(tmp_path):
    net = trained_run(tmp_path / "run", "cartpole-ppo.yaml")
    result = load_policy(tmp_path / "run").evaluate(4, seed=11)
    returns, lengths = reference_episodes(net, 4, seed=11)
    assert list(result.returns) == returns and list(result.lengths) == lengths
    assert result.mean_return == pytest.approx(np.mean(returns))
    assert result.std_return == pytest.approx(np.std(returns))
    assert result.version == 7


def test_millpond_eval_prints_each_episode_and_the_mean_and_std(tmp_path, capsys):
    net = trained_run(tmp_path / "run", "cartpole-dqn.yaml")
    assert main(["eval", str(tmp_path / "run"), "--episodes", "3", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    returns, _ = reference_episodes(net, 3, seed=4)
    found = re.search(r"^return ([\d.]+) ± ([\d.]+) over 3 episodes$", out, re.M)
    assert found, out
    assert float(found[1]) == pytest.approx(np.mean(returns), abs=0.05)
    assert float(found[2]) == pytest.approx(np.std(returns), abs=0.05)
    assert "greedy" in out and "weights version 7" in out


def test_sampling_policy_is_seeded(tmp_path):
    trained_run(tmp_path / "run", "cartpole-ppo.yaml")
    first = load_policy(tmp_path / "run", deterministic=False, seed=3).evaluate(2, seed=1)
    again = load_policy(tmp_path / "run", deterministic=False, seed=3).evaluate(2, seed=1)
    assert first.returns == again.returns
    with pytest.raises(InvalidConfigError, match="argmax"):
        trained_run(tmp_path / "dqn", "cartpole-dqn.yaml")
        load_policy(tmp_path / "dqn", deterministic=False)


def test_video_without_moviepy_is_refused_by_name(tmp_path, capsys):
    if importlib.util.find_spec("moviepy") is not None:
        pytest.skip("moviepy is installed here")
    trained_run(tmp_path / "run", "cartpole-ppo.yaml")
    code = main(["eval", str(tmp_path / "run"), "--video", str(tmp_path / "videos")])
    assert code == 2
    assert "moviepy" in capsys.readouterr().err
    assert not (tmp_path / "videos").exists()


def test_video_records_every_episode(tmp_path):
    pytest.importorskip("moviepy", reason="--video needs moviepy (the video extra)")
    pytest.importorskip("pygame", reason="CartPole renders with pygame")
    net = trained_run(tmp_path / "run", "cartpole-ppo.yaml")
    result = load_policy(tmp_path / "run").evaluate(2, seed=3, video_dir=tmp_path / "videos")
    assert list(result.returns) == reference_episodes(net, 2, seed=3)[0]  # the same play
    videos = sorted(p.name for p in (tmp_path / "videos").iterdir())
    assert videos == ["eval-episode-0.mp4", "eval-episode-1.mp4"]
    assert all((tmp_path / "videos" / name).stat().st_size > 1000 for name in videos)


def test_what_cannot_be_evaluated_is_refused_by_name(tmp_path):
    with pytest.raises(InvalidConfigError, match="no config.yaml"):
        load_policy(tmp_path)
    trained_run(tmp_path / "run", "cartpole-ppo.yaml")
    policy = load_policy(tmp_path / "run")
    with pytest.raises(InvalidConfigError, match="Acrobot-v1"):
        policy.evaluate(1, env_id="Acrobot-v1")  # 6 observations, 3 actions
    with pytest.raises(InvalidDataError, match=r"shape \[3\]"):
        policy.act(np.zeros(3, np.float32))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    state["algorithm"] = "dqn"
    torch.save(state, tmp_path / "run" / "checkpoint.pt")
    with pytest.raises(InvalidDataError, match="'dqn' checkpoint"):
        load_policy(tmp_path / "run")


def test_atari_policy_takes_the_wrapped_frames(tmp_path):
    pytest.importorskip("ale_py", reason="needs the atari extra")
    pytest.importorskip("cv2", reason="AtariPreprocessing needs opencv")
    net = trained_run(tmp_path / "run", "atari-ppo.yaml")
    policy = load_policy(tmp_path / "run")
    env = policy.make_env()
    obs, _ = env.reset(seed=0)
    frames = [obs]
    for _ in range(5):
        obs, *_ = env.step(env.action_space.sample())
        frames.append(obs)
    env.close()
    frames = np.stack(frames)
    assert frames.shape == (6, 4, 84, 84) and frames.dtype == np.uint8
    with torch.no_grad():
        expected = net(torch.as_tensor(frames)).argmax(-1).numpy()
    np.testing.assert_array_equal(policy.act(frames), expected)
    assert policy.act(frames[0]) == expected[0]


def test_eval_config_keys_are_checked(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("run: {eval_every_frames: 1000}\n")
    with pytest.raises(InvalidConfigError, match=r"run.eval_every_frames: .*eval_episodes"):
        load_config(path)
    with pytest.raises(InvalidConfigError, match=r"run.eval_episodes: -1 must be >= 0"):
        load_config(path, ["run.eval_episodes=-1"])
    with pytest.raises(InvalidConfigError, match=r"run.eval_every_frames: 0 must be >= 1"):
        load_config(path, ["run.eval_episodes=2", "run.eval_every_frames=0"])
    config = load_config(path, ["run.eval_episodes=2"])
    assert config.run.eval_every_frames == 1000 and config.run.eval_episodes == 2
    assert (
        load_config(CONFIGS / "cartpole-dqn.yaml", ["run.eval_episodes=0"]).run.eval_episodes == 0
    )


def box_run(run_dir: Path, config, prepare=None) -> torch.nn.Module:
    """A run directory of ``config``, its learner's policy network (``prepare(net)`` run on
    it first) moved off its initial weights; the network (the reference)."""
    obs_space, act_space = env_spaces(config)
    actor = LearnerActor(config, obs_space, act_space)
    actor.learner = make_learner(config, None, "t", obs_space, act_space, version=3)
    net = actor.learner.policy
    if prepare is not None:
        prepare(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(config), sort_keys=False))
    actor.checkpoint(str(run_dir / "checkpoint.pt"))
    return net


@pytest.mark.parametrize(
    "config_file", ["pendulum-sac.yaml", "pendulum-td3.yaml", "pendulum-ppo.yaml"]
)
def test_load_policy_acts_a_box_learners_deterministic_action_in_the_envs_bounds(
    tmp_path, config_file
):
    """SAC's policy acts ``tanh(loc)`` mapped from ``[-1, 1]`` to the env's bounds (computed
    here from the learner's own network and the space's bounds); TD3's, its network's own
    output (already in the env's units); PPO's Gaussian, its mean clipped to the bounds."""
    config = load_config(CONFIGS / config_file, ["learner.hidden_sizes=[32, 32]"])
    run_dir = tmp_path / "run"
    net = box_run(run_dir, config)
    act_space = env_spaces(config)[1]

    policy = load_policy(run_dir)
    env = gym.make("Pendulum-v1")
    obs = np.stack([env.reset(seed=s)[0] for s in range(6)]).astype(np.float32)
    with torch.no_grad():
        out = net(torch.as_tensor(obs))
    low, high = (torch.as_tensor(b, dtype=torch.float32) for b in (act_space.low, act_space.high))
    if isinstance(out, dict) and "mean" in out:  # PPO: the unsquashed Gaussian's mean
        expected = out["mean"].clamp(low, high).numpy()
    elif isinstance(out, dict):  # SAC: loc and scale of the Gaussian before the squashing
        unit = torch.tanh(out["loc"])
        expected = ((high + low) / 2 + (high - low) / 2 * unit).clamp(low, high).numpy()
    else:
        expected = out.numpy()
    got = np.stack([policy.act(o) for o in obs])
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)
    assert np.all(got >= act_space.low) and np.all(got <= act_space.high)
    assert len(set(np.round(got.reshape(-1), 4))) > 1  # the weights were moved: not constant


def test_normalised_ppo_policy_round_trips_its_statistics_through_the_checkpoint(tmp_path):
    """A PPO run with ``normalize_observations``: the learner's running statistics (merged
    from real observations, far from 0 and 1) are in ``checkpoint.pt``, and the policy
    ``load_policy`` rebuilds acts as the learner's network does: its Gaussian's mean at
    the clipped normalised observations."""
    config = load_config(
        CONFIGS / "pendulum-ppo.yaml",
        ["learner.hidden_sizes=[32, 32]", "learner.ppo.normalize_observations=true"],
    )
    env = gym.make("Pendulum-v1")
    seen = np.stack([env.reset(seed=s)[0] for s in range(40)]) * 0.5 + [1.0, -0.5, 3.0]
    run_dir = tmp_path / "run"
    net = box_run(run_dir, config, lambda net: net.normalizer.update(torch.as_tensor(seen).float()))
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert torch.equal(state["policy"]["normalizer.mean"], net.normalizer.mean)
    assert torch.equal(state["critic"]["normalizer.var"], net.normalizer.var)

    policy = load_policy(run_dir)
    obs = np.stack([env.reset(seed=100 + s)[0] for s in range(6)]).astype(np.float32)
    mean, var = net.normalizer.mean.numpy(), net.normalizer.var.numpy()
    normalised = np.clip((obs - mean) / np.sqrt(var + 1e-8), -10, 10).astype(np.float32)
    with torch.no_grad():
        expected = net.net(torch.as_tensor(normalised))["mean"].clamp(-2.0, 2.0).numpy()
    got = np.stack([policy.act(o) for o in obs])
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)
    without = load_config(CONFIGS / "pendulum-ppo.yaml", ["learner.hidden_sizes=[32, 32]"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(without), sort_keys=False))
    with pytest.raises(RuntimeError, match="normalizer"):  # the statistics are not dropped
        load_policy(run_dir)
