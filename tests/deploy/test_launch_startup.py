"""``millpond launch`` starts Ray while the job's modules import: a config that turns out
bad then stops that Ray again, and a config Ray cannot be started from plainly leaves Ray
to the job (which checks the config first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "configs" / "cartpole-ppo.yaml"

_SCRIPT = """
import argparse, sys, time
import ray
from millpond.deploy import launch, ray_start
from millpond.errors import InvalidConfigError

parser = argparse.ArgumentParser()
launch.build_parser(parser)
args = parser.parse_args(sys.argv[1:])
started = []
real_init = ray_start.init_ray
ray_start.init_ray = lambda *a: (started.append(time.monotonic()), real_init(*a))
try:
    launch.run(args)
except InvalidConfigError as e:
    print("ERROR", e)
print("RAY_STARTED", len(started))
print("RAY_UP", ray.is_initialized())
"""


def _launch(tmp_path: Path, *args: str, config: Path = CONFIG) -> dict[str, str]:
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(config), "--run-dir", str(tmp_path / "run"), *args],
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


def test_a_config_found_bad_after_ray_started_stops_ray_and_names_the_key(tmp_path: Path):
    out = _launch(tmp_path, "--set", "learner.algorithm=a2c", "--set", "ray.num_cpus=1")
    assert out["RAY_STARTED"] == "1"  # started while the modules imported
    assert "learner.algorithm" in out["ERROR"] and "'a2c'" in out["ERROR"]
    assert out["RAY_UP"] == "False"
    assert not (tmp_path / "run").exists()  # nothing of the job was written


def test_a_ray_section_that_is_not_plain_starts_no_ray_before_the_config_is_checked(
    tmp_path: Path,
):
    out = _launch(tmp_path, "--set", "ray.num_cpus=two")
    assert out["RAY_STARTED"] == "0"
    assert "ray.num_cpus" in out["ERROR"]
    assert out["RAY_UP"] == "False"


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
    out = _launch(tmp_path, "--set", f"env.id={env}", config=CONFIG.parent / config)
    assert out["RAY_STARTED"] == "0"
    assert out["ERROR"] == f"learner.algorithm: {message}" or message in out["ERROR"]
    assert out["RAY_UP"] == "False"
