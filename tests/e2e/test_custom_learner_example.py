"""``examples/custom_learner.py``, run exactly as its docstring says, against a real server.

A ``millpond serve`` subprocess (one shard, then ``--shards 2``) and the example as a second
subprocess (``python examples/custom_learner.py --replay ADDR --frames N``): it must exit 0,
print its progress and final lines, leave its experience in the server's table (checked
with a client of our own), have its actor pick up the weights it published, and, with one
shard and enough frames, beat a random CartPole policy (mean return about 22).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from millpond import ReplayClient

pytest.importorskip("torchrl")  # the example's loss; a dev/bench extra, not a dependency

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_learner.py"
TABLE = "custom-learner-dqn"  # the example's default table name
RANDOM_RETURN = 22.0  # mean CartPole-v1 return of uniformly random actions

PROGRESS = re.compile(
    r"^frames +(\d+) +episodes +(\d+) +mean return +(\S+) +loss +(\S+) +weights v(-?\d+)$", re.M
)
HOLDS = re.compile(r"^table '([^']+)' holds (\d+) steps \(per shard: \[([^\]]*)\]\)$", re.M)
FINAL = re.compile(r"^mean return (\S+) over the last (\d+) episodes$", re.M)


def run_example(address: str, frames: int) -> str:
    """Run the example as a user would; returns its stdout (asserting it exited 0)."""
    cmd = [sys.executable, str(EXAMPLE.relative_to(ROOT)), "--replay", address]
    cmd += ["--frames", str(frames)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def check_output(stdout: str, address: str, frames: int) -> float:
    """The printed lines agree with what the server holds; returns the final mean return."""
    progress = PROGRESS.findall(stdout)
    assert progress, f"no progress line in:\n{stdout}"
    assert [int(p[0]) for p in progress] == sorted(int(p[0]) for p in progress)
    assert int(progress[-1][4]) >= 1, "the actor never loaded weights the learner published"
    holds = HOLDS.search(stdout)
    final = FINAL.search(stdout)
    assert holds and final, f"final lines missing in:\n{stdout}"
    assert holds.group(1) == TABLE
    stored = int(holds.group(2))
    assert stored >= frames
    assert int(final.group(2)) > 0
    with ReplayClient(address, timeout_s=30) as client:
        info = client.info(TABLE)
    assert info["size"] == info["inserts"] == stored  # every collected step, once
    assert [int(s) for s in holds.group(3).split(",")] == [s["size"] for s in info["shards"]]
    assert len(info["shards"]) == len(address.split(","))
    assert info["samples"] > info["inserts"]  # the learner sampled (32 per step after warm-up)
    assert info["weights_version"] >= int(progress[-1][4])
    return float(final.group(1))


@pytest.mark.slow
def test_example_learns_cartpole_on_one_shard(start_server) -> None:
    address = start_server(1)
    frames = 8_000
    mean_return = check_output(run_example(address, frames), address, frames)
    assert mean_return > 2 * RANDOM_RETURN, f"mean return {mean_return}: the learner did not learn"


@pytest.mark.slow
def test_example_runs_on_two_shards(start_server) -> None:
    address = start_server(2)
    frames = 2_048  # past the example's warm-up (1000 frames): it trains and publishes
    check_output(run_example(address, frames), address, frames)
