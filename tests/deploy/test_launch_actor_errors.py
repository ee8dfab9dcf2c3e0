"""An error raised inside a Ray actor reaches the user of ``millpond launch`` as a millpond
error with its message: no Ray traceback, no terminal colour codes, no internal errors of the
shutdown before it; and the job's times count from the command's own start.

Starts Ray (one job, ~30-60 s on a small machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "configs" / "cartpole-ppo.yaml"


def test_a_learners_refusal_reaches_the_user_plainly(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "millpond.cli",
        "launch",
        str(CONFIG),
        # The service refuses a PPO batch larger than the queue: the learner's first sample.
        *("--set", "learner.ppo.batch_size=4096", "--set", "learner.ppo.minibatch_size=512"),
        *("--set", "ray.num_cpus=2"),
        *("--run-dir", str(run_dir)),
    ]
    sleep_s = 5  # a shell busy before it runs the command (`pip install ... && millpond ...`)
    before = time.time()
    result = subprocess.run(
        ["bash", "-c", f'sleep {sleep_s} && exec "$@"', "bash", *command],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    ran_s = time.time() - before - sleep_s
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("millpond: error: learner 0: batch_size (4096)"), output[-3000:]
    assert "exceeds the capacity of table 'rollouts' (2048 slots)" in last
    assert "\x1b[" not in output  # no colour codes anywhere
    assert "Traceback" not in output and "RayTaskError" not in output
    assert "shutdown:" not in output  # no step of the shutdown failed
    assert "Token authentication is enabled" not in output  # on, and not said at every start
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "error"
    # counted from the command's start, not the shell's
    assert 0 < summary["startup_s"]["imports"] < summary["stopped_at_s"] <= ran_s
    assert before + sleep_s <= summary["started_at"] <= before + sleep_s + ran_s
