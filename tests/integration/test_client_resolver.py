"""A client with a resolver: a shard that comes back on another port is found there, and a
shard the resolver calls gone is routed around (real ``millpond serve`` processes).

The resolver here is a plain function over a dict that the test keeps up to date, as a
supervisor would; what is checked is the client's side: the writer re-sends to the new
address and nothing is stored twice or lost, samples reach the moved shard, and a writer
pinned to a lost shard stops with ShardGoneError while sampling goes on from the others.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.errors import ShardGoneError, ShardUnavailableError
from millpond.testing import constant_segment

pytestmark = pytest.mark.timeout(180)

L = 8


def write_episodes(writer, episodes) -> None:
    for ep in episodes:
        steps, tail = constant_segment(ep, L)
        writer.write_segment(steps, tail, episode_id=ep, first_step=0)


def other_free_port(than: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != than:
            return port


def test_a_shard_restarted_on_another_port_is_found_through_the_resolver(server_process):
    server = server_process()
    where = {0: server.address}
    client = ReplayClient(server.address, timeout_s=20, resolver=lambda i: where[i])
    client.create_table(TableConfig.uniform("moves", capacity=10_000, seed=3))
    writer = client.writer("moves", writer_id="mover")
    write_episodes(writer, range(10))
    writer.flush(timeout_s=30)

    old = server.address
    server.kill()
    server.port = other_free_port(server.port)
    server.restart()  # the same directory, another port
    assert server.address != old
    where[0] = server.address

    write_episodes(writer, range(10, 20))  # the writer dials the new address and re-sends
    writer.flush(timeout_s=60)
    writer.close()
    assert client.addresses == [server.address]
    info = client.info("moves")
    assert info["size"] == 20 * L and info["shards"][0]["available"]  # each stored once
    batch = client.sample("moves", 64)
    assert set(batch["episode_id"].tolist()) <= set(range(20))
    client.close()


def resolver_over(servers, gone: set[int]):
    """A supervisor's resolver: shard ``i`` is ``servers[i]``, lost for good once in ``gone``."""

    def resolve(index: int) -> str:
        if index in gone:
            raise ShardGoneError("its node is gone")
        return servers[index].address

    return resolve


