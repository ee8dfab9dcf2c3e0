"""Lanes that advance unevenly still give exactly T rows each per chunk, in order."""

from __future__ import annotations

import functools
import logging

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

from millpond.actors import Collector, LaneBuffer
from millpond.testing import CountingDictEnv


def test_lane_buffer_hands_out_each_lanes_rows_in_order(rng):
    lanes, chunk_len = 4, 5
    buffer = LaneBuffer(lanes, chunk_len)
    produced = [[] for _ in range(lanes)]  # every real row, per lane, in order
    taken = [[] for _ in range(lanes)]
    step = 0
    for _ in range(12):
        while not buffer.ready:
            valid = rng.random(lanes) < np.array([1.0, 0.8, 0.5, 0.3])
            value = torch.arange(lanes) * 1000 + step
            buffer.append({("x",): value, ("next", "y"): value.unsqueeze(-1) * 2}, valid)
            for p in np.flatnonzero(valid):
                produced[p].append(int(value[p]))
            step += 1
        chunk = buffer.take()
        assert chunk.batch_size == (lanes, chunk_len)
        assert torch.equal(chunk["next", "y"].squeeze(-1), chunk["x"] * 2)
        for p in range(lanes):
            taken[p].extend(chunk["x"][p].tolist())
        assert (buffer.counts == [len(produced[p]) - len(taken[p]) for p in range(lanes)]).all()
    for p in range(lanes):
        assert taken[p] == produced[p][: len(taken[p])]
    assert buffer.counts[0] > buffer.counts[3]  # the fast lane is ahead
    with pytest.raises(RuntimeError, match="fewer than a chunk"):
        LaneBuffer(2, 3).take()


def test_next_step_lanes_that_drift_apart_are_reported(caplog):
    """A lane of 2-step episodes makes 2 real steps per 3 env steps; a long-episode lane 3."""
    env = gym.vector.SyncVectorEnv(
        [
            functools.partial(
                CountingDictEnv, pixel_shape=(1,), min_len=2, max_len=2, terminate_prob=0
            ),
            functools.partial(CountingDictEnv, pixel_shape=(1,), min_len=500, max_len=500),
        ],
        autoreset_mode=AutoresetMode.NEXT_STEP,
    )
    with (
        caplog.at_level(logging.WARNING, "millpond.actors"),
        Collector(env, None, chunk_len=6, seed=0) as c,
    ):
        for _ in range(4):
            c.collect()
    env.close()
    assert c.surplus[0] == 0 and c.surplus[1] > 6
    assert "drift apart" in caplog.text
