"""The weight store: the latest published policy weights, a versioned blob kept on disk.

Learners publish, actors fetch: the shard is the rendezvous point. The blob is opaque here
(the client serialises a state dict with the tensor codec). Publishing writes the file
atomically, so a restarted shard serves the last version it acknowledged: after a killed
process always (the kernel's page cache keeps what was written); after a machine crash when
the store flushes each publication to disk (``fsync``, the shard's ``--fsync``, as its
inserts).

**Bounded staleness.** An env actor that names itself when it fetches tells the store which
version it acts with until its next fetch, or that it stops acting (to write what it
collected). A publication with ``max_lag`` is stored only once every actor acting holds
``version - max_lag`` or newer: the learner waits for the actors, never the other way round,
and an actor that is writing (perhaps held back by the rate limiter, waiting for the
learner) holds nothing back, since it fetches again before it acts. An actor silent for
:data:`ACTING_EXPIRY_S` (a process that died while acting) no longer counts. The registry is
not kept on disk: a restarted shard knows no actor until each fetches again.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from millpond.errors import DeadlineExceededError, InvalidDataError
from millpond.service.atomic_json import atomic_write_json, write_file

#: Seconds after its last fetch that an acting env actor stops holding publications back.
ACTING_EXPIRY_S = 30.0


class WeightStore:
    """Holds the newest ``(version, blob)``; ``version`` is -1 until something is published.

    ``fsync``: flush each publication to disk before it is acknowledged (three flushes: the
    blob, the index and the directory), so that it survives a machine crash too. Without,
    a publication costs a learner's rendezvous ~0.3 ms of CPU instead of ~0.6 ms and ~2.5 ms
    of waiting on the disk (a DQN learner publishes ~50 times a second).
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._version = -1
        self._blob = b""
        self._acting: dict[str, tuple[int, float]] = {}  # actor -> (version, last fetch)
        for leftover in self.path.glob("weights-*.tmp"):  # publications a crash cut short
            leftover.unlink(missing_ok=True)
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

    def publish(
        self,
        version: int,
        blob: bytes,
        max_lag: int | None = None,
        wait: Callable[[], float | None] | None = None,
    ) -> float:
        """Store ``blob`` as ``version``, which must be newer than the current one; returns
        the seconds it waited for the acting actors.

        With ``max_lag``, wait first until every actor acting holds ``version - max_lag``
        or newer (see the module docstring). ``wait()`` gives each slice of that wait
        (``None``: no end) and raises when the caller gives up; without it, the store waits
        for as long as it takes.
        """
        if version < 0:
            raise InvalidDataError(f"weights version ({version}) must be >= 0")
        if max_lag is not None and max_lag < 0:
            raise InvalidDataError(f"max_lag ({max_lag}) must be >= 0")
        with self._cond:
            self._check_newer(version)  # refused before anything is written
        data_file = self.path / f"weights-{version}.bin"
        tmp = self.path / f"weights-{version}.{threading.get_ident()}.tmp"
        waited = 0.0
        try:
            # Written before the lock is taken: the actors' fetches (every chunk) never wait
            # for a publication's fsync, only for the rename and the small index below.
            write_file(tmp, blob, self.fsync)
            started = time.monotonic()
            with self._cond:
                self._check_newer(version)
                if max_lag is not None:
                    while (oldest := self._oldest_acting()) is not None and (
                        oldest < version - max_lag
                    ):
                        left = wait() if wait is not None else None
                        if left is not None and left <= 0:
                            raise DeadlineExceededError(
                                f"weights version {version} waited "
                                f"{time.monotonic() - started:.1f} s for the actors acting "
                                f"with version {oldest} (max_lag {max_lag})"
                            )
                        # an actor expires, or fetches (and notifies), within this
                        self._cond.wait(min(ACTING_EXPIRY_S, 1.0 if left is None else left))
                    self._check_newer(version)  # another publication may have come meanwhile
                    waited = time.monotonic() - started
                os.replace(tmp, data_file)
                atomic_write_json(
                    self.path / "weights.json",
                    {"version": version, "size": len(blob)},
                    fsync=self.fsync,
                )
                old = self.path / f"weights-{self._version}.bin"
                self._version, self._blob = version, blob
                if old != data_file and old.exists():
                    old.unlink()
                self._cond.notify_all()
        finally:
            tmp.unlink(missing_ok=True)  # refused, timed out or a full disk: nothing left
        return waited

    def get(
        self,
        min_version: int = 0,
        timeout: float = 0.0,
        actor: str = "",
        acting: bool = False,
    ) -> tuple[int, bytes | None]:
        """``(version, blob)`` of the latest weights, waiting up to ``timeout`` seconds for
        ``min_version``; the blob is ``None`` if the latest is older than ``min_version``.

        A named ``actor`` acts from now on with the version answered (its own, ``min_version
        - 1``, when no blob is), or, not ``acting``, holds no publication back."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._version < min_version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            blob = self._blob if self._version >= min_version else None
            if actor:
                if acting:
                    held = self._version if blob is not None else min_version - 1
                    self._acting[actor] = (held, time.monotonic())
                else:
                    self._acting.pop(actor, None)
                self._cond.notify_all()  # a publication may wait for this actor
            return self._version, blob

    def acting(self) -> dict[str, int]:
        """The version each actor acting now holds (those not expired)."""
        with self._cond:
            horizon = time.monotonic() - ACTING_EXPIRY_S
            return {a: v for a, (v, seen) in self._acting.items() if seen >= horizon}

    def _oldest_acting(self) -> int | None:
        horizon = time.monotonic() - ACTING_EXPIRY_S
        held = [v for v, seen in self._acting.values() if seen >= horizon]
        return min(held) if held else None

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise InvalidDataError(
                f"weights version {version} is not newer than the published version {self._version}"
            )