def retried(call, what: str, seconds: float = 30):
    """``call()``, again while it raises ShardUnavailableError (a client finds out that a
    shard is gone on a later call), for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except ShardUnavailableError:
            assert time.monotonic() < deadline, f"{what}: still unavailable"
            time.sleep(0.2)


def test_a_shard_the_resolver_calls_gone_is_skipped_and_its_writer_stops(server_process):
    kept, lost = server_process(), server_process()
    gone: set[int] = set()
    resolve = resolver_over([kept, lost], gone)
    client = ReplayClient(f"{kept.address},{lost.address}", timeout_s=20, resolver=resolve)
    client.create_table(TableConfig.uniform("routes", capacity=10_000, seed=4))
    to_kept = client.writer("routes", writer_id="a", shard=0)
    to_lost = client.writer("routes", writer_id="b", shard=1)
    write_episodes(to_kept, range(10))
    write_episodes(to_lost, range(100, 110))
    to_kept.flush(timeout_s=30)
    to_lost.flush(timeout_s=30)

    lost.kill()
    gone.add(1)
    with pytest.raises(ShardGoneError, match="lost for good"):  # a write or the flush
        write_episodes(to_lost, range(110, 112))
        to_lost.flush(timeout_s=30)
    assert client.lost_shards == [1]

    # Sampling goes on from the shard that is left, and only from it.
    for _ in range(5):
        batch = client.sample("routes", 32)
        assert set(batch["episode_id"].tolist()) <= set(range(10))
        assert set(batch["index", "shard"].tolist()) == {0}
    info = client.info("routes")
    assert [s["available"] for s in info["shards"]] == [True, False]
    to_kept.close()
    with pytest.raises(ShardGoneError):  # closing its writers reports the one that stopped
        client.close(timeout_s=5)


def test_the_weights_rendezvous_moves_to_the_next_shard_once_shard_0_is_lost(server_process):
    first, second = server_process(), server_process()
    gone: set[int] = set()
    resolve = resolver_over([first, second], gone)
    addresses = f"{first.address},{second.address}"
    learner = ReplayClient(addresses, timeout_s=20, resolver=resolve)
    actor = ReplayClient(addresses, timeout_s=20, resolver=resolve)
    weights = {"w": torch.arange(4, dtype=torch.float32)}
    assert learner.publish_weights(weights, 1) == 1
    state, version = actor.get_weights(min_version=1)
    assert version == 1 and torch.equal(state["w"], weights["w"])
    assert learner.info()["weights_version"] == 1
    assert [s["weights_version"] for s in learner.info()["shards"]] == [1, -1]

    first.kill()
    # While shard 0 is only unreachable, it stays the rendezvous: a restart brings it back.
    with pytest.raises(ShardUnavailableError):
        learner.publish_weights(weights, 2)
    gone.add(0)
    newer = {"w": torch.arange(4, dtype=torch.float32) * 2}
    # Lost for good: the next publication (the learner retries) lands on shard 1 ...
    assert retried(lambda: learner.publish_weights(newer, 2), "the publication") == 2
    assert learner.lost_shards == [0]
    # ... where the actors fetch it, and which info reports.
    state, version = retried(lambda: actor.get_weights(min_version=2), "the fetch")
    assert version == 2 and torch.equal(state["w"], newer["w"])
    info = learner.info()
    assert info["weights_version"] == 2
    assert [s["available"] for s in info["shards"]] == [False, True]

    gone.add(1)
    second.kill()
    with pytest.raises(ShardUnavailableError):
        learner.publish_weights(newer, 3)

    def refused_for_good() -> str:  # every shard lost: nowhere to publish, said so
        try:
            learner.publish_weights(newer, 3)
        except ShardGoneError as e:
            if "every shard is lost for good" in str(e):
                return str(e)
            raise
        raise AssertionError("published with every shard gone")

    assert second.address in retried(refused_for_good, "every shard lost")
    learner.close(timeout_s=5)
    actor.close(timeout_s=5)


def test_an_env_actor_whose_shard_is_lost_writes_whole_new_episodes_elsewhere(server_process):
    from collections import defaultdict

    from millpond.actors.ray_actor import ActorConfig, EnvActor
    from millpond.service.table import Table
    from millpond.testing import stored_segments

    kept, lost = server_process(), server_process()
    gone = set()

    def resolve(index: int) -> str:
        if index in gone:
            raise ShardGoneError("its node is gone")
        return [kept.address, lost.address][index]

    client = ReplayClient(f"{kept.address},{lost.address}", timeout_s=20, resolver=resolve)
    client.create_table(TableConfig.uniform("lanes", capacity=20_000, seed=5))
    config = ActorConfig(env="CartPole-v1", table="lanes", num_envs=4, chunk_len=16, seed=1)
    actor = EnvActor(1, client, config, incarnation=0)  # actor 1 of 2: pinned to shard 1
    try:
        actor.run(4)  # episodes under way on every lane, some of them on shard 1 already
        actor.writer.flush(timeout_s=30)
        assert actor.status()["shard"] == 1 and client.info("lanes")["shards"][1]["size"] > 0
        lost.kill()
        gone.add(1)
        actor.run(12)
        status = actor.status()
        assert status["shard"] == 0 and status["lost_shards"] == [1]
        actor.writer.flush(timeout_s=30)
    finally:
        actor.close(timeout_s=10)
    assert client.info("lanes")["shards"][0]["size"] > 0
    client.close(timeout_s=5)
    kept.stop()

    # Shard 0 holds only what actor 1 wrote after the loss: every episode there is whole
    # from step 0 on (the episodes under way were given new ids), none continued mid-way.
    table = Table.open(kept.dir / "tables" / "lanes")
    try:
        segments = stored_segments(table)
    finally:
        table.close()
    by_episode: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for episode, first, length, _ in segments:
        by_episode[episode].append((first, length))
    assert by_episode
    for episode, parts in by_episode.items():
        parts.sort()
        expected = 0
        for first, length in parts:
            assert first == expected, f"episode {episode:#x} does not start whole: {parts}"
            expected = first + length
