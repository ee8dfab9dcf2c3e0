"""A :class:`grpc.RpcError` back to a millpond exception, and what a failed call means.

The status table itself is :mod:`millpond.protos.status`, shared with the servicer; this
module reads a failed call with it (code, details, the error class the server named),
keeping the server's message, so that a raw ``RpcError`` never reaches a user. It also
tells a shard that could not be reached from one that answered, and which failures a
pinned writer retries.
"""

from __future__ import annotations

import grpc

from millpond.errors import (
    AuthenticationError,
    MillpondError,
    PermissionDeniedError,
    ShardBusyError,
    ShardUnavailableError,
)
from millpond.protos.status import ERROR_KEY, error_from_status

#: Codes after which a pinned writer reconnects and re-sends (CANCELLED only when the
#: cancellation did not come from the writer itself; the caller checks that).
_RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)
#: What gRPC itself says when a call's own deadline passes (the server said nothing).
_CORE_DEADLINE = "deadline exceeded"


def code_of(err: BaseException) -> grpc.StatusCode | None:
    """The status code of an ``RpcError`` (``None`` for anything else)."""
    code = getattr(err, "code", None)
    try:
        return code() if callable(code) else None
    except Exception:  # a bare RpcError raised by hand has no code
        return None


def error_name_of(err: BaseException) -> str | None:
    """The error class the server named in the call's trailing metadata, if any."""
    trailing = getattr(err, "trailing_metadata", None)
    try:
        pairs = trailing() if callable(trailing) else None
    except Exception:
        pairs = None
    for key, value in pairs or ():
        if key == ERROR_KEY:
            return value
    return None


def details_of(err: BaseException) -> str:
    details = getattr(err, "details", None)
    try:
        text = details() if callable(details) else None
    except Exception:
        text = None
    return text or str(err)


def is_own_deadline(err: BaseException) -> bool:
    """Whether ``err`` is the call's own deadline, passed before the answer arrived (the
    server names every error it sends; gRPC's own deadline names none)."""
    return code_of(err) == grpc.StatusCode.DEADLINE_EXCEEDED and error_name_of(err) is None


def is_connect_failure(err: BaseException) -> bool:
    """Whether ``err`` says the shard could not be reached, rather than refused the call.

    UNAVAILABLE, or a deadline that gRPC enforced on its own (the server never answered);
    a DEADLINE_EXCEEDED *sent by the server* (a rate-limiter timeout) is an answer.
    """
    code = code_of(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    return (
        code == grpc.StatusCode.DEADLINE_EXCEEDED
        and error_name_of(err) is None  # the server names the errors it sends
        and details_of(err).strip().lower() == _CORE_DEADLINE
    )


def is_retryable(err: BaseException) -> bool:
    """Whether a writer should reconnect after ``err`` (see :data:`_RETRYABLE`).

    RESOURCE_EXHAUSTED is final (a message too large, a full disk) except when the shard
    is busy (:class:`ShardBusyError`: all the streams it serves at once are open) or gRPC
    says the server is at its limit of concurrent calls: those pass.
    """
    code = code_of(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return (
            error_name_of(err) == ShardBusyError.__name__
            or "concurrent rpc limit" in details_of(err).lower()
        )
    return code in _RETRYABLE or is_connect_failure(err)


def from_rpc_error(err: BaseException, address: str | None = None) -> MillpondError:
    """The millpond exception for ``err``, with the server's message.

    Raise it ``from err``. ``address`` names the shard in messages that gRPC wrote itself
    (unreachable shard, deadline passed), where the server's text says nothing about it.
    """
    code = code_of(err)
    message = details_of(err)
    if code is None:
        return MillpondError(message)
    if is_connect_failure(err) and address is not None:
        message = f"shard {address}: {message}"
    return error_from_status(code, message, error_name_of(err))


__all__ = [
    "AuthenticationError",
    "PermissionDeniedError",
    "ShardUnavailableError",
    "from_rpc_error",
    "is_connect_failure",
    "is_retryable",
]
