"""``millpond launch`` losing a replay shard: its process killed (Ray restarts it on its node
and directory, on a new port that the clients find), or its node removed from a multi-node
cluster on this machine (the job goes on with the other shards and says so).

The references are independent of the fault handling: the shard's process id, the steps
the shard had acknowledged before the kill (read back from its directory on disk, where
every stored segment must be whole), and the cluster's own node ids.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from pathlib import Path
from urllib.request import urlopen

import pytest
import ray

from millpond.deploy.launch import Launch
from millpond.deploy.launch_config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"

pytestmark = pytest.mark.timeout(300)


def start_job(
    run_dir: Path, config_file: str, overrides: list[str]
) -> tuple[Launch, io.StringIO, threading.Thread, dict]:
    """``launch`` of ``config_file`` run in a thread, once its actors have sent experience:
    the launch, its output, the thread and (once it ends) its summary."""
    out = io.StringIO()
    launch = Launch(load_config(CONFIGS / config_file, overrides), run_dir=run_dir, out=out)
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(launch.run()), daemon=True)
    job.start()
    wait_for(
        lambda: launch._fleet is not None and launch._fleet.status.frames >= 1500,
        150,
        "experience",
    )
    return launch, out, job, result


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def local_ray(start_local_ray):
    start_local_ray(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_a_killed_shard_restarts_on_its_directory_and_the_job_finishes(local_ray, tmp_path):
    from millpond.service.table import Table
    from millpond.testing import stored_segments

    overrides = [
        *("run.frames=6000", "run.status_every_s=1", "run.stop_at_return=null"),
        *("replay.table.capacity=20000", "replay.table.min_size=300"),
        *("replay.table.samples_per_insert=null", "replay.table.error_buffer=null"),
        "replay.metrics_port=0",
    ]
    launch, out, job, result = start_job(tmp_path / "run", "cartpole-dqn.yaml", overrides)
    shard = launch._shards.actors[0]
    before = ray.get(shard.status.remote())
    # replay.metrics_port=0: the shard serves Prometheus metrics where the driver records.
    (recorded,) = launch._shards.watch.summary()["shards"]
    assert recorded["metrics"] == before["metrics"] and recorded["node_id"] == before["node_id"]
    with urlopen(f"http://{recorded['metrics']}/metrics", timeout=10) as response:
        assert 'millpond_inserted_steps_total{table="replay"}' in response.read().decode()
    acknowledged = launch.client.info("replay")["inserts"]
    assert acknowledged > 0
    os.kill(before["pid"], signal.SIGKILL)

    job.join(timeout=200)
    assert not job.is_alive(), out.getvalue()[-3000:]
    assert result["stopped_by"] == "frames", out.getvalue()[-3000:]
    assert result["frames"] >= 6000 and result["learner_steps"] > 0
    assert result["shard_restarts"] == 1, out.getvalue()[-3000:]
    assert result["shards"]["live"] == 1 and not result["shards"]["lost"]
    assert "replay shard 0 restarted on its node" in out.getvalue()
    (entry,) = result["shards"]["shards"]
    assert entry["restarts"] == 1 and entry["node_id"] == before["node_id"]
    assert entry["address"] != before["address"]  # a new port, found by every client
    assert entry["metrics"] and entry["metrics"].startswith("127.0.0.1:")

    # The restarted shard reopened its directory: what it had acknowledged before the kill
    # is still stored there (nothing was evicted: the table holds the whole run), in whole
    # segments, and more came after the restart.
    table = Table.open(tmp_path / "run" / "replay" / "shard-0" / "tables" / "replay")
    try:
        stored = sum(length for _, _, length, _ in stored_segments(table))
    finally:
        table.close()
    assert stored >= acknowledged
    assert stored > acknowledged + 1000


@pytest.fixture
def cluster(ray_cluster):
    """A head that runs the env actors and the learner, and one node per replay shard."""
    c, _ = ray_cluster(
        {"num_cpus": 2, "resources": {"env_node": 2, "learner_node": 1}},
        [{"num_cpus": 1, "resources": {"replay_node": 1}}] * 2,
    )
    return c


def test_losing_shard_0s_node_leaves_the_job_going_on_with_fewer_shards(cluster, tmp_path):
    """Shard 0 is the harder one to lose: it is also the weights rendezvous, which moves to
    shard 1 with it gone (the learner publishes there, the actors fetch from there)."""
    overrides = [
        f"ray.address={cluster.address}",
        *("run.frames=40000", "run.status_every_s=1", "run.stop_at_return=null"),
        *("replay.shards=2", "replay.resources={replay_node: 1}"),
        *("actors.num_actors=2", "actors.resources={env_node: 1}"),
        "learner.resources={learner_node: 1}",
    ]
    launch, out, job, result = start_job(tmp_path / "run", "cartpole-ppo.yaml", overrides)
    statuses = ray.get([s.status.remote() for s in launch._shards.actors])
    assert statuses[0]["node_id"] != statuses[1]["node_id"]  # one shard per replay node
    victim = next(n for n in cluster.worker_nodes if n.node_id == statuses[0]["node_id"])
    frames_then = launch._fleet.status.frames
    version_then = launch.version
    cluster.remove_node(victim)  # shard 0 goes with its node, and the rendezvous to shard 1
    # The last version the job knew of when it saw shard 0 lost (seconds after the node went):
    # every later one was published with shard 0 gone, so on shard 1.
    deadline = time.monotonic() + 120
    while "is lost for good" not in out.getvalue() and job.is_alive():
        assert time.monotonic() < deadline, out.getvalue()[-3000:]
        time.sleep(0.1)
    version_lost = launch.version

    job.join(timeout=220)
    assert not job.is_alive(), out.getvalue()[-3000:]
    said = out.getvalue()
    assert result["stopped_by"] == "frames", said[-3000:]
    assert result["frames"] >= 40000 > frames_then
    assert result["shards"]["count"] == 2 and result["shards"]["live"] == 1, result["shards"]
    assert list(result["shards"]["lost"]) == ["0"]
    assert "replay shard 0" in said and "is lost for good" in said, said[-3000:]
    assert "shards 1/2" in said, said[-3000:]  # the progress lines say so
    assert result["learner_steps"] > 0
    # Actor 0, pinned to shard 0, wrote on to shard 1 (new episodes there); actor 1 stayed.
    actors = launch._fleet.status.actors
    assert actors[0]["lost_shards"] == [0] and actors[0]["shard"] == 1, actors[0]
    assert actors[1]["lost_shards"] == [] and actors[1]["shard"] == 1
    # The learner went on publishing, on shard 1 (shard 0 was gone), and the actors fetched
    # those weights from there: both acted with a version published after the loss. (How
    # close they end to the last version depends on the learner's pace as the job drains:
    # max_policy_lag bounds what the learner trains on, not what an actor holds.)
    assert result["weights_version"] >= version_then + 10, (version_then, result)
    assert version_lost is not None and result["weights_version"] > version_lost
    for a in (actors[0], actors[1]):
        assert a["policy_version"] > version_lost, (version_lost, a, result)
