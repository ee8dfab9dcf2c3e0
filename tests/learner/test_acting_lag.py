"""The actors' acting lag against a plain loop over what was published and what acted.

A real shard on loopback (the ``client`` fixture) is the weights rendezvous; the publications happen inside the
vector env's ``step()`` (after the step's action was chosen, before the next one), so each
acted step's exact lag is known: the versions published before it was acted minus the
version that acted it.
"""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode, VectorWrapper

from millpond import ReplayClient
from millpond.actors import Collector
from millpond.actors.acting_lag import ActingLag
from millpond.learner.networks import mlp_q

LANES, CHUNK, EVERY = 2, 8, 3
#: env steps (global index) in whose step() the learner publishes the next version
PUBLISH_AT = {1, 2, 4, 9, 10, 11, 12, 13, 21}


pytestmark = pytest.mark.usefixtures("one_thread")


class PublishingEnv(VectorWrapper):
    """CartPole lanes whose n-th ``step()`` publishes a new version when n is scheduled."""

    def __init__(self, client: ReplayClient, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(
            gym.make_vec(
                "CartPole-v1",
                num_envs=LANES,
                vectorization_mode="sync",
                vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            )
        )
        self.client, self.weights = client, weights
        self.steps = 0
        self.version = 0

    def step(self, actions):
        if self.steps in PUBLISH_AT:
            self.version = self.client.publish_weights(self.weights, self.version + 1)
        self.steps += 1
        return super().step(actions)


def test_acting_lag_equals_a_plain_loop_over_publications_and_acts(client):
    obs_space, act_space = (
        gym.make("CartPole-v1").observation_space,
        gym.make("CartPole-v1").action_space,
    )
    weights = mlp_q(obs_space, act_space, (8,)).state_dict()
    client.publish_weights(weights, 0)
    env = PublishingEnv(client, weights)
    collector = Collector(
        env,
        policy="millpond.learner.networks:mlp_q",
        policy_kwargs={"hidden": (8,)},
        deterministic=True,
        weight_source=client,
        weight_sync_every=EVERY,
        chunk_len=CHUNK,
        seed=0,
    )
    chunks = 3
    acted = torch.cat([collector.collect()["policy_version"][0] for _ in range(chunks)])
    measured = collector.acting_lag.drain()

    # The reference. Step m (global index) was acted before step() m ran, so the versions
    # published before it are those of the steps n < m. Checks come before chunk rows 0,
    # EVERY, 2 EVERY, ... and after the chunk's last row; a step counts the lag at the
    # check that ends its interval: the versions published before that check.
    def published_before(m: int) -> int:
        return sum(1 for n in PUBLISH_AT if n < m)

    exact, at_check = [], []
    for m in range(chunks * CHUNK):
        start, row = m - m % CHUNK, m % CHUNK
        end = min(CHUNK, (row // EVERY + 1) * EVERY)  # the row before which the check runs
        exact.append(published_before(m) - int(acted[m]))
        at_check.append(published_before(start + end) - int(acted[m]))
    reference = ActingLag()
    for lag in at_check:
        reference.add(LANES, 0, lag)
    assert measured == reference.drain()
    assert measured["frames"] == LANES * chunks * CHUNK
    # The exact lag of each step is at most the one counted for it: equal for the last step
    # of an interval unless a version came out between its act and the check.
    assert all(e <= c for e, c in zip(exact, at_check, strict=True))
    last = [
        m
        for m in range(chunks * CHUNK)
        if (m % CHUNK) % EVERY == EVERY - 1 or m % CHUNK == CHUNK - 1
    ]
    assert [exact[m] for m in last if m not in PUBLISH_AT] == [
        at_check[m] for m in last if m not in PUBLISH_AT
    ]
    assert measured["max"] >= max(exact) > 0
    assert sum(exact) < sum(at_check)  # counted: an upper bound, not the exact mean
    collector.close()
    env.close()
