"""How the client reaches a shard: gRPC channel options, TLS credentials, the bearer token.

Everything a channel needs before the first call: message size limits, keepalive and
reconnect timing (:func:`channel_options`), plaintext or TLS (:func:`channel_credentials`),
the ``authorization`` metadata sent with every call (:func:`bearer_metadata`), and
:func:`open_channel`, which puts them together for one address.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import grpc

from millpond.errors import InvalidConfigError

#: ``tls`` as the client takes it: ``None``/``False`` (plaintext), ``True`` or a PEM path.
TLS = bool | str | os.PathLike | None


#: A ping goes to the shard after this long without a frame from it (and every this long on
#: an idle channel); a ping unanswered for :data:`KEEPALIVE_TIMEOUT_MS` closes the
#: connection and fails its calls with UNAVAILABLE. A shard behind a silent link (a
#: partition, a host that lost power) is so noticed within about 6 s rather than when TCP
#: gives up (minutes). Servers allow pings this often (``service/server.py``).
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 4_000
#: How long one connection attempt may take (TCP and HTTP/2 handshakes). gRPC reads it from
#: ``grpc.min_reconnect_backoff_ms``; at 100 ms no connection formed at a 100 ms round
#: trip. 5 s allows for two lost SYNs; an attempt begun during a partition ends by then, so
#: a healed link is found again within this plus the reconnect backoff.
CONNECT_TIMEOUT_MS = 5_000
#: Reconnect backoff: the first retry after this, doubling up to the maximum, so that a
#: restarted shard is found again quickly.
RECONNECT_BACKOFF_MS = (100, 2_000)


def channel_options(max_message_mb: int) -> list[tuple[str, Any]]:
    """gRPC channel options: message size limits, keepalive, connect timeout, reconnects."""
    size = int(max_message_mb) * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging while nothing is sent
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]


def channel_credentials(tls: TLS) -> grpc.ChannelCredentials | None:
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


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata that authenticates every call (``None`` without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def open_channel(address: str, options: Sequence[tuple[str, Any]], tls: TLS) -> grpc.Channel:
    """A channel to ``address``: secure when ``tls`` asks for it, plaintext otherwise."""
    creds = channel_credentials(tls)
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)
