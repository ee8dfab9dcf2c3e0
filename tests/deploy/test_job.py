"""A training job from Python: `job_config`, `Job(...).run()`, progress, stopping, and the
evaluations a run makes (during it and at its end), on a real local Ray instance."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import millpond
from millpond import Job, JobResult, LaunchConfig, job_config, load_config
from millpond.errors import InvalidConfigError
from millpond.learner.networks import mlp_policy
from tests.deploy._cores import assert_learners_hold_their_cores

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
PPO = CONFIGS / "cartpole-ppo.yaml"
SMALL = {"ray.num_cpus": 2, "run.status_every_s": 0.5, "run.tensorboard": "off"}


def test_job_config_takes_a_file_a_mapping_or_a_config_and_overrides():
    from_file = job_config(PPO, {"run.frames": 5000, "learner.hidden_sizes": [32]})
    assert from_file.run.frames == 5000 and from_file.learner.hidden_sizes == [32]
    assert from_file.learner.ppo == load_config(PPO).learner.ppo  # the rest as the file says
    changed = job_config(from_file, ["run.eval_episodes=3", "learner.ppo.lr=3e-4"])
    assert changed.run.eval_episodes == 3 and changed.run.frames == 5000
    assert changed.learner.ppo.lr == pytest.approx(3e-4)
    mapping = {
        "name": "dqn",
        "learner": {"algorithm": "dqn"},
        "replay": {"table": {"name": "replay", "sampler": "uniform", "capacity": 1000}},
    }
    assert job_config(mapping).learner.algorithm == "dqn"
    assert mapping["learner"] == {"algorithm": "dqn"}  # the caller's mapping is left as it was
    assert job_config() == LaunchConfig()


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        (PPO, {"run.frame": 3}, r"run.frame: unknown key"),
        (PPO, {"run.frames": "many"}, r"run.frames: expected an integer"),
        (PPO, {"run.frames.x": 3}, r"run.frames.x: run.frames is not a section"),
        (PPO, "run.frames=3", r"overrides: a list"),
        (42, None, r"config: expected a file"),
        ({"run": 3}, None, r"run: expected a mapping"),
    ],
)
def test_job_config_names_every_mistake(source, overrides, message):
    with pytest.raises(InvalidConfigError, match=message):
        job_config(source, overrides)


def test_the_public_names_come_from_the_top_package():
    assert millpond.Job is Job and millpond.load_policy.__module__.endswith("trained_policy")
    assert {"Job", "JobResult", "job_config", "load_policy", "TrainedPolicy"} <= set(
        millpond.__all__
    )


def greedy_returns(state_dict, hidden, episodes: int, seed: int) -> list[float]:
    """The returns of the argmax of a CartPole policy with ``state_dict``, in a plain loop."""
    env = gym.make("CartPole-v1")
    net = mlp_policy(env.observation_space, env.action_space, hidden)
    net.load_state_dict(state_dict)
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                action = int(net(torch.as_tensor(obs)[None]).argmax(-1))
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + reward, terminated or truncated
        returns.append(total)
    return returns


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_job_runs_evaluates_and_gives_back_its_run(tmp_path):
    overrides = {**SMALL, "run.frames": 20_000, "run.stop_at_return": None, "run.seed": 5}
    overrides |= {"run.eval_episodes": 3, "run.eval_every_frames": 4096}
    rows: list[dict] = []
    out = io.StringIO()
    job = Job(PPO, overrides=overrides, run_dir=tmp_path / "run", on_progress=rows.append, out=out)
    assert job.run_dir == tmp_path / "run"
    cores = os.sched_getaffinity(0)
    result = job.run()
    # The job's Ray was its own: its learner held a core; this thread has all of its back.
    assert_learners_hold_their_cores(result.summary)
    assert os.sched_getaffinity(0) == cores

    assert isinstance(result, JobResult) and result.run_dir == tmp_path / "run"
    assert result.stopped_by == "frames" and result.summary["frames"] >= 20_000
    on_disk = json.loads((result.run_dir / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(result.summary, default=str))
    # The callback saw every progress row; the CSV holds them and the final one.
    metrics = list(csv.DictReader((result.run_dir / "metrics.csv").open()))
    assert rows and [int(r["frames"]) for r in metrics[:-1]] == [r["frames"] for r in rows]

    evaluations = result.summary["evaluations"]
    assert len(evaluations) >= 2, out.getvalue()  # during the run, and at its end
    during, final = evaluations[:-1], evaluations[-1]
    assert all(e["frames"] >= 4096 and len(e["returns"]) == 3 for e in during)
    assert final["frames"] == result.summary["frames"]
    # The final evaluation is the checkpoint's greedy policy, as a plain loop plays it.
    state = torch.load(result.run_dir / "checkpoint.pt", weights_only=False)
    expected = greedy_returns(state["policy"], (64, 64), 3, seed=5)
    assert final["returns"] == expected
    assert result.eval_return == pytest.approx(sum(expected) / 3)
    assert result.load_policy().evaluate(3, seed=5).returns == tuple(expected)
    # ... logged to the metrics (the final row holds the final one) and the progress lines.
    assert float(metrics[-1]["eval_return"]) == pytest.approx(result.eval_return, abs=1e-3)
    assert sum(1 for r in metrics if r["eval_return"]) >= 2
    assert "eval at " in out.getvalue() and (result.run_dir / "return.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_progress_callback_returning_false_stops_the_job(tmp_path):
    overrides = {**SMALL, "run.frames": 10**8, "run.stop_at_return": None}
    overrides["run.eval_episodes"] = 2
    seen: list[int] = []

    def on_progress(row):
        seen.append(row["frames"])
        return row["frames"] == 0  # False (stop) once experience flows

    job = Job(
        PPO,
        overrides=overrides,
        run_dir=tmp_path / "run",
        on_progress=on_progress,
        out=io.StringIO(),
    )
    result = job.run()
    assert result.stopped_by == "stopped" and seen[-1] > 0
    assert 0 < result.summary["frames"] < 10**8
    assert (result.run_dir / "checkpoint.pt").exists()
    assert len(result.summary["evaluations"]) == 1 and result.eval_return is not None
    with pytest.raises(InvalidConfigError, match="ran already"):
        job.run()
