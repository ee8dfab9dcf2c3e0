"""A shard's Prometheus endpoint, scraped over HTTP while data flows through a real server."""

import threading
import time

import pytest

from millpond import ReplayClient, TableConfig
from millpond.errors import MillpondError
from millpond.segments import Segment
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment, scrape_metrics

scrape = scrape_metrics


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def served(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard"), metrics_port=0))
    yield running, f"127.0.0.1:{port}"
    running.stop(grace=1)


def test_counters_move_as_data_flows(served):
    running, address = served
    port = running.metrics_port
    assert port
    with ReplayClient([address], colocated=False) as client:
        client.create_table(TableConfig.uniform("t", 64, min_size=1))
        before = scrape(port)
        assert value(before, "millpond_inserted_steps_total", table="t") == 0
        assert value(before, "millpond_table_capacity_slots", table="t") == 64
        with client.writer("t", "w") as writer:
            for episode in range(10):  # 80 steps in 90 slots: the ring wraps
                writer.write_segment(*constant_segment(episode, length=8), episode_id=episode)
        for _ in range(3):
            client.sample("t", 16)
        with pytest.raises(MillpondError):
            client.sample("no-such-table", 4)
        after = scrape(port)
    assert value(after, "millpond_inserted_steps_total", table="t") == 80
    assert value(after, "millpond_sampled_steps_total", table="t") == 48
    evicted = value(after, "millpond_evicted_steps_total", table="t")
    size = value(after, "millpond_table_size_steps", table="t")
    assert evicted > 0 and size + evicted == 80
    assert value(after, "millpond_samples_per_insert", table="t") == pytest.approx(48 / 80)
    assert value(after, "millpond_sample_latency_seconds_count", table="t") == 3
    assert value(after, "millpond_sample_batch_steps_sum", table="t") == 48
    assert value(after, "millpond_wire_bytes_total", method="Insert", direction="in") > 0
    assert value(after, "millpond_wire_bytes_total", method="Sample", direction="out") > 0
    # the client asks the shards about a table it does not know before sampling it
    assert value(after, "millpond_rpc_errors_total", method="Info", code="NOT_FOUND") == 1
    assert value(after, "millpond_disk_bytes", table="t") > 0
    assert value(after, "millpond_queue_depth_steps", table="t") == 0


def test_blocked_samplers_and_queue_depth_are_seen(served):
    running, address = served
    with ReplayClient([address], colocated=False) as client:
        client.create_table(TableConfig.uniform("waits", 64, min_size=20))
        client.create_table(TableConfig.queue("q", 64))
        errors = []
        with client.writer("waits", "w") as writer:  # 8 steps: fewer than min_size
            writer.write_segment(*constant_segment(0, length=8), episode_id=0)

        def sample_early() -> None:
            try:
                client.sample("waits", 4, timeout_s=30)
            except Exception as e:  # reported below
                errors.append(e)

        waiter = threading.Thread(target=sample_early)
        waiter.start()
        deadline = time.monotonic() + 10
        while value(scrape(running.metrics_port), "millpond_blocked_samplers", table="waits") != 1:
            assert time.monotonic() < deadline, "the waiting sample never showed"
            time.sleep(0.05)
        with client.writer("waits", "w") as writer:
            for episode in range(1, 3):
                writer.write_segment(*constant_segment(episode, length=8), episode_id=episode)
        waiter.join(30)
        assert not errors and not waiter.is_alive()
        with client.writer("q", "w2") as writer:
            writer.write_segment(*constant_segment(7, length=8), episode_id=7)
        samples = scrape(running.metrics_port)
    assert value(samples, "millpond_blocked_samplers", table="waits") == 0
    assert value(samples, "millpond_queue_depth_steps", table="q") == 8


def test_a_taken_metrics_port_is_refused_by_name(tmp_path, served):
    running, _ = served
    from millpond.errors import InvalidConfigError

    taken = running.metrics_port
    with pytest.raises(InvalidConfigError, match=f"cannot serve metrics on 127.0.0.1:{taken}"):
        create_server(ServerConfig(dir=str(tmp_path / "other"), metrics_port=taken))


def test_a_chunk_written_together_reaches_the_shard_as_one_message(served, patterned):
    """Once the shard has said its message limit, segments written together travel as one
    message past the 1 MiB a writer keeps to before (four ~340 kB segments here)."""
    running, address = served
    port = running.metrics_port
    length = 9_000

    def inserts() -> tuple[float, float]:
        """Insert messages and bytes received so far."""
        samples = scrape(port)
        return tuple(
            value(samples, name, method="Insert", direction="in")
            for name in ("millpond_wire_messages_total", "millpond_wire_bytes_total")
        )

    def chunk(first_episode: int) -> list[Segment]:
        return [
            Segment(*patterned.segment(ep, 0, length), ep, 0)
            for ep in range(first_episode, first_episode + 4)
        ]

    with ReplayClient([address], colocated=False) as client:
        client.create_table(TableConfig.queue("chunks", capacity=100_000))
        with client.writer("chunks", "w") as writer:
            writer.write_segments(chunk(0))  # opens the stream: the shard says its limit
            writer.flush()
            before = inserts()
            writer.write_segments(chunk(4))
            writer.flush()
            sent, sent_bytes = (a - b for a, b in zip(inserts(), before))
        assert sent_bytes > 1 << 20, "the chunk must pass the 1 MiB a writer used to keep to"
        assert sent == 1
        got = patterned.drain(client, "chunks", 8 * length)
    assert sorted(got) == [(ep, s) for ep in range(8) for s in range(length)]
