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
