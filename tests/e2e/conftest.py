"""Fixtures of the end-to-end tests: a standalone ``millpond serve`` on free ports."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def start_server(tmp_path) -> Iterator[Callable[..., str]]:
    """``start_server(shards, *args)``: start ``millpond serve`` on free ports (with extra
    command-line ``args``); returns its address list.

    Stopped with SIGTERM at teardown, which must end it cleanly (exit code 0).
    """
    procs: list[tuple[subprocess.Popen, Path]] = []

    def start(shards: int, *args: str) -> str:
        out, err = tmp_path / "serve.out", tmp_path / "serve.err"
        cmd = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(tmp_path / "replay")]
        cmd += ["--port", "0", "--shards", str(shards), *args]
        with open(out, "w") as o, open(err, "w") as e:
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
        procs.append((proc, err))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for line in out.read_text().splitlines():
                if line.startswith("ADDRESSES "):
                    return line.split()[1]
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"millpond serve did not start:\n{err.read_text()[-3000:]}")

    yield start
    for proc, err in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        assert proc.returncode == 0, err.read_text()[-3000:]
