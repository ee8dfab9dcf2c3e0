"""Fixtures of the deploy tests."""

from __future__ import annotations

import pytest
import torch

from millpond.actors import Collector
from millpond.service import TableSink


@pytest.fixture
def actor_lanes():
    """``actor_lanes(config, table, *, num_envs, chunk_len, chunks, seed, env_kwargs=None)``:
    the lanes ``[num_envs, chunks * chunk_len]`` that a launch's env actor path (its
    ``ActorConfig``: env, wrappers, policy, exploration) collects, written into ``table``;
    ``env_kwargs`` replaces the config's."""

    def run(config, table, *, num_envs, chunk_len, chunks, seed, env_kwargs=None):
        collector = Collector(
            config.env,
            TableSink(table),
            num_envs=num_envs,
            chunk_len=chunk_len,
            env_kwargs=dict(config.env_kwargs if env_kwargs is None else env_kwargs),
            env_wrappers=config.env_wrappers,
            policy=config.policy,
            policy_kwargs=config.policy_kwargs,
            deterministic=config.deterministic,
            noise=config.noise,
            seed=seed,
        )
        with collector:
            return torch.cat([collector.run_chunk() for _ in range(chunks)], 1)

    return run
