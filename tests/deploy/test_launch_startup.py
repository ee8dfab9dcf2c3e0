"""``millpond launch`` refuses a job that cannot run before Ray starts: a config key or value,
an env id, a network that does not fit the env, a run directory that holds an earlier run
or is being written by another launch. Nothing of Ray is imported, no run directory is left
behind, and an earlier run's files are left byte for byte."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from millpond.deploy.run_dir import claim_run_dir

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "configs" / "cartpole-ppo.yaml"

_SCRIPT = """
import argparse, sys, time
from millpond.deploy import launch_cli as launch, ray_start
from millpond.errors import MillpondError

parser = argparse.ArgumentParser()
launch.build_parser(parser)
args = parser.parse_args(sys.argv[1:])
started = []
real_init = ray_start.init_ray
ray_start.init_ray = lambda *a, **k: (started.append(time.monotonic()), real_init(*a, **k))
try:
    launch.run(args)
except MillpondError as e:
    print("ERROR", type(e).__name__, e)
print("RAY_STARTED", len(started))
print("RAY_IMPORTED", "ray" in sys.modules)
"""


def _launch(run_dir: Path, *args: str, config: Path = CONFIG) -> dict[str, str]:
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(config), "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for line in run.stdout.splitlines():
        key, _, rest = line.partition(" ")
        out[key] = rest
    return out


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("run.frame=1000",), "run.frame: unknown key"),
        (("actors.num_envs=0",), "actors.num_envs: 0 must be >= 1"),
        (("ray.num_cpus=two",), "ray.num_cpus"),
        (("env.id=NoSuchEnv-v9",), "env: cannot make 'NoSuchEnv-v9'"),
        (("learner.network=nature_cnn",), "learner.network: the Nature CNN takes 3-D Box"),
    ],
)
def test_a_job_that_cannot_run_is_refused_before_any_of_ray_exists(tmp_path, overrides, named):
    args = [a for o in overrides for a in ("--set", o)]
    out = _launch(tmp_path / "run", *args)
    assert named in out["ERROR"]
    assert out["ERROR"].startswith("InvalidConfigError")
    assert out["RAY_STARTED"] == "0"
    assert out["RAY_IMPORTED"] == "False"  # not a process of it, not even the module
    assert not (tmp_path / "run").exists()  # nothing of the job was written


def earlier_run(run_dir: Path) -> dict[str, bytes]:
    """The files a run leaves (config, summary, metrics, checkpoint, a shard's table)."""
    (run_dir / "replay" / "shard-0" / "tables" / "rollouts").mkdir(parents=True)
    files = {
        "config.yaml": CONFIG.read_bytes(),
        "summary.json": b'{"frames": 81920, "stopped_by": "return"}',
        "metrics.csv": b"time_s,frames\n2.0,8192\n",
        "checkpoint.pt": bytes(range(256)) * 8,
        "replay/shard-0/tables/rollouts/meta.json": b'{"name": "rollouts"}',
    }
    for name, data in files.items():
        (run_dir / name).write_bytes(data)
    return files


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_a_launch_into_an_earlier_runs_directory_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    files = earlier_run(run_dir)
    stamps = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    out = _launch(run_dir)
    assert "holds an earlier run" in out["ERROR"] and "--resume" in out["ERROR"]
    assert out["RAY_IMPORTED"] == "False"
    assert files_of(run_dir) == files  # byte for byte, and nothing added
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == stamps


def test_a_launch_into_a_directory_another_launch_writes_is_refused(tmp_path):
    running = claim_run_dir(tmp_path / "run")  # as a running launch holds it
    try:
        out = _launch(tmp_path / "run", "--overwrite")
        assert "another millpond launch is writing to it" in out["ERROR"]
        assert out["RAY_IMPORTED"] == "False"
    finally:
        running.release()


def test_a_replay_service_that_cannot_be_reached_refuses_the_job_before_ray(tmp_path):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    out = _launch(tmp_path / "run", "--replay", dead)
    assert out["ERROR"].startswith(f"ShardUnavailableError --replay {dead}: ")
    assert out["RAY_STARTED"] == "0"
    assert not (tmp_path / "run").exists()


def test_startup_times_count_from_the_command_and_not_from_a_shell_before_it():
    """``pip install ... && millpond launch`` runs millpond in the process of the shell that
    ran pip first: the job's clock must not count what the shell did before."""
    script = (
        "import time, millpond.cli; from millpond.deploy.ray_start import command_start; "
        "print(time.time() - command_start())"
    )
    sleep_s = 3
    before = time.time()
    out = subprocess.run(
        ["bash", "-c", f'sleep {sleep_s} && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    ran_s = time.time() - before
    counted = float(out.stdout.strip())
    assert 0 <= counted <= ran_s - sleep_s, (counted, ran_s)


@pytest.mark.parametrize(
    ("config", "env", "message"),
    [
        # DQN's config on a continuous env (PPO's takes it: a Gaussian policy)
        (
            "cartpole-dqn.yaml",
            "Pendulum-v1",
            "dqn needs a Discrete action space, and env "
            "'Pendulum-v1' has Box(-2.0, 2.0, (1,), float32) (for this space: ppo or sac or td3)",
        ),
        ("cartpole-dqn.yaml", "MountainCarContinuous-v0", "dqn needs a Discrete action space"),
        (
            "pendulum-sac.yaml",
            "CartPole-v1",
            "sac needs a Box action space, and env "
            "'CartPole-v1' has Discrete(2) (for this space: dqn or ppo)",
        ),
    ],
)
def test_an_algorithm_that_does_not_fit_the_action_space_is_refused_before_ray(
    tmp_path: Path, config: str, env: str, message: str
):
    out = _launch(tmp_path / "run", "--set", f"env.id={env}", config=CONFIG.parent / config)
    assert message in out["ERROR"] and out["ERROR"].startswith("InvalidConfigError")
    assert out["RAY_STARTED"] == "0"
    assert out["RAY_IMPORTED"] == "False"
    assert not (tmp_path / "run").exists()
