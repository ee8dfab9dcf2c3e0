"""The millpond exception hierarchy.

Every error millpond raises on purpose derives from :class:`MillpondError`, so a caller
can catch the family at once. The wire maps each class to one gRPC status code
(``millpond.protos.status``), the same table on the server and the client.
"""

from __future__ import annotations


class MillpondError(Exception):
    """Base class of all millpond errors."""


class InvalidConfigError(MillpondError, ValueError):
    """A configuration value (table config, CLI flag, YAML key) is invalid."""


class InvalidDataError(MillpondError, ValueError):
    """Inserted data does not match the table's spec or the segment layout."""


class TableNotFoundError(MillpondError, KeyError):
    """The named table does not exist on this shard."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class TableExistsError(MillpondError):
    """A table with this name exists already, with a different config."""


class ResourceExhaustedError(MillpondError):
    """A message is too large, or the disk is full."""


class ShardBusyError(ResourceExhaustedError):
    """The shard serves as many streams as it can at once; retry with backoff.

    A pinned writer does so on its own: the refusal keeps threads free for health checks
    and learners' calls, it does not say the data is unwelcome.
    """


class DeadlineExceededError(MillpondError, TimeoutError):
    """An operation did not complete within its timeout."""


class RateLimiterTimeoutError(DeadlineExceededError):
    """The rate limiter (or a full queue) blocked an insert or sample past its timeout."""


class StorageCorruptedError(MillpondError):
    """A shard directory cannot be opened: files are missing or inconsistent."""


class AuthenticationError(MillpondError):
    """The call carried no bearer token, or a wrong one."""


class PermissionDeniedError(MillpondError):
    """The caller is authenticated but its role may not perform this operation."""


class ShardUnavailableError(MillpondError, ConnectionError):
    """A shard cannot be reached (down, restarting, or shutting down)."""


class ClosedError(MillpondError):
    """The table or shard has been closed."""


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
    "ShardBusyError",
    "ShardUnavailableError",
    "StorageCorruptedError",
    "TableExistsError",
    "TableNotFoundError",
]
