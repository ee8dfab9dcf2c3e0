"""What a shard counts as an error (``millpond_rpc_errors_total``): not a sample whose wait
for the rate limiter ran out (``millpond_rate_limiter_timeouts_total``), which a healthy job
sees whenever its learners outpace its actors, and not a call its client cancelled."""

from __future__ import annotations

import threading
import time

import pytest

from millpond import ReplayClient, TableConfig
from millpond.errors import DeadlineExceededError, MillpondError
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment, scrape_metrics


def counted(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The error and timeout counters of the shard's metrics endpoint."""
    return {
        key: value
        for key, value in scrape_metrics(port).items()
        if key[0] in ("millpond_rpc_errors_total", "millpond_rate_limiter_timeouts_total")
    }


@pytest.fixture
def served(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard"), metrics_port=0))
    yield running, f"127.0.0.1:{port}"
    running.stop(grace=1)


def rate_limited_table(client: ReplayClient) -> None:
    """A table of 32 steps whose ratio (1 sample per insert, 16 steps of slack) allows 48
    sampled steps, then holds samplers back until more are inserted."""
    client.create_table(TableConfig.uniform("t", 256, min_size=1))
    with client.writer("t", "w") as writer:
        for episode in range(4):
            writer.write_segment(*constant_segment(episode, length=8), episode_id=episode)
    client.configure_table("t", samples_per_insert=1.0, error_buffer=16)


def test_a_wait_that_runs_out_is_a_timeout_not_an_error(served):
    running, address = served
    with ReplayClient([address], colocated=False) as client:
        rate_limited_table(client)
        with pytest.raises(DeadlineExceededError):
            for _ in range(100):
                client.sample("t", 8, timeout_s=0.5)
        with pytest.raises(MillpondError):
            client.sample("t", 10_000)  # more than the table holds: refused, an error
    after = counted(running.metrics_port)
    assert after[("millpond_rate_limiter_timeouts_total", (("method", "Sample"),))] == 1
    errors = {k: v for k, v in after.items() if k[0] == "millpond_rpc_errors_total"}
    assert errors == {
        ("millpond_rpc_errors_total", (("code", "INVALID_ARGUMENT"), ("method", "Sample"))): 1
    }


@pytest.mark.parametrize("colocated", [False, True])
def test_an_iterate_cancelled_by_its_client_is_not_counted(served, colocated):
    running, address = served
    client = ReplayClient([address], colocated=colocated)
    rate_limited_table(client)
    batches = client.iterate("t", 8, prefetch=4, timeout_s=30)
    received = []

    def read() -> None:
        try:
            for batch in batches:
                received.append(batch)
        except MillpondError:
            pass  # the client closed under it

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    seen = -1
    while seen != len(received) and time.monotonic() < deadline:  # until held back
        seen = len(received)
        time.sleep(1.0)
    client.close()  # cancels the Sample that waits in the shard's rate limiter
    reader.join(30)
    time.sleep(1.0)  # the shard notices within a slice of its wait
    assert 0 < len(received) < 10
    assert counted(running.metrics_port) == {}
