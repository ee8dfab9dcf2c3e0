"""``ReplayClient.extend`` with TorchRL collector output: [P, T] TED in, exact TED out.

A real ``torchrl.collectors.Collector`` steps three CartPole lanes (15-step limit, with a
``StepCounter``), and its batches go through ``extend`` as they are: every collector numbers
its trajectories from 0, and each client keeps its own apart (``episode_base``). Trajectories run
across batches, so some segments end only because a batch ended; the stored
``("next", obs)`` must still be the env's true next observation at every step.
"""

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv

from millpond import InvalidDataError, ReplayClient, TableConfig
from millpond.testing import CountingDictEnv, rollout

LANES, TIME = 3, 20


def collector_batches(seed, n_batches):
    env = TransformedEnv(
        SerialEnv(LANES, lambda: GymEnv("CartPole-v1", max_episode_steps=15)), StepCounter()
    )
    env.set_seed(seed)
    collector = Collector(
        env, policy=None, frames_per_batch=LANES * TIME, total_frames=LANES * TIME * n_batches
    )
    try:
        return [td.clone() for td in collector]
    finally:
        collector.shutdown()


def as_reference(td, client):
    """A [P, T] collector batch as flat reference rows keyed by (episode id, step count):
    a client's trajectories are its episode ids offset by its ``episode_base``."""
    ref = td.reshape(-1).exclude("done", "terminated", "truncated")
    ref["collector", "traj_ids"] = ref["collector", "traj_ids"] + client.episode_base
    return ref


def test_collector_batches_round_trip_exactly_across_three_shards(
    server3, table_name, make_experience
):
    admin = ReplayClient(server3.address)
    admin.create_table(TableConfig.uniform(table_name, capacity=10_000, seed=7))
    exp = make_experience(step_count_stored=True)
    clients = []
    continued = 0
    try:
        # One collector per client (an actor each); each client's extend writer is pinned to
        # one shard, so add actors until every shard holds data.
        for k in range(30):
            client = ReplayClient(server3.address)
            clients.append(client)
            batches = collector_batches(seed=k, n_batches=2)
            ids = [set(td["collector", "traj_ids"].reshape(-1).tolist()) for td in batches]
            continued += len(ids[0] & ids[1])  # trajectories cut only by the batch's end
            for td in batches:
                assert td.batch_size == torch.Size([LANES, TIME])
                # Every collector numbers its trajectories from 0: the clients keep them apart.
                assert client.extend(table_name, td) == LANES * TIME
                exp.add(as_reference(td, client))
            sizes = [s["size"] for s in admin.info(table_name)["shards"]]
            if k >= 2 and all(sizes):
                break
        assert sum(sizes) == exp.num_steps and all(sizes)
        ends = exp.all["next"]
        assert ends["terminated"].any() and ends["truncated"].any() and continued
        seen = set()
        for _ in range(exp.batches_to_cover(256)):
            batch = admin.sample(table_name, 256)
            seen.update(exp.check(batch))
            # millpond counts steps per trajectory across extend calls as the env does.
            assert torch.equal(batch["step"], batch["step_count"].reshape(-1))
            if len(seen) == exp.num_steps:
                break
        assert seen == set(exp.index)
    finally:
        for client in clients:
            client.close()
        admin.close()


def test_extend_one_dimensional_ted_in_two_calls(client, table_name, make_experience):
    client.create_table(TableConfig.uniform(table_name, capacity=2_000, seed=8))
    exp = make_experience(step_count_stored=True)
    ted = rollout(CountingDictEnv(pixel_shape=(2, 4, 4)), 60, seed=1)
    reference = ted.clone()
    reference["collector", "traj_ids"] += client.episode_base  # this client's episode ids
    exp.add(reference)
    # Cut mid-episode, so that the second call continues that episode's step count.
    traj = ted["collector", "traj_ids"]
    cut = int(torch.nonzero(traj[1:] == traj[:-1])[len(traj) // 3]) + 1
    assert traj[cut - 1] == traj[cut] and ted["step_count"][cut] > 0
    assert client.extend(table_name, ted[:cut]) == cut
    assert client.extend(table_name, ted[cut:]) == 60 - cut
    size = client.info(table_name)["size"]
    assert size == 60
    with pytest.raises(InvalidDataError, match="batch size"):
        client.extend(table_name, ted[None, None, None])
    with pytest.raises(InvalidDataError, match="observation keys"):
        client.extend(table_name, ted.exclude("next"))
    assert client.info(table_name)["size"] == size
    seen = set()
    for _ in range(exp.batches_to_cover(128)):
        seen.update(exp.check(client.sample(table_name, 128)))
        if len(seen) == exp.num_steps:
            break
    assert seen == set(exp.index)
