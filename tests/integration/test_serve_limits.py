"""``--max-weights-mb``: the largest weights a shard takes, from the command line on."""

import pytest
import torch

from millpond import InvalidConfigError, ReplayClient, ResourceExhaustedError
from millpond.service.server import ServerConfig, build_parser, create_server


def test_flag_reaches_the_config():
    args = build_parser().parse_args(["--dir", "d", "--max-weights-mb", "3"])
    assert args.max_weights_mb == 3
    with pytest.raises(InvalidConfigError, match="max_weights_mb"):
        ServerConfig(dir="d", max_weights_mb=0)


def test_weights_over_the_limit_are_refused(tmp_path):
    server, port = create_server(ServerConfig(dir=str(tmp_path / "s"), max_weights_mb=1))
    try:
        with ReplayClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            client.publish_weights({"w": torch.zeros(1000)}, version=1)
            with pytest.raises(ResourceExhaustedError):
                client.publish_weights({"w": torch.zeros(512 * 1024)}, version=2)  # 2 MiB
            _, version = client.get_weights()
            assert version == 1
    finally:
        server.stop(grace=0.5)
