"""One killed actor is one restart in the fleet's status, however many calls its death fails."""

import functools
import time

import pytest
import ray

from millpond import ReplayClient, TableConfig
from millpond.actors.fleet import ActorFleet
from millpond.actors.ray_actor import ActorConfig
from millpond.testing import make_counting_vector_env

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ray_cluster(start_local_ray):
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_one_kill_counts_one_restart(ray_cluster, server1, table_name):
    client = ReplayClient(server1.address)
    client.create_table(TableConfig.queue(table_name, 100_000))
    config = ActorConfig(
        env=functools.partial(make_counting_vector_env, 2, pixel_shape=(1, 4, 4)),
        table=table_name,
        num_envs=2,
        chunk_len=8,
        seed=0,
    )
    fleet = ActorFleet(client, config, num_actors=1, num_cpus=0.5, max_restarts=2)
    deadline = time.monotonic() + 120
    while fleet.status.actors.get(0, {}).get("frames", 0) == 0:  # its first life reported
        assert time.monotonic() < deadline, "the actor never reported"
        fleet.poll(timeout_s=1.0)
    failed_calls = 0
    submit = fleet._submit

    def counting_submit(index):  # the calls the fleet makes while Ray restarts the actor
        nonlocal failed_calls
        failed_calls += 1
        submit(index)

    fleet._submit = counting_submit
    ray.kill(fleet.actors[0], no_restart=False)  # a crash: Ray restarts it
    deadline = time.monotonic() + 120
    while fleet.status.actors[0].get("incarnation", 0) == 0:
        assert time.monotonic() < deadline, "the actor never came back"
        fleet.poll(timeout_s=0.2)
    final = fleet.stop(timeout_s=10)
    assert final.restarts == 1, f"{final.restarts} restarts counted over {failed_calls} calls"
    assert "restarts 1" in final.line()
    client.close(timeout_s=10)
