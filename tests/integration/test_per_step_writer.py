"""An env actor in per-step immediate mode (``chunk_len: 1``) over gRPC: every step arrives
on its own, each is stored exactly once, one slot a step (writers' regions), and sampled
transitions equal what the env produced."""

from __future__ import annotations

import numpy as np
import torch

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector


def test_per_step_segments_are_stored_once_a_slot_a_step_and_sample_exactly(server1, table_name):
    client = ReplayClient(server1.address)
    client.create_table(TableConfig.uniform(table_name, capacity=1 << 14, seed=0))
    writer = client.writer(table_name, writer_id=f"{table_name}-actor")
    collector = Collector("CartPole-v1", writer, num_envs=4, chunk_len=1, seed=3)
    chunks = [collector.run_chunk() for _ in range(300)]
    collector.flush(timeout_s=60)
    collector.close(timeout_s=10)
    lanes = torch.cat(chunks, 1).reshape(-1)  # what the actor saw, every step once
    steps = lanes.shape[0]
    assert client.info(table_name)["size"] == steps

    # The reference, by (episode, step): the collector's own record of each transition.
    ref = {
        (int(e), int(s)): i
        for i, (e, s) in enumerate(
            zip(lanes["collector", "traj_ids"].tolist(), lanes["collector", "step_count"].tolist())
        )
    }
    # Over the wire and read from the shard's files (colocated): every step is drawn (its
    # next slot may be its successor's first: the generation check must know) and exact.
    for colocated in (False, True):
        reader = ReplayClient(server1.address, colocated=colocated)
        seen: set[tuple[int, int]] = set()
        for _ in range(30):
            batch = reader.sample(table_name, 1024, timeout_s=30)
            keys = list(zip(batch["episode_id"].tolist(), batch["step"].tolist()))
            want = lanes[torch.tensor([ref[k] for k in keys])]
            assert torch.equal(batch["observation"], want["observation"])
            assert torch.equal(batch["next", "observation"], want["next", "observation"])
            assert torch.equal(batch["action"], want["action"])
            for key in ("reward", "terminated"):
                assert torch.equal(batch["next", key].reshape(-1), want["next", key].reshape(-1))
            # ("next", "truncated") is the env's truncation or the batch's stop (every row
            # of a uniform batch stops there): never false where the env truncated.
            assert not (want["next", "truncated"] & ~batch["next", "truncated"]).any()
            seen.update(keys)
        reader.close()
        assert seen == set(ref), f"colocated={colocated}: {len(set(ref) - seen)} steps never drawn"

    slots = np.fromfile(next(server1.dir.rglob(f"{table_name}/**/slots.bin")), dtype=np.int32)
    episodes = int(lanes["next", "done"].sum()) + 4
    # One slot a step, a tail per episode, and a slot per region a lane moved on from.
    assert np.count_nonzero(slots) <= steps + episodes + steps // 64
    client.close()
