"""Priorities given at insert, through a writer and a real server: sampled with, exactly."""

import numpy as np
import pytest
import torch

from millpond import InvalidDataError, ReplayClient, TableConfig
from millpond.segments import Segment


def test_writer_priorities_are_what_a_real_shard_samples_with(server1, table_name, patterned):
    beta = 0.5
    with ReplayClient(server1.address, timeout_s=30) as client:
        client.create_table(TableConfig.prioritized(table_name, 4096, alpha=1.0, beta=beta))
        # Each episode's steps get priority episode % 4 (0: never drawn). 200 segments go
        # as one message of > 64 KiB: framed by hand on both sides.
        segments = []
        for ep in range(200):
            steps, tail = patterned.segment(ep)
            segments.append(Segment(steps, tail, ep, 0, None, torch.full((4,), ep % 4.0)))
        with client.writer(table_name, writer_id=f"{table_name}-w") as w:
            w.write_segments(segments)
            steps, tail = patterned.segment(1000)
            w.write_segment(steps, tail, 1000, 0, priorities=[0.0, 3.0, 0.0, 3.0])  # small
        info = client.info(table_name)
        assert info["size"] == 804
        assert info["mass"] == pytest.approx(4 * 50 * (1 + 2 + 3) + 6)
        seen = []
        for _ in range(10):
            batch = client.sample(table_name, 256)
            patterned.check(batch)
            eps, steps = batch["episode_id"].numpy(), batch["step"].numpy()
            p = np.where(eps == 1000, 3.0, eps % 4)
            assert (p > 0).all(), "a step inserted with priority 0 was sampled"
            assert ((eps != 1000) | (steps % 2 == 1)).all()
            # w_i = (N P(i))^-beta / max_j (N P(j))^-beta = (p_i / min p)^-beta, min p = 1
            np.testing.assert_allclose(batch["weight"].numpy(), p**-beta, rtol=1e-5)
            seen += p.tolist()
        counts = np.bincount(np.asarray(seen, dtype=np.int64), minlength=4)[1:]
        assert counts[0] < counts[1] < counts[2]  # drawn about 1 : 2 : 3 (= 426 : 853 : 1280)


def test_priorities_for_a_table_without_them_are_refused_by_name(server1, table_name, patterned):
    with ReplayClient(server1.address, timeout_s=30) as client:
        client.create_table(TableConfig.uniform(table_name, 100))
        with client.writer(table_name, writer_id=f"{table_name}-w") as w:
            steps, tail = patterned.segment(1)
            with pytest.raises(InvalidDataError, match=f"table {table_name!r} has a 'uniform'"):
                w.write_segment(steps, tail, 1, 0, priorities=[1.0] * 4)
            with pytest.raises(InvalidDataError, match="priority of step 2 is nan"):
                w.write_segment(steps, tail, 1, 0, priorities=[1.0, 1.0, float("nan"), 1.0])
            w.write_segment(steps, tail, 1, 0)  # the writer goes on
        assert client.info(table_name)["size"] == 4
