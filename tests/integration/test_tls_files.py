"""TLS files that are not PEM: the server says which file and why, before binding."""

import contextlib
import subprocess
import sys

import pytest

from millpond import InvalidConfigError, ReplayClient, TableConfig
from millpond.service.server import ServerConfig, create_server


@contextlib.contextmanager
def serving(tmp_path, cert, key):
    """A server with these TLS files, for the ``with`` block; yields its port."""
    config = ServerConfig(dir=str(tmp_path / "s"), tls_cert=str(cert), tls_key=str(key))
    server, port = create_server(config)
    try:
        yield port
    finally:
        server.stop(grace=0)


def start(tmp_path, cert, key):
    with serving(tmp_path, cert, key):
        pass


@pytest.mark.parametrize(
    "content",
    [
        b"not a key at all\n",
        b"-----BEGIN PRIVATE KEY-----\n!!!! not base64 !!!!\n-----END PRIVATE KEY-----\n",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n",  # no END line: a truncated copy
        b"",
    ],
    ids=["garbage", "bad-base64", "truncated", "empty"],
)
def test_garbage_key_names_the_key_file(tmp_path, certificate, content):
    cert, _ = certificate
    bad = tmp_path / "bad-key.pem"
    bad.write_bytes(content)
    with pytest.raises(InvalidConfigError, match="bad-key.pem") as info:
        start(tmp_path, cert, bad)
    assert "PEM" in str(info.value) and "private key" in str(info.value)
    assert "bind" not in str(info.value)


def test_garbage_certificate_names_the_certificate_file(tmp_path, certificate):
    _, key = certificate
    bad = tmp_path / "bad-cert.pem"
    bad.write_bytes(b"hello\n")
    with pytest.raises(InvalidConfigError, match="bad-cert.pem") as info:
        start(tmp_path, bad, key)
    assert "PEM" in str(info.value) and "certificate" in str(info.value)


def test_swapped_files_are_named(tmp_path, certificate):
    cert, key = certificate
    with pytest.raises(InvalidConfigError, match="certificate .*key.pem") as info:
        start(tmp_path, key, cert)  # a key where the certificate goes
    assert "PRIVATE KEY" in str(info.value)


def test_key_that_does_not_fit_its_certificate(tmp_path, certificate):
    cert, _ = certificate
    other = tmp_path / "other-key.pem"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "RSA", "-out", str(other)],
        check=True,
        capture_output=True,
    )
    with pytest.raises(InvalidConfigError, match="other-key.pem|cert.pem"):
        start(tmp_path, cert, other)


def test_valid_files_still_serve(tmp_path, certificate, patterned):
    cert, key = certificate
    with (
        serving(tmp_path, cert, key) as port,
        ReplayClient(f"127.0.0.1:{port}", tls=str(cert), timeout_s=10) as client,
    ):
        client.create_table(TableConfig.queue("t", 64))
        with client.writer("t") as writer:
            for episode in range(3):
                writer.write_segment(*patterned.segment(episode), episode_id=episode)
            writer.flush(timeout_s=10)
        got = patterned.drain(client, "t", 3 * patterned.L)
    assert sorted(got) == [(e, s) for e in range(3) for s in range(patterned.L)]


def test_serve_says_it_in_one_line_and_exits_nonzero(tmp_path, certificate):
    cert, _ = certificate
    bad = tmp_path / "garbage-key.pem"
    bad.write_bytes(b"garbage\n")
    flags = ["--port", "0", "--tls-cert", str(cert), "--tls-key", str(bad)]
    done = subprocess.run(
        [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(tmp_path / "s"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("millpond: error:")]
    assert len(errors) == 1 and "garbage-key.pem" in errors[0] and "PEM" in errors[0]


def test_a_taken_port_says_so_not_tls(tmp_path, certificate):
    first, port = create_server(ServerConfig(dir=str(tmp_path / "a")))
    try:
        config = ServerConfig(dir=str(tmp_path / "b"), port=port)
        with pytest.raises(InvalidConfigError, match=f"cannot bind 127.0.0.1:{port}"):
            create_server(config)
        cert, key = certificate
        tls = ServerConfig(dir=str(tmp_path / "c"), port=port, tls_cert=str(cert), tls_key=str(key))
        with pytest.raises(InvalidConfigError, match="cannot bind") as info:
            create_server(tls)
        assert "PEM" not in str(info.value)
    finally:
        first.stop(grace=0)
