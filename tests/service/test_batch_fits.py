"""One rule for a batch's size, in process and through the service: a sample of more steps
(``batch_size`` x ``slice_len``) than the table has slots is refused, for every sampler."""

from __future__ import annotations

import pytest

from millpond import ReplayClient, Table, TableConfig
from millpond.errors import InvalidDataError
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment

CONFIGS = [
    TableConfig.uniform("uniform", 40, min_size=1),
    TableConfig.prioritized("prioritized", 40, min_size=1),
    TableConfig.queue("queue", 40),
    TableConfig.slices("slices", 40, slice_len=4, min_size=1),
]


@pytest.fixture
def address(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    yield f"127.0.0.1:{port}"
    running.stop(grace=1)


def refusal(sample, batch_size: int) -> str | None:
    """The message of the refusal of ``sample(batch_size)``, ``None`` if it sampled."""
    try:
        sample(batch_size)
    except InvalidDataError as e:
        return str(e)
    return None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.sampler)
def test_a_batch_above_the_capacity_is_refused_in_process_as_through_the_service(
    tmp_path, address, config
):
    k = config.slice_len or 1
    fits, too_many = config.capacity // k // 2, config.capacity // k + 1
    table = Table.create(tmp_path / "local" / config.name, config)
    with ReplayClient([address], colocated=False) as client:
        client.create_table(config)
        with client.writer(config.name, "w") as writer:
            for episode in range(3):
                steps = constant_segment(episode, length=8)
                writer.write_segment(*steps, episode_id=episode)
                table.insert(*steps, episode_id=episode)
        for batch_size in (fits, too_many):
            local = refusal(lambda n: table.sample(n, timeout=5), batch_size)
            served = refusal(lambda n: client.sample(config.name, n, timeout_s=5), batch_size)
            if batch_size == fits:
                assert local is None and served is None
            else:
                assert local is not None and served is not None
                assert f"exceeds the capacity of table {config.name!r} (40 slots)" in local
                assert local in served  # the service's refusal names its shard besides
    table.close()
