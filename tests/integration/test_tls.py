"""TLS end to end: a shard serving TLS, a client trusting its certificate, plaintext refused."""

import pytest
import torch

from millpond import ReplayClient, ShardUnavailableError, TableConfig
from millpond.service.server import ServerConfig, create_server


def test_tls_round_trip_and_plaintext_refused(tmp_path, certificate):
    cert, key = certificate
    server, port = create_server(
        ServerConfig(dir=str(tmp_path / "s"), tls_cert=str(cert), tls_key=str(key))
    )
    try:
        with ReplayClient(f"127.0.0.1:{port}", tls=str(cert), timeout_s=10) as client:
            client.create_table(TableConfig.uniform("t", 100))
            client.publish_weights({"layer.weight": torch.arange(6.0).reshape(2, 3)}, version=1)
            weights, version = client.get_weights()
            assert version == 1 and torch.equal(
                weights["layer.weight"], torch.arange(6.0).reshape(2, 3)
            )
        with (
            ReplayClient(f"127.0.0.1:{port}", timeout_s=3) as plain,
            pytest.raises(ShardUnavailableError),
        ):
            plain.info()
    finally:
        server.stop(grace=0.5)
