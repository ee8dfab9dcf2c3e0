"""The weight store: the latest published policy weights, a versioned blob kept on disk.

Learners publish, actors fetch: the shard is the rendezvous point. The blob is opaque here
(the client serialises a state dict with the tensor codec). Publishing writes the file
atomically, so a restarted shard serves the last version it acknowledged.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from millpond.errors import InvalidDataError
from millpond.service.atomic_json import atomic_write_json


class WeightStore:
    """Holds the newest ``(version, blob)``; ``version`` is -1 until something is published."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._version = -1
        self._blob = b""
        meta = self.path / "weights.json"
        if meta.exists():
            try:
                version = int(json.loads(meta.read_text())["version"])
                blob = (self.path / f"weights-{version}.bin").read_bytes()
            except (OSError, ValueError, KeyError):
                version, blob = -1, b""  # an interrupted publish: serve nothing rather than junk
            self._version, self._blob = version, blob

    @property
    def version(self) -> int:
        return self._version

    def publish(self, version: int, blob: bytes) -> None:
        """Store ``blob`` as ``version``, which must be newer than the current one."""
        if version < 0:
            raise InvalidDataError(f"weights version ({version}) must be >= 0")
        with self._cond:
            if version <= self._version:
                raise InvalidDataError(
                    f"weights version {version} is not newer than the published version "
                    f"{self._version}"
                )
            data_file = self.path / f"weights-{version}.bin"
            tmp = data_file.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, data_file)
            atomic_write_json(self.path / "weights.json", {"version": version, "size": len(blob)})
            old = self.path / f"weights-{self._version}.bin"
            self._version, self._blob = version, blob
            if old != data_file and old.exists():
                old.unlink()
            self._cond.notify_all()

    def get(self, min_version: int = 0, timeout: float = 0.0) -> tuple[int, bytes | None]:
        """``(version, blob)`` of the latest weights, waiting up to ``timeout`` seconds for
        ``min_version``; the blob is ``None`` if the latest is older than ``min_version``."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._version < min_version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return self._version, None
                self._cond.wait(remaining)
            return self._version, self._blob
