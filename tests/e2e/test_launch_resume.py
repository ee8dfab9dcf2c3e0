"""`millpond launch --resume RUN_DIR`: a stopped job continues where it stopped.

The real CLI on a local Ray instance: a short CartPole job runs to its frame budget, then
is resumed with a larger one. The references are independent of the resume code: the
first run's summary and metrics, the checkpoint file, and the table's slot metadata read
from the shard's directory on disk.
"""

import csv
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DQN = ROOT / "deploy" / "configs" / "cartpole-dqn.yaml"

pytestmark = pytest.mark.timeout(400)


def launch(*args, timeout=300):
    script = Path(sys.executable).parent / "millpond"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "millpond.cli"]
    return subprocess.run(
        [*command, "launch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def stored(run_dir: Path) -> dict:
    """The table's stored segments, read from the shard's files (the job has stopped)."""
    from millpond.service.table import Table
    from millpond.testing import stored_segments

    table = Table.open(run_dir / "replay" / "shard-0" / "tables" / "replay")
    try:
        return stored_segments(table)
    finally:
        table.close()


def test_a_stopped_job_resumes_from_its_checkpoint_shards_and_counters(tmp_path):
    run_dir = tmp_path / "run"
    common = ("--set", "ray.num_cpus=2", "--set", "run.status_every_s=1")
    common += ("--set", "actors.num_actors=2")  # numbered 0 and 1, then 2 and 3
    first = launch(
        DQN,
        *common,
        *("--set", "run.frames=3000", "--set", "replay.table.capacity=20000"),
        *("--set", "replay.table.min_size=300", "--set", "replay.table.samples_per_insert=null"),
        *("--set", "replay.table.error_buffer=null"),
        *("--set", "actors.epsilon_decay_frames=2000", "--run-dir", run_dir),
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = json.loads((run_dir / "summary.json").read_text())
    assert before["stopped_by"] == "frames" and before["frames"] >= 3000
    assert before["next_actor_index"] == 2 and before["resumes"] == []
    rows_before = metrics(run_dir)
    segments_before = stored(run_dir)
    version_before = torch.load(run_dir / "checkpoint.pt", weights_only=False)["version"]
    assert version_before == before["weights_version"] > 0

    # A different incompatible config is refused, naming what differs; nothing changes.
    refused = launch(DQN, *common, "--resume", run_dir)
    assert refused.returncode == 2
    assert "replay.table.capacity: 20000 in the run, 11000 now" in refused.stderr
    assert json.loads((run_dir / "summary.json").read_text()) == before

    second = launch("--resume", run_dir, *common, "--set", "run.frames=6000")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resume: run.frames: 3000 -> 6000" in second.stdout
    after = json.loads((run_dir / "summary.json").read_text())
    assert after["stopped_by"] == "frames" and after["frames"] >= 6000
    assert after["resumes"] == [
        {
            "frames": before["frames"],
            "episodes": before["episodes"],
            "weights_version": version_before,
            "learner_steps": before["learner_steps"],
        }
    ]
    assert after["episodes"] > before["episodes"]
    assert after["learner_steps"] > before["learner_steps"]
    # The weight version went on from the checkpoint's, not from 0.
    assert after["weights_version"] > version_before
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["version"] == after["weights_version"]
    assert after["next_actor_index"] == 4  # the resumed job's actors were numbered 2 and 3

    # metrics.csv: the first run's rows kept, then the second's, counting frames on.
    rows = metrics(run_dir)
    assert rows[: len(rows_before)] == rows_before
    new = rows[len(rows_before) :]
    assert new, "the resumed run appended no rows"
    frames = [int(r["frames"]) for r in rows]
    assert frames == sorted(frames) and frames[-1] == after["frames"]
    assert int(new[0]["frames"]) >= before["frames"]
    times = [float(r["time_s"]) for r in rows]
    assert times == sorted(times)

    # No episode id was used twice: no two stored segments of one episode overlap (a
    # repeated id would store its steps 0, 1, ... again), and every episode of the resumed
    # actors is whole from step 0, its segments following each other.
    segments = stored(run_dir)
    by_episode: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for episode, first_step, length, _ in segments:
        by_episode[episode].append((first_step, length))
    for episode, parts in by_episode.items():
        parts.sort()
        expected = 0
        for first_step, length in parts:
            assert first_step >= expected, f"episode {episode:#x} stored twice: {parts}"
            if episode >> 44 >= 2:
                assert first_step == expected, f"episode {episode:#x} stitched or torn: {parts}"
            expected = first_step + length
    actors = {episode >> 44 for episode in by_episode}
    assert actors == {0, 1, 2, 3}, actors  # the first run's actors 0, 1; the resumed 2, 3
    new_steps = sum(k[2] for k in set(segments) - set(segments_before))
    assert new_steps > 0.5 * (after["frames"] - before["frames"]), (new_steps, after)
    # The shard reopened its table: every segment the first run stored is still there
    # (nothing is evicted: the table holds both runs).
    lost = set(segments_before) - set(segments)
    assert not lost, f"the reopened shard overwrote {len(lost)} segments stored before the stop"
