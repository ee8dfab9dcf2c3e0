"""`millpond launch` end to end: the real CLI, a local Ray instance, real shards and actors."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from millpond.deploy import ray_start
from tests.deploy._cores import assert_learners_hold_their_cores

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "deploy" / "configs" / "cartpole-ppo.yaml"
DQN = ROOT / "deploy" / "configs" / "cartpole-dqn.yaml"
SMALL = ["--set", "ray.num_cpus=2", "--set", "run.status_every_s=1", "--set", "actors.num_actors=2"]

pytestmark = pytest.mark.timeout(400)


def millpond_command() -> list[str]:
    script = Path(sys.executable).parent / "millpond"  # the installed console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "millpond.cli"]


def launch(*args, timeout=300):
    return subprocess.run(
        [*millpond_command(), "launch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def start_endless_job(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """A small PPO job with no frame budget or return target: it runs until stopped."""
    return subprocess.Popen(
        [
            *millpond_command(),
            *("launch", str(PPO), *SMALL, "--set", "run.frames=100000000"),
            *("--set", "run.stop_at_return=null", *overrides, "--run-dir", str(run_dir)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def wait_until_experience_flows(proc: subprocess.Popen, timeout_s: float = 180) -> list[str]:
    """Read the job's output up to its first progress line that counts frames; the lines."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        lines.append(line)
        progress = re.match(r"\[\s*[\d.]+s\] frames\s+(\d+)", line)  # not Ray's log lines
        if progress and int(progress.group(1)) > 0:
            return lines
    pytest.fail("no progress line:\n" + "".join(lines))


