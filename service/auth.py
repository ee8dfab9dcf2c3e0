"""Bearer-token authentication with roles, as a gRPC server interceptor.

A token file holds one token per line, ``ROLE TOKEN`` (``#`` starts a comment). Roles:

- ``writer``: Insert, GetWeights, Info (what env actors need);
- ``learner``: Sample, UpdatePriorities, PublishWeights (and PublishWeightsAtOnce), Info;
- ``admin``: everything, table creation, checkpoints and resets included.

A call without a valid token is UNAUTHENTICATED; a valid token whose role may not call the
method is PERMISSION_DENIED. Tokens are compared in constant time and never logged.
Health checks are open, so that orchestrators can probe a shard.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Callable
from pathlib import Path

import grpc

from millpond.errors import InvalidConfigError

ROLES = ("writer", "learner", "admin")
_SERVICE = "/millpond.v1.Replay/"
_ALLOWED: dict[str, frozenset[str]] = {
    "writer": frozenset({"Insert", "GetWeights", "Info"}),
    "learner": frozenset(
        {"Sample", "UpdatePriorities", "PublishWeights", "PublishWeightsAtOnce", "Info"}
    ),
}


_COMMENT = re.compile(r"(^|\s)#.*$")


def load_tokens(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Read ``(role, token)`` pairs from a token file; raises :class:`InvalidConfigError`.

    One ``ROLE TOKEN`` per line; ``#`` starts a comment at the start of a line or after
    whitespace, and is part of the token anywhere else.
    """
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise InvalidConfigError(f"cannot read token file {p}: {e.strerror}") from None
    tokens = []
    for n, line in enumerate(lines, 1):
        # A comment starts a line or follows whitespace: '#' inside a token is the token's.
        line = _COMMENT.sub("", line).strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in ROLES:
            raise InvalidConfigError(f"{p}:{n}: expected 'ROLE TOKEN' with ROLE one of {ROLES}")
        if len(parts[1]) < 8:
            raise InvalidConfigError(f"{p}:{n}: token too short (at least 8 characters)")
        tokens.append((parts[0], parts[1]))
    if not tokens:
        raise InvalidConfigError(f"token file {p} holds no tokens")
    return tokens


def role_allows(role: str, method: str) -> bool:
    """Whether ``role`` may call the Replay method named ``method`` (e.g. ``"Sample"``)."""
    return role == "admin" or method in _ALLOWED.get(role, frozenset())


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects Replay calls whose bearer token is missing, unknown, or of the wrong role."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self._tokens = [(role, token.encode()) for role, token in tokens]

    def _role_of(self, presented: bytes) -> str | None:
        role_found = None
        for role, token in self._tokens:  # no early exit: time does not depend on the match
            if hmac.compare_digest(presented, token):
                role_found = role
        return role_found

    def intercept_service(self, continuation: Callable, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(_SERVICE):
            return continuation(handler_call_details)
        name = method[len(_SERVICE) :]
        header = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        presented = header[7:].encode() if header.startswith("Bearer ") else b""
        role = self._role_of(presented) if presented else None
        if role is None:
            return _deny(
                continuation(handler_call_details),
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid bearer token",
            )
        if not role_allows(role, name):
            return _deny(
                continuation(handler_call_details),
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {role!r} may not call {name}",
            )
        return continuation(handler_call_details)


def _deny(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str):
    def abort(_request, context):
        context.abort(code, message)

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            abort, handler.request_deserializer, handler.response_serializer
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            abort, handler.request_deserializer, handler.response_serializer
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            abort, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        abort, handler.request_deserializer, handler.response_serializer
    )
