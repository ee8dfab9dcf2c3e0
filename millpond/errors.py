"""The millpond exception hierarchy.

Every error millpond raises on purpose derives from :class:`MillpondError`, so a caller
can catch the family at once. The gRPC edge maps each class to one status code
(``GRPC_STATUS`` below), and the client maps status codes back to these classes.
"""

from __future__ import annotations


class MillpondError(Exception):
    """Base class of all millpond errors."""

    GRPC_STATUS = "UNKNOWN"


class InvalidConfigError(MillpondError, ValueError):
    """A configuration value (table config, CLI flag, YAML key) is invalid."""

    GRPC_STATUS = "INVALID_ARGUMENT"


class InvalidDataError(MillpondError, ValueError):
    """Inserted data does not match the table's spec or the segment layout."""

    GRPC_STATUS = "INVALID_ARGUMENT"


class TableNotFoundError(MillpondError, KeyError):
    """The named table does not exist on this shard."""

    GRPC_STATUS = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class TableExistsError(MillpondError):
    """A table with this name exists already, with a different config."""

    GRPC_STATUS = "ALREADY_EXISTS"


class ResourceExhaustedError(MillpondError):
    """A message is too large, or the disk is full."""

    GRPC_STATUS = "RESOURCE_EXHAUSTED"


class DeadlineExceededError(MillpondError, TimeoutError):
    """An operation did not complete within its timeout."""

    GRPC_STATUS = "DEADLINE_EXCEEDED"


class RateLimiterTimeoutError(DeadlineExceededError):
    """The rate limiter (or a full queue) blocked an insert or sample past its timeout."""


class StorageCorruptedError(MillpondError):
    """A shard directory cannot be opened: files are missing or inconsistent."""

    GRPC_STATUS = "DATA_LOSS"


class AuthenticationError(MillpondError):
    """The call carried no bearer token, or a wrong one."""

    GRPC_STATUS = "UNAUTHENTICATED"


class PermissionDeniedError(MillpondError):
    """The caller is authenticated but its role may not perform this operation."""

    GRPC_STATUS = "PERMISSION_DENIED"


class ShardUnavailableError(MillpondError, ConnectionError):
    """A shard cannot be reached (down, restarting, or shutting down)."""

    GRPC_STATUS = "UNAVAILABLE"


class ClosedError(MillpondError):
    """The table or shard has been closed."""

    GRPC_STATUS = "UNAVAILABLE"


__all__ = [
    "AuthenticationError",
    "ClosedError",
    "DeadlineExceededError",
    "InvalidConfigError",
    "InvalidDataError",
    "MillpondError",
    "PermissionDeniedError",
    "RateLimiterTimeoutError",
    "ResourceExhaustedError",
    "ShardUnavailableError",
    "StorageCorruptedError",
    "TableExistsError",
    "TableNotFoundError",
]