def random_policy_return(episodes=200, seed=0) -> float:
    """CartPole-v1's mean return under uniformly random actions (about 22)."""
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    returns = []
    for i in range(episodes):
        env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(int(rng.integers(2)))
            total += reward
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def test_ppo_job_learns_and_leaves_a_complete_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(PPO, *SMALL, "--set", "run.frames=40000", "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    progress = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert progress and all("fps" in line and "return" in line for line in progress)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "frames" and summary["frames"] >= 40000
    # Each iteration publishes, except one whose steps were all too old to train on (the
    # actors may fill the queue faster than the first iterations run on a busy machine).
    assert summary["learner_steps"] > 0 and summary["stale_steps"] >= 0
    trained = summary["weights_version"]  # version 0: the weights the actors start with
    assert summary["learner_steps"] - summary["stale_steps"] <= trained <= summary["learner_steps"]
    assert summary["mean_return"] > 2 * random_policy_return(), summary
    # When it stopped: after its start, and before its shutdown's final counters were read.
    started = summary["startup_s"]["actors"]
    assert started < summary["stopped_at_s"] < started + summary["wall_s"] + 1
    # A queue table's batches travel with their rows (colocated reads are for replay tables).
    assert [r["colocated_shards"] for r in summary["learners"]] == [[]], summary["learners"]
    assert_learners_hold_their_cores(summary)  # learner.pin_cores: auto
    if len(os.sched_getaffinity(0)) >= 2:
        assert "(learner.pin_cores)" in result.stdout

    rows = (run_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {
        "frames",
        "frames_per_s",
        "mean_return",
        "samples_per_insert",
        "acting_lag",
        "sample_age",
    } <= set(header)
    assert len(rows) >= 3  # header, progress rows, the final row
    frames = [int(r.split(",")[header.index("frames")]) for r in rows[1:]]
    assert frames == sorted(frames) and frames[-1] == summary["frames"]
    assert (run_dir / "return.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same rows as TensorBoard scalars (run.tensorboard: auto; tensorboard is installed)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["algorithm"] == "ppo" and checkpoint["version"] == summary["weights_version"]
    assert {"policy", "critic", "optimizer"} <= set(checkpoint)
    assert (run_dir / "config.yaml").exists()
    assert list((run_dir / "replay").glob("shard-0/*")), "the shard left its checkpoint"


def test_sac_job_on_pendulum_improves_its_return(tmp_path):
    """SAC on Box actions end to end, on a small budget: 5,000 frames of pendulum-sac.yaml
    with 64-wide networks take the mean return of the last 5 episodes well above a random
    policy's (about -1,200), and leave SAC's networks in the checkpoint."""
    run_dir = tmp_path / "run"
    sac = ROOT / "deploy" / "configs" / "pendulum-sac.yaml"
    small = ["learner.hidden_sizes=[64,64]", "run.frames=5000", "run.return_window=5"]
    small += ["run.stop_at_return=null", "ray.num_cpus=2", "run.status_every_s=2"]
    result = launch(sac, *[a for s in small for a in ("--set", s)], "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "frames" and summary["episodes"] >= 25
    assert summary["mean_return"] > -700, summary
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["algorithm"] == "sac"
    assert {"policy", "critic", "target_critic", "temperature", "optimizer"} <= set(checkpoint)


def test_sigterm_stops_the_job_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_endless_job(run_dir)
    try:
        wait_until_experience_flows(proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["frames"] > 0
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "metrics.csv").exists()
    assert "shutting down cleanly" in out


def test_dqn_job_uses_a_running_serve_with_two_shards(tmp_path, start_server):
    address = start_server(2)
    run_dir = tmp_path / "run"
    result = launch(
        DQN,
        *SMALL,
        *("--set", "run.frames=8000", "--set", "replay.table.min_size=500"),
        *("--replay", address, "--run-dir", run_dir),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "frames" and summary["learner_steps"] > 0
    assert not (run_dir / "replay").exists(), "no shards of its own with --replay"
    # The learner runs on the shards' host: it read both shards' rows from their files.
    assert [r["colocated_shards"] for r in summary["learners"]] == [[0, 1]], summary["learners"]
    # The shipped config bounds the acting lag (max_policy_lag): in versions, and in
    # gradient steps, publish_every apart.
    dqn = yaml.safe_load(DQN.read_text())["learner"]["dqn"]
    assert 0 <= summary["acting_lag"] <= summary["acting_lag_max"] <= dqn["max_policy_lag"]
    every = dqn["publish_every"]
    assert summary["acting_lag_steps"] == pytest.approx(every * summary["acting_lag"]), summary

    from millpond import ReplayClient

    client = ReplayClient(address)
    info = client.info("replay")
    assert len(info["shards"]) == 2
    assert all(s["size"] > 0 for s in info["shards"])  # actor i writes to shard i % 2
    assert info["samples"] <= 12.8 * info["inserts"] + 2 * 4000  # the rate limiter held
    assert info["weights_version"] == summary["weights_version"]  # the learner published here
    client.close()


def test_shards_that_cannot_be_placed_fail_with_a_clear_error(tmp_path):
    # 2 shards x 4 CPUs on a 2-CPU local instance: Ray would wait for them forever.
    result = launch(
        PPO,
        *SMALL,
        *("--set", "replay.shards=2", "--set", "replay.num_cpus=4"),
        *("--set", "replay.start_timeout_s=3", "--run-dir", tmp_path / "run"),
        timeout=120,
    )
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "replay shards did not start within replay.start_timeout_s=3 s" in result.stderr
    assert "8 CPUs" in result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "error"


def test_a_token_protected_serve_takes_the_token_file(tmp_path, start_server):
    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-token-1\nwriter writer-token-1\nlearner learner-token-1\n")
    address = start_server(1, "--token-file", str(tokens))
    # Every step the actors took is stored, none left in a writer when the job stops: the
    # learner goes on sampling while the actors flush into the queue (2,048 slots), which a
    # slow learner (60 epochs an update) leaves full when the frames are reached.
    slow = ["--set", "learner.ppo.epochs=60"]
    job = [PPO, *SMALL, *slow, "--set", "run.frames=4000", "--replay", address]

    denied = launch(*job, "--run-dir", tmp_path / "denied", timeout=120)
    assert denied.returncode == 2, denied.stdout[-3000:] + denied.stderr[-3000:]
    assert "give replay.token_file an 'admin' token" in denied.stderr.splitlines()[-1]

    run_dir = tmp_path / "run"
    result = launch(*job, "--set", f"replay.token_file={tokens}", "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "frames" and summary["learner_steps"] > 0

    from millpond import ReplayClient

    client = ReplayClient(address, token="admin-token-1")
    info = client.info("rollouts")
    assert info["inserts"] == summary["frames"] >= 4000, (info, summary, result.stdout[-4000:])
    assert info["weights_version"] == summary["weights_version"]
    client.close()


def test_shards_the_job_starts_require_the_token_file_too(tmp_path):
    from millpond import AuthenticationError, ReplayClient

    tokens = tmp_path / "tokens"
    tokens.write_text("admin admin-token-1\nwriter writer-token-1\n")
    proc = start_endless_job(tmp_path / "run", "--set", f"replay.token_file={tokens}")
    try:
        lines = wait_until_experience_flows(proc)  # actors insert with the writer token
        address = next(line.split()[1] for line in lines if line.startswith("replay: "))
        with pytest.raises(AuthenticationError):
            ReplayClient(address).info("rollouts")
        admin = ReplayClient(address, token="admin-token-1")
        assert admin.info("rollouts")["inserts"] > 0
        admin.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]


@pytest.fixture
def other_ray_cluster():
    """A Ray head of its own on this machine (``ray start --block``), its address; stopped
    with its whole process group afterwards."""
    import os
    import shutil
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A short temp dir of its own: Ray's socket paths must stay short, and other Ray users on
    # this machine must not find this head as "the last cluster started".
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    ray_cli = Path(sys.executable).parent / "ray"
    proc = subprocess.Popen(
        [
            *(str(ray_cli), "start", "--head", f"--port={port}", "--num-cpus=1", "--block"),
            *("--include-dashboard=false", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the GCS listens once the head is up
            with socket.socket() as s, contextlib.suppress(OSError):
                s.connect(("127.0.0.1", port))
                break
            assert proc.poll() is None, "ray start failed"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the head's GCS and raylet are in its group
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_without_address_the_job_starts_its_own_ray_even_beside_another_cluster(
    tmp_path, other_ray_cluster
):
    import os

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            *(*millpond_command(), "launch", str(PPO), *SMALL, "--set", "run.frames=2000"),
            *("--run-dir", str(run_dir)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": other_ray_cluster},  # what `ray.init()` would join
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ray"]["gcs_address"], summary
    assert summary["ray"]["gcs_address"] != other_ray_cluster


def test_two_data_parallel_learners_step_together_and_one_publishes(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(
        PPO,
        *("--set", "ray.num_cpus=2", "--set", "run.status_every_s=1"),
        *("--set", "actors.num_actors=1", "--set", "learner.num_learners=2"),
        *("--set", "run.frames=12000", "--run-dir", run_dir),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 ppo learners on cpu" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "frames" and summary["num_learners"] == 2
    first, second = sorted(summary["learners"], key=lambda r: r["rank"])
    assert first["steps"] > 0 and first["steps"] == second["steps"] == summary["learner_steps"]
    assert first["parameters_sha256"] == second["parameters_sha256"]  # the ranks agree
    assert first["version"] == second["version"] == summary["weights_version"]
    # Rank 0 sent the initial weights and every trained iteration's; rank 1 sent none.
    assert first["published"] == summary["weights_version"] + 1 and second["published"] == 0
    assert [r["rank"] for r in summary["nodes"]["learners"]] == [0, 1]
    assert all(n["node_id"] for n in summary["nodes"]["replay"] + summary["nodes"]["actors"])
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["num_learners"] == 2 and checkpoint["version"] == summary["weights_version"]


def _descendants_named(root: int, prefix: str) -> list[int]:
    """Processes below ``root`` whose command line starts with ``prefix`` (Linux /proc)."""
    found = []
    for pid in ray_start.descendants(root):
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if name.startswith(prefix):
                found.append(pid)
    return found


def test_a_lost_learner_restarts_once_from_the_checkpoint_then_the_job_stops_cleanly(tmp_path):
    import os

    run_dir = tmp_path / "run"
    proc = start_endless_job(run_dir)  # learner.max_restarts: 1 by default
    lines: list[str] = []
    try:
        wait_until_experience_flows(proc)
        (learner,) = _descendants_named(proc.pid, "ray::LearnerActor")
        os.kill(learner, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            lines.append(proc.stdout.readline())
            if "restarting the learners from checkpoint.pt" in lines[-1]:
                break
        for _ in range(4):  # a few progress lines of the new learner
            lines.append(proc.stdout.readline())
        (learner,) = _descendants_named(proc.pid, "ray::LearnerActor")
        os.kill(learner, signal.SIGKILL)  # restarts spent: the job stops
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 2, out[-3000:]
    assert "restart 1 of 1" in out, out[-3000:]
    assert "learner 0 died" in out and "learner.max_restarts=1 are spent" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_restarts"] == 1 and summary["stopped_by"] == "error"
    assert summary["frames"] > 0 and summary["learner_steps"] > 0
    assert summary["checkpoint"] and (run_dir / "checkpoint.pt").exists()
    assert (run_dir / "metrics.csv").exists() and (run_dir / "config.yaml").exists()
    assert list((run_dir / "replay").glob("shard-0/*")), "the shards were still checkpointed"
