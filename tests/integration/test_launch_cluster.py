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
    """A head that runs nothing of the job, one node per role and a spare env node."""
    nodes = [{"num_cpus": 1, "resources": {resource: 1}} for resource in ROLES.values()]
    c, added = ray_cluster({"num_cpus": 0}, [*nodes, {"num_cpus": 1, "resources": {"env_node": 1}}])
    return c, added[-1]


def test_roles_run_where_their_resources_say_and_the_job_survives_losing_the_actors_node(
    cluster, tmp_path
):
    import threading
    import time

    cluster, spare = cluster
    node_of = {
        resource: n["NodeID"]
        for n in ray.nodes()
        for resource in ROLES.values()
        if n["Alive"] and resource in n["Resources"] and n["NodeID"] != spare.node_id
    }
    overrides = [
        f"ray.address={cluster.address}",
        *("run.frames=6000", "run.status_every_s=1", "actors.num_actors=1"),
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
    victim = next(n for n in [*cluster.worker_nodes, spare] if n.node_id == first["node_id"])
    cluster.remove_node(victim)  # the actor restarts on the other env node
    job.join(timeout=200)
    assert not job.is_alive()
    assert result["stopped_by"] == "frames" and result["actor_restarts"] >= 1, result
    assert result["learner_steps"] > 0
    for role in ("replay", "learners"):
        resource = ROLES[role]
        assert {p["node_id"] for p in result["nodes"][role]} == {node_of[resource]}, role
    assert first["node_id"] in (node_of["env_node"], spare.node_id)
    assert result["nodes"]["driver"]["node_id"] not in [*node_of.values(), spare.node_id]
    assert (tmp_path / "run" / "checkpoint.pt").exists()
