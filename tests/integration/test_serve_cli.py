"""`millpond serve` as a user runs it: a real process, signals, restarts, several shards."""

import signal
import subprocess
import sys

import grpc
import pytest

from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc

TABLES = """
tables:
  - name: replay
    sampler: uniform
    capacity: 1000
"""


def start(*args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "millpond.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("ADDRESSES "):
            return proc, line.split()[1].split(",")
    raise AssertionError(f"server did not start: {proc.wait()} {proc.stderr.read()}")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    proc.stdout.close()
    proc.stderr.close()
    return code


def info(address):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReplayStub(channel).Info(pb.InfoRequest(), timeout=10)


def test_serve_creates_tables_stops_cleanly_and_resumes(tmp_path):
    tables = tmp_path / "tables.yaml"
    tables.write_text(TABLES)
    proc, addresses = start("--dir", str(tmp_path / "d"), "--tables", str(tables))
    assert len(addresses) == 1 and addresses[0].startswith("127.0.0.1:")
    assert [t.config.name for t in info(addresses[0]).tables] == ["replay"]
    assert stop(proc) == 0
    proc, addresses = start("--dir", str(tmp_path / "d"))  # no --tables: resumed from disk
    assert [t.config.name for t in info(addresses[0]).tables] == ["replay"]
    assert stop(proc) == 0


def test_serve_several_shards(tmp_path):
    tables = tmp_path / "tables.yaml"
    tables.write_text(TABLES)
    proc, addresses = start("--dir", str(tmp_path / "d"), "--shards", "3", "--tables", str(tables))
    assert len(set(addresses)) == 3
    for address in addresses:
        assert [t.config.name for t in info(address).tables] == ["replay"]
    assert stop(proc) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["shard-0", "shard-1", "shard-2"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("tables: [{name: t, capacity: 10, colour: red}]", "unknown table config key"),
        ("tables: [{name: t, capacity: -1}]", "capacity"),
        ("tables: {}", "'tables' list"),
        ("tables: [", "not valid YAML"),
    ],
)
def test_bad_tables_file_is_one_clear_error(tmp_path, content, message):
    tables = tmp_path / "tables.yaml"
    tables.write_text(content)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "millpond.cli",
            "serve",
            "--dir",
            str(tmp_path / "d"),
            "--port",
            "0",
            "--tables",
            str(tables),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_missing_tables_file(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "millpond.cli",
            "serve",
            "--dir",
            str(tmp_path / "d"),
            "--port",
            "0",
            "--tables",
            str(tmp_path / "missing.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot read tables file" in result.stderr
