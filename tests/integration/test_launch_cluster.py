"""``millpond launch`` on a multi-node Ray cluster on this machine (``ray.cluster_utils``):
shards, env actors and the learner each placed on their own node by custom resources."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from millpond.deploy.launch import Launch
from millpond.deploy.launch_config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
ROLES = {"replay": "replay_node", "actors": "env_node", "learners": "learner_node"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(ray_cluster):
    """A head that runs nothing of the job, one node per role, and a spare env node and
    learner node."""
    nodes = [{"num_cpus": 1, "resources": {resource: 1}} for resource in ROLES.values()]
    spares = [{"num_cpus": 1, "resources": {r: 1}} for r in ("env_node", "learner_node")]
    c, added = ray_cluster({"num_cpus": 0}, [*nodes, *spares])
    return c, added[-2:]


def test_roles_run_where_their_resources_say_and_the_job_survives_losing_nodes(cluster, tmp_path):
    """The actors' node and the learner's node are removed mid-run: the actor restarts on
    the spare env node, the learner on the spare learner node, and the job finishes (a PPO
    job cannot reach its frames without a learner: its queue holds the actors back)."""
    import threading
    import time

    cluster, spares = cluster
    spare_ids = {n.node_id for n in spares}
    node_of = {
        resource: n["NodeID"]
        for n in ray.nodes()
        for resource in ("replay_node",)
        if n["Alive"] and resource in n["Resources"] and n["NodeID"] not in spare_ids
    }
    learner_nodes = {n["NodeID"] for n in ray.nodes() if "learner_node" in n["Resources"]}
    overrides = [
        f"ray.address={cluster.address}",
        *("run.frames=8000", "run.status_every_s=1", "actors.num_actors=1"),
        *("actors.resources={env_node: 1}", "learner.resources={learner_node: 1}"),
        "replay.resources={replay_node: 1}",
    ]
    config = load_config(CONFIGS / "cartpole-ppo.yaml", overrides)
    launch = Launch(config, run_dir=tmp_path / "run")
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(launch.run()), daemon=True)
    job.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        launch._fleet is None or launch._fleet.status.frames == 0
    ):
        time.sleep(0.2)
    assert launch._fleet is not None and launch._fleet.status.frames > 0, "no experience"
    (first,) = ray.get(launch._node_refs["actors"])
    (learner,) = launch._nodes["learners"]
    nodes = list(cluster.worker_nodes)
    cluster.remove_node(next(n for n in nodes if n.node_id == first["node_id"]))
    cluster.remove_node(next(n for n in nodes if n.node_id == learner["node_id"]))
    job.join(timeout=240)
    assert not job.is_alive()
    assert result["stopped_by"] == "frames" and result["actor_restarts"] >= 1, result
    assert result["learner_restarts"] == 1, result
    assert result["learner_steps"] > 0
    assert {p["node_id"] for p in result["nodes"]["replay"]} == {node_of["replay_node"]}
    (restarted,) = result["nodes"]["learners"]
    assert restarted["node_id"] in learner_nodes - {learner["node_id"]}  # the other one
    assert learner["node_id"] in learner_nodes
    driver = result["nodes"]["driver"]["node_id"]
    assert driver not in {n.node_id for n in nodes}  # the head: it runs nothing of the job
    assert (tmp_path / "run" / "checkpoint.pt").exists()
