"""Closing while a rate limiter holds inserts back: bounded waits, stored data intact."""

import pytest

from millpond import DeadlineExceededError, ReplayClient, TableConfig
from millpond.actors import Collector


def test_collector_and_client_close_within_their_timeouts(server1, table_name):
    client = ReplayClient(server1.address)
    client.create_table(
        TableConfig.uniform(
            table_name, capacity=10_000, min_size=1, samples_per_insert=1.0, error_buffer=64.0
        )
    )
    writer = client.writer(table_name, writer_id=f"{table_name}-actor", max_in_flight=1000)
    collector = Collector("CartPole-v1", writer, num_envs=2, chunk_len=32, seed=0)
    for _ in range(10):  # 640 frames; nothing samples, so the limiter admits about 64
        collector.run_chunk()
    with pytest.raises(DeadlineExceededError):
        collector.flush(timeout_s=0.5)
    stored = client.info(table_name)["size"]
    assert 0 < stored < collector.frames
    with pytest.raises(DeadlineExceededError):
        collector.close(timeout_s=0.5)  # an unbounded flush would wait forever here
    with pytest.raises(DeadlineExceededError):
        client.close(timeout_s=0.5)  # the writer drops what it could not deliver
    check = ReplayClient(server1.address)
    info = check.info(table_name)
    assert info["size"] == stored  # what was stored is still there, nothing torn
    batch = check.sample(table_name, min(stored, 16), timeout_s=10)
    assert batch["observation"].shape[-1] == 4
    check.close()
