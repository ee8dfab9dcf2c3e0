"""The client's view of its shards: channels, up/down state, and how a batch is split.

A :class:`ShardHandle` owns one lazily created gRPC channel and remembers whether the shard
answered lately. :func:`split_batch` divides a batch among shards in proportion to their
sampleable mass. :class:`CallSet` tracks the gRPC calls of one operation so that they can
all be cancelled at once (a closed ``iterate`` generator, a failed ``sample``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from millpond.errors import InvalidConfigError
from millpond.protos import millpond_pb2_grpc as pb_grpc

#: Seconds between attempts to reach a shard that was found down.
RETRY_DOWN_S = 3.0


def channel_options(max_message_mb: int) -> list[tuple[str, Any]]:
    """gRPC channel options: message size limits, keepalive, quick reconnects.

    Keepalive pings every 5 minutes: servers by default refuse pings that come more often on
    an idle connection (``grpc.http2.min_recv_ping_interval_without_data_ms``, 5 minutes).
    Reconnect backoff is capped at 2 s, so a restarted shard is found again quickly.
    """
    size = int(max_message_mb) * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 300_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def channel_credentials(tls: bool | str | os.PathLike | None) -> grpc.ChannelCredentials | None:
    """``None`` (plaintext), system roots (``True``) or a PEM root certificate file."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    try:
        with open(tls, "rb") as f:
            roots = f.read()
    except OSError as e:
        raise InvalidConfigError(f"tls ({tls!r}): cannot read the root certificate: {e}") from e
    return grpc.ssl_channel_credentials(root_certificates=roots)


class ShardHandle:
    """One shard as the client sees it: address, channel, stub, and whether it is up.

    Attributes:
        index: the shard's position in the client's list (stable: shards are only appended).
        address: ``host:port``.
        down: the last call found the shard unreachable; its mass counts as 0 meanwhile.
        retry_at: ``time.monotonic()`` after which a down shard is tried again.
    """

    def __init__(
        self,
        index: int,
        address: str,
        options: Sequence[tuple[str, Any]],
        tls: bool | str | os.PathLike | None,
    ) -> None:
        self.index = index
        self.address = address
        self._options = list(options)
        self._tls = tls
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ReplayStub | None = None
        self.down = False
        self.retry_at = 0.0

    @property
    def stub(self) -> pb_grpc.ReplayStub:
        """The Replay stub, creating the channel on first use."""
        stub = self._stub
        if stub is not None:
            return stub
        with self._lock:
            if self._stub is None:
                creds = channel_credentials(self._tls)
                if creds is None:
                    self._channel = grpc.insecure_channel(self.address, options=self._options)
                else:
                    self._channel = grpc.secure_channel(self.address, creds, options=self._options)
                self._stub = pb_grpc.ReplayStub(self._channel)
            return self._stub

    def mark_down(self) -> bool:
        """Record that the shard is unreachable; returns whether it was up until now."""
        with self._lock:
            was_up = not self.down
            self.down = True
            self.retry_at = time.monotonic() + RETRY_DOWN_S
            return was_up

    def mark_up(self) -> bool:
        """Record that the shard answered; returns whether it was down until now."""
        with self._lock:
            was_down = self.down
            self.down = False
            return was_down

    def due_for_retry(self, now: float) -> bool:
        return self.down and now >= self.retry_at

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None

    def __repr__(self) -> str:
        return f"ShardHandle({self.index}, {self.address!r}{', down' if self.down else ''})"


def split_batch(n: int, masses: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Split ``n`` draws among shards in proportion to ``masses`` (systematic sampling).

    Each shard gets ``floor(n * p)`` or one more, with expectation exactly ``n * p``, so the
    merged batch samples every stored step with the same probability it would have in one
    table holding everything. Shards with zero mass get nothing; ``sum(masses)`` must be > 0.
    """
    m = np.clip(np.asarray(masses, dtype=np.float64), 0.0, None)
    total = m.sum()
    if not total > 0:
        raise ValueError("split_batch needs a positive total mass")
    edges = np.floor(np.cumsum(m / total) * n + rng.random()).astype(np.int64)
    edges = np.clip(edges, 0, n)
    edges[-1] = n  # floor(n + u) == n; rounding in the cumulative sum may say n - 1
    return [int(c) for c in np.diff(edges, prepend=0)]


class CallSet:
    """The gRPC calls of one operation, cancellable at once (children included)."""

    def __init__(self, parent: CallSet | None = None) -> None:
        self._lock = threading.Lock()
        self._calls: set[Any] = set()
        self._children: set[CallSet] = set()
        self._parent = parent
        self.cancelled = False
        if parent is not None:
            parent._adopt(self)

    def _adopt(self, child: CallSet) -> None:
        with self._lock:
            self._children.add(child)
            cancelled = self.cancelled
        if cancelled:
            child.cancel()

    def child(self) -> CallSet:
        return CallSet(self)

    def add(self, call: Any) -> bool:
        """Track ``call``; if the set was cancelled already, cancel it and return False."""
        with self._lock:
            if not self.cancelled:
                self._calls.add(call)
                return True
        call.cancel()
        return False

    def discard(self, call: Any) -> None:
        with self._lock:
            self._calls.discard(call)

    def cancel(self) -> None:
        """Cancel every tracked call and child; later :meth:`add` calls cancel at once."""
        with self._lock:
            self.cancelled = True
            calls, children = list(self._calls), list(self._children)
            self._calls.clear()
        for call in calls:
            call.cancel()
        for child in children:
            child.cancel()

    def release(self) -> None:
        """Detach from the parent (the operation is over)."""
        if self._parent is not None:
            with self._parent._lock:
                self._parent._children.discard(self)
