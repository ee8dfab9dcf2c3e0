"""The edge every RPC of a shard shares: exceptions mapped to gRPC statuses, blocking waits
cut into slices so that a cancelled call frees its thread, and the bounds of the fields
every request may carry (``timeout_ms``, a table name).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from millpond.config import MAX_NAME_BYTES, MAX_TIMEOUT_MS
from millpond.errors import InvalidDataError, RateLimiterTimeoutError, ResourceExhaustedError
from millpond.protos.status import ERROR_KEY, status_of

log = logging.getLogger("millpond.server")
T = TypeVar("T")

# Blocking waits are cut into slices this long, to notice a cancelled call.
_POLL_S = 0.5
# Error details travel in a header: a message quoting a megabyte name would not arrive.
_MAX_DETAILS = 2000


def edge(method: Callable) -> Callable:
    """Map exceptions raised by an RPC method (plain or generator) to gRPC statuses."""

    def fail(servicer, exc: BaseException, context: grpc.ServicerContext) -> None:
        if isinstance(exc, grpc.RpcError) or not context.is_active():
            # The client went away (cancelled, its deadline passed) or the server is
            # stopping: nobody to answer, and no error of this shard's to count.
            return
        if isinstance(exc, MemoryError):  # what a request asked for does not fit: say so
            exc = ResourceExhaustedError(f"out of memory serving {method.__name__}: {exc}")
        code, message, error_name = status_of(exc)
        if isinstance(exc, RateLimiterTimeoutError):  # the wait the client asked for, over
            servicer.metrics.timed_out(method.__name__)
        else:
            servicer.metrics.error(method.__name__, code.name)
        if len(message) > _MAX_DETAILS:
            message = f"{message[:_MAX_DETAILS]}... ({len(message)} characters)"
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method.__name__)
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # a client asking for more than this shard allows: worth an operator's eye, once
            log.warning("%s refused: %s", method.__name__, message)
        if error_name is not None:
            context.set_trailing_metadata(((ERROR_KEY, error_name),))
        context.abort(code, message)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:
                fail(self, exc, context)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:
            fail(self, exc, context)

    return unary


class Cancelled(Exception):
    """The client cancelled the call (or it timed out) while the shard waited for it."""


class Slices:
    """A wait of ``timeout`` seconds (``None``: no end) taken in slices of at most
    :data:`_POLL_S`: a blocking wait (the rate limiter's, or for newer weights) cannot see a
    cancelled call, a wait cut into slices does."""

    def __init__(self, timeout: float | None, context: grpc.ServicerContext) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._context = context

    def next(self) -> float:
        """The seconds the next slice may wait; :class:`Cancelled` once the call is."""
        if not self._context.is_active():
            raise Cancelled
        deadline = self._deadline
        wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        return max(0.0, wait)

    @property
    def over(self) -> bool:
        """Whether the whole wait has run out."""
        return self._deadline is not None and time.monotonic() >= self._deadline


def in_slices(attempt: Callable[[float], T], timeout: float | None, context) -> T:
    """``attempt(wait_s)`` again and again in :class:`Slices`, until it returns.

    A call cancelled meanwhile frees its thread within a slice (raising
    :class:`Cancelled`). The last :class:`RateLimiterTimeoutError` passes once ``timeout``
    (``None``: none) has run out.
    """
    slices = Slices(timeout, context)
    while True:
        wait = slices.next()
        try:
            return attempt(wait)
        except RateLimiterTimeoutError:
            if slices.over:
                raise


def timeout_s(ms: int) -> float | None:
    """``timeout_ms`` in seconds (``None``: 0, wait forever), at most :data:`MAX_TIMEOUT_MS`
    (longer waits overflow the thread waits they end up in)."""
    if not 0 <= ms <= MAX_TIMEOUT_MS:
        raise InvalidDataError(
            f"timeout_ms ({ms}) must be in [0, {MAX_TIMEOUT_MS}] (0: no timeout; the most "
            "is 30 days)"
        )
    return ms / 1000 if ms else None


def check_name(name: str) -> str:
    """A table name of a request, refused by name when longer than any table's can be."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise InvalidDataError(
            f"table name ({name[:64]!r}...) takes {size} bytes, more than the limit "
            f"({MAX_NAME_BYTES} bytes)"
        )
    return name
