"""Fixtures shared by the reference learners' tests (``test_dqn.py``, ``test_ppo.py``).

Their plain helpers (CartPole spaces, collecting and writing a chunk, checking published
weights) live in ``_helpers.py`` beside this file.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from millpond import ReplayClient
from millpond.service.server import ServerConfig, create_server


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny networks: one intra-op thread is fastest, and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def client(tmp_path) -> Iterator[ReplayClient]:
    """A client of a real in-process server (one shard, under ``tmp_path``)."""
    server, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    client = ReplayClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield client
    finally:
        client.close()
        server.stop(grace=0.5)
