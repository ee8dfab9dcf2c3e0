"""The warning a client gives when it finds a shard down says what the call that found it
does: sampling goes on from the other shards, an ``info()`` or a table's creation does not
sample at all."""

from __future__ import annotations

import logging
import socket

import pytest

from millpond import ReplayClient, TableConfig
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment


def dead_address() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def live(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    yield f"127.0.0.1:{port}"
    running.stop(grace=1)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_info_against_a_dead_shard_does_not_speak_of_sampling(live, caplog):
    dead = dead_address()
    with ReplayClient([live], colocated=False) as client:
        client.create_table(TableConfig.uniform("t", 64, min_size=1))
    caplog.set_level(logging.WARNING, logger="millpond.client")
    with ReplayClient([live, dead], colocated=False, timeout_s=5) as client:
        info = client.info("t")
        assert [s["available"] for s in info["shards"]] == [True, False]
    (warning,) = warnings_of(caplog)
    assert f"shard {dead} did not answer Info" in warning
    assert "sampling" not in warning


def test_sampling_past_a_dead_shard_says_it_goes_on(live, caplog):
    dead = dead_address()
    with ReplayClient([live], colocated=False) as client:
        client.create_table(TableConfig.uniform("t", 64, min_size=1))
        with client.writer("t", "w") as writer:
            writer.write_segment(*constant_segment(0, length=8), episode_id=0)
    caplog.set_level(logging.WARNING, logger="millpond.client")
    with ReplayClient([live, dead], colocated=False, timeout_s=5) as client:
        assert client.sample("t", 4).shape == (4,)
    (warning,) = warnings_of(caplog)
    assert f"shard {dead} is unavailable" in warning
    assert "sampling continues from the other shards" in warning
