"""One table between millpond's errors and gRPC status codes, read by both sides of the wire.

The servicer answers a :class:`~millpond.errors.MillpondError` with the status code of its
class here, its message as the details, and the class's name in the trailing metadata
(:data:`ERROR_KEY`). The client turns a status back into that very class: by the name when
the server sent one (so a rate-limiter timeout is told from any other deadline without
reading the message), by the code's default class otherwise (gRPC's own failures, older
servers). Neither side keeps a mapping of its own.
"""

from __future__ import annotations

import errno

import grpc

from millpond.errors import (
    AuthenticationError,
    ClosedError,
    ColocationError,
    DeadlineExceededError,
    InvalidConfigError,
    InvalidDataError,
    MillpondError,
    PermissionDeniedError,
    RateLimiterTimeoutError,
    ResourceExhaustedError,
    ShardBusyError,
    ShardGoneError,
    ShardUnavailableError,
    StorageCorruptedError,
    TableExistsError,
    TableNotFoundError,
)

__all__ = ["ERROR_KEY", "STATUS", "error_from_status", "status_of"]

#: Trailing-metadata key that carries the class name of the error a status stands for.
ERROR_KEY = "millpond-error"

#: Each error class and its status code. The first class listed for a code is the one a
#: status without a class name comes back as.
STATUS: dict[type[MillpondError], grpc.StatusCode] = {
    InvalidDataError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    TableNotFoundError: grpc.StatusCode.NOT_FOUND,
    TableExistsError: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShardBusyError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    RateLimiterTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    StorageCorruptedError: grpc.StatusCode.DATA_LOSS,
    AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    ShardUnavailableError: grpc.StatusCode.UNAVAILABLE,
    ClosedError: grpc.StatusCode.UNAVAILABLE,
    # Raised in the client's own process (a resolver's verdict, a colocated read), listed so
    # that every public error has one code wherever it is reported.
    ShardGoneError: grpc.StatusCode.UNAVAILABLE,
    ColocationError: grpc.StatusCode.FAILED_PRECONDITION,
}

#: Errors that reach a client as another class: a closed table or shard is, for a client,
#: a shard that is going away (so it reconnects or routes around it as for any other).
_SENT_AS: dict[type[MillpondError], type[MillpondError]] = {ClosedError: ShardUnavailableError}

_BY_NAME = {cls.__name__: cls for cls in STATUS}
_DEFAULT: dict[grpc.StatusCode, type[MillpondError]] = {}
for _cls, _code in STATUS.items():
    _DEFAULT.setdefault(_code, _cls)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """``(code, details, error class name or None)`` to answer ``exc`` with.

    A millpond error takes the code of its nearest class in :data:`STATUS`; a full disk
    (``ENOSPC``, ``EDQUOT``) is RESOURCE_EXHAUSTED; anything else is INTERNAL.
    """
    if isinstance(exc, MillpondError):
        for cls in type(exc).__mro__:
            if cls in STATUS:
                return STATUS[cls], str(exc), _SENT_AS.get(cls, cls).__name__
        return grpc.StatusCode.UNKNOWN, str(exc), None
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"disk full: {exc}", "ResourceExhaustedError"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", None


def error_from_status(
    code: grpc.StatusCode, details: str, error_name: str | None = None
) -> MillpondError:
    """The millpond error a status stands for (see the module docstring); raise it ``from``."""
    cls = _BY_NAME.get(error_name or "")
    if cls is None or STATUS[cls] != code:  # a name that does not fit its code is ignored
        cls = _DEFAULT.get(code)
    if cls is None:
        return MillpondError(f"{code.name}: {details}")
    return cls(details)
