"""TLS end to end: a shard serving TLS, a client trusting its certificate, plaintext refused."""

import shutil
import subprocess

import pytest
import torch

from millpond import ReplayClient, ShardUnavailableError, TableConfig
from millpond.service.server import ServerConfig, create_server


@pytest.fixture
def certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


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
