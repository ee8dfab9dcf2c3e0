"""DQN's ``max_policy_lag`` bounds the actors' acting lag: a learner and two env actors on
threads against a real shard on loopback.

Each env ``step()`` reads the version the rendezvous holds at that moment, after the step's
action was chosen: that version minus the version that chose the action is at least the
step's exact acting lag, so ``max_policy_lag`` bounds it when the bound holds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.vector import AutoresetMode, VectorWrapper

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector
from millpond.errors import DeadlineExceededError, InvalidConfigError
from millpond.learner.dqn import DQNConfig, DQNLearner
from millpond.learner.networks import mlp_q
from tests.learner._helpers import cartpole_spaces

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 120  # learner steps, one publication each


class WatchedEnv(VectorWrapper):
    """CartPole lanes, slowed down, noting each step's acting version and the newest one."""

    def __init__(self, client: ReplayClient) -> None:
        super().__init__(
            gym.make_vec(
                "CartPole-v1",
                num_envs=2,
                vectorization_mode="sync",
                vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            )
        )
        self.client = client
        self.collector: Collector | None = None
        self.lags: list[int] = []

    def step(self, actions):
        assert self.collector is not None
        newest = int(self.client.info()["weights_version"])
        self.lags.append(newest - self.collector.policy_version)
        time.sleep(0.002)  # actors slower than the learner: it would run ahead
        return super().step(actions)


def run_actor(address: str, index: int, stop: threading.Event, out: dict[int, Any]) -> None:
    client = ReplayClient(address, timeout_s=10)
    env = WatchedEnv(client)
    writer = client.writer("replay", writer_id=f"actor-{index}", timeout_s=2)
    collector = Collector(
        env,
        writer,
        chunk_len=16,
        policy="millpond.learner.networks:mlp_q",
        policy_kwargs={"hidden": (16,)},
        deterministic=True,
        weight_source=client,
        weight_sync_every=8,
        actor_name=f"actor-{index}",
        seed=index,
    )
    env.collector = collector
    try:
        while not stop.is_set():
            batch = collector.collect()  # its last check says: not acting, writing
            try:
                collector.write(batch)
            except DeadlineExceededError:  # the rate limiter holds it, the learner is done
                break
        out[index] = (env.lags, collector.acting_lag.drain())
    finally:
        with contextlib.suppress(DeadlineExceededError):  # what the limiter holds is dropped
            writer.close(timeout_s=0)
        with contextlib.suppress(DeadlineExceededError):
            client.close(timeout_s=0)
        env.close()


@pytest.mark.parametrize(
    ("max_policy_lag", "limited"), [(2, False), (None, False), (1, True)], ids=str
)
def test_max_policy_lag_bounds_what_the_actors_act_on(tmp_path, max_policy_lag, limited):
    from millpond.service.server import ServerConfig, create_server

    server, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    address = f"127.0.0.1:{port}"
    client = ReplayClient(address, timeout_s=10)
    # limited: one step of 32 per 8 inserted, inserts held back 64 steps ahead of the
    # samples: the actors wait in their writes while the learner waits for them to act.
    pacing = {"samples_per_insert": 4.0, "error_buffer": 256.0} if limited else {}
    client.create_table(TableConfig.uniform("replay", capacity=4096, min_size=64, **pacing))
    obs_space, act_space = cartpole_spaces()
    learner = DQNLearner(
        client,
        "replay",
        DQNConfig(batch_size=32, publish_every=1, max_policy_lag=max_policy_lag),
        mlp_q(obs_space, act_space, (16,)),
    )
    learner.publish()
    stop = threading.Event()
    out: dict[int, Any] = {}
    actors = [
        threading.Thread(target=run_actor, args=(address, i, stop, out), daemon=True)
        for i in range(2)
    ]
    for actor in actors:
        actor.start()
    waited = 0.0
    try:
        while learner.updates < STEPS:
            try:
                waited += learner.step()["publish_wait_s"]
            except DeadlineExceededError:
                continue
    finally:
        stop.set()
        for actor in actors:
            actor.join(timeout=30)
        learner.close()
        client.close(timeout_s=0)
        server.stop(grace=0.5)
    assert learner.version == STEPS
    assert sorted(out) == [0, 1]
    worst = max(max(lags) for lags, _ in out.values())
    counted = max(lag["max"] for _, lag in out.values())
    if max_policy_lag is None:
        assert worst > 2  # the learner ran ahead of the actors
        assert counted > 2
        assert waited == 0.0
    else:
        assert worst <= max_policy_lag
        assert counted <= max_policy_lag
        assert waited > 0  # it had to wait for them


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_policy_lag_is_a_positive_integer(value):
    with pytest.raises(InvalidConfigError, match="max_policy_lag"):
        DQNConfig(max_policy_lag=value)
