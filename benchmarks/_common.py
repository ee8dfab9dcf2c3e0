"""Helpers the benchmark scripts share: progress lines, settling, calibration, the code
version measured, and server subprocesses that print ``ADDRESSES a,b`` once serving."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


def settle() -> None:
    """Collect garbage and write dirty pages back, so one measurement's writeback stays its own."""
    gc.collect()
    os.sync()


def calibrate(fn: Callable[[], object], rep_seconds: float, at_least: int = 3) -> int:
    """Warm ``fn`` up and return how many calls make one repetition of ~``rep_seconds``."""
    t0 = time.perf_counter()
    n = 0
    while n < at_least or time.perf_counter() - t0 < min(0.3, rep_seconds):
        fn()
        n += 1
    per_call = (time.perf_counter() - t0) / n
    return max(at_least, int(rep_seconds / per_call))


def code_version(paths: Sequence[str]) -> str:
    """The git commit of the millpond code measured, and which of ``paths`` have local edits."""
    import millpond

    here = Path(millpond.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
    except OSError:
        return f"{here} (no git)"
    if not head:
        return f"{here} (not a git checkout)"
    edited = sorted({line[3:] for line in dirty if line[3:].endswith(".py")})
    return f"commit {head}" + (f" with local edits in {', '.join(edited)}" if edited else "")


class ServerProcess:
    """A server subprocess that prints ``ADDRESSES a,b`` once serving; SIGTERM stops it."""

    def __init__(self, cmd: list[str], log_path: Path, label: str) -> None:
        self.label = label
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True
        )
        assert self.proc.stdout is not None
        self.addresses: list[str] = []
        for line in self.proc.stdout:
            if line.startswith("ADDRESSES "):
                self.addresses = line.split()[1].split(",")
                break
        if not self.addresses:
            code = self.proc.wait()
            self._log.close()
            raise RuntimeError(f"{label} exited ({code}) before serving:\n{self.tail()}")
        # Keep reading stdout so that a chatty child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        log(f"{label}: serving {','.join(self.addresses)} ({time.perf_counter() - t0:.1f} s)")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            if code != 0:
                log(f"{self.label}: exited with code {code}:\n{self.tail()}")
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def millpond_serve(root: Path, shards: int = 1) -> ServerProcess:
    """``millpond serve --shards N`` on free ports under ``root``."""
    d = root / f"serve-{shards}"
    cmd = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(d), "--port", "0"]
    cmd += ["--shards", str(shards)]
    return ServerProcess(cmd, root / f"serve-{shards}.log", f"millpond serve --shards {shards}")
