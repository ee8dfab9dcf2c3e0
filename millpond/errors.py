"""The millpond exception hierarchy.

Every error millpond raises on purpose derives from :class:`MillpondError`, so a caller
can catch the family at once. The wire maps each class a shard raises to one gRPC status
code (``millpond.protos.status``), the same table on the server and the client; the client's
own errors (:class:`ShardGoneError`, :class:`ColocationError`) are raised where they arise,
in the client's process, and never cross the wire.
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


class ShardGoneError(ShardUnavailableError):
    """The shard is lost for good (its supervisor cannot bring it back).

    A client's ``resolver`` raises it for such a shard; the client then never tries the
    shard again, and a writer pinned to it stops with it, its unacknowledged segments lost
    with the shard (its owner may write on to another shard).
    """


class ClosedError(MillpondError):
    """The table or shard has been closed."""


class ColocationError(MillpondError):
    """A table's files cannot be read on this host; the message says why."""


__all__ = [
    "AuthenticationError",
    "ClosedError",
    "ColocationError",
    "DeadlineExceededError",
    "InvalidConfigError",
    "InvalidDataError",
    "MillpondError",
    "PermissionDeniedError",
    "RateLimiterTimeoutError",
    "ResourceExhaustedError",
    "ShardBusyError",
    "ShardGoneError",
    "ShardUnavailableError",
    "StorageCorruptedError",
    "TableExistsError",
    "TableNotFoundError",
]
