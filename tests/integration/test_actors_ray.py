"""Env actors on a real local Ray instance writing to a real `millpond serve`."""

import functools
import time

import numpy as np
import pytest
import ray
import torch

from millpond import ReplayClient, TableConfig
from millpond.actors.fleet import ActorFleet
from millpond.actors.ray_actor import ActorConfig
from millpond.testing import make_counting_vector_env

LANES = 4


@pytest.fixture(scope="module")
def ray_cluster(start_local_ray):
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def drain(client, table):
    """Every stored step exactly once (a queue table delivers each step once)."""
    batches = []
    while True:
        size = client.info(table)["size"]
        if size == 0:
            break
        batches.append(client.sample(table, min(size, 4096), timeout_s=10))
    return torch.cat(batches) if batches else None


def check_consistent(steps):
    """Counting-env observations encode (env episode, step): each next obs is the step after."""
    state, next_state = steps["state"], steps["next", "state"]
    assert torch.equal(next_state[:, 0], state[:, 0]), "a step and its next obs are of one episode"
    assert torch.equal(next_state[:, 1], state[:, 1] + 1), "next obs is the following step"
    pairs = set(zip(steps["episode_id"].tolist(), steps["step"].tolist()))
    assert len(pairs) == len(steps), "no (episode, step) stored twice"


def counting_config(table, **kwargs):
    return ActorConfig(
        env=functools.partial(make_counting_vector_env, LANES, pixel_shape=(1, 8, 8)),
        table=table,
        num_envs=LANES,
        chunk_len=16,
        **kwargs,
    )


def test_two_actors_fill_the_service(ray_cluster, module_server):
    server = module_server()
    client = ReplayClient(server.address)
    client.create_table(TableConfig.queue("fleet", 100_000))
    fleet = ActorFleet(client, counting_config("fleet", seed=0), num_actors=2, num_cpus=0.5)
    lines = []
    status = fleet.run(frames=600, on_status=lambda s: lines.append(s.line()), timeout_s=120)
    final = fleet.stop()
    assert status.frames >= 600 and final.episodes > 0 and final.mean_return is not None
    assert sorted(final.actors) == [0, 1]
    assert all(a["frames"] > 0 for a in final.actors.values())
    assert lines and "frames" in lines[-1]
    steps = drain(client, "fleet")
    assert len(steps) == final.frames  # every collected step stored, once
    assert len(steps) == sum(a["steps_written"] for a in final.actors.values())
    check_consistent(steps)
    bases = {int(e) >> 44 for e in steps["episode_id"].unique()}
    assert bases == {0, 1}  # episode ids carry the actor index
    client.close()


def fleet_on_a_queue(module_server, table: str, seed: int, **options):
    """A client of a new server holding queue ``table``, and a fleet of counting envs."""
    client = ReplayClient(module_server().address)
    client.create_table(TableConfig.queue(table, 100_000))
    return client, ActorFleet(client, counting_config(table, seed=seed), num_cpus=0.5, **options)


def test_a_call_of_seconds_collects_whole_chunks_until_they_have_passed(ray_cluster, module_server):
    client, fleet = fleet_on_a_queue(
        module_server, "timed", seed=3, num_actors=1, seconds_per_call=0.5
    )
    actor = fleet.actors[0]
    chunk = LANES * 16
    report = ray.get(actor.run.remote(1, 0.5))
    assert report["elapsed_s"] >= 0.5
    # a counting env's chunk takes milliseconds: many in half a second, each whole
    assert report["new_frames"] > chunk and report["new_frames"] % chunk == 0
    assert ray.get(actor.run.remote(2))["new_frames"] == 2 * chunk  # no seconds: two chunks
    status = fleet.run(frames=3 * chunk, timeout_s=120)  # the fleet's calls take the seconds
    final = fleet.stop()
    assert status.frames >= 3 * chunk
    steps = drain(client, "timed")
    # every step the actor collected, in the calls above and the fleet's, stored once
    assert len(steps) == final.actors[0]["frames"] == final.actors[0]["steps_written"]
    check_consistent(steps)
    client.close()


def test_killed_actor_restarts_with_fresh_ids_and_no_duplicates(ray_cluster, module_server):
    client, fleet = fleet_on_a_queue(module_server, "restart", seed=1, num_actors=2, max_restarts=2)
    fleet.run(frames=300, timeout_s=120)
    deadline = time.monotonic() + 120
    while fleet.status.actors.get(0, {}).get("segments_acked", 0) < 4:  # first life stored data
        assert time.monotonic() < deadline, "actor 0 never reported"
        fleet.poll(timeout_s=1.0)
    ray.kill(fleet.actors[0], no_restart=False)  # a crash: Ray restarts it
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fleet.poll(timeout_s=1.0)
        a0 = fleet.status.actors.get(0, {})
        if a0.get("incarnation", 0) != 0 and a0.get("frames", 0) >= 64:
            break
    final = fleet.stop()
    assert final.restarts >= 1
    assert final.actors[0]["incarnation"] != 0
    steps = drain(client, "restart")
    check_consistent(steps)
    incarnations = {
        (int(e) >> 32) & 0xFFF
        for e in steps["episode_id"][(steps["episode_id"] >> 44) == 0].unique()
    }
    assert incarnations == {0, final.actors[0]["incarnation"]}  # both lives stored their data
    assert np.isin(final.actors[0]["incarnation"], list(incarnations))
    client.close()
