"""Call cancellation: the gRPC calls of one operation, cancelled together.

A :class:`CallSet` tracks the calls in flight for one operation (a ``sample``, an
``iterate`` generator) and the sets of its sub-operations, so that one :meth:`~CallSet.cancel`
stops them all: a closed ``iterate`` generator drops its prefetched samples, and a
``sample`` whose shard failed stops asking the others. :class:`Cancelled` is what an
operation raises when its set was cancelled under it.
"""

from __future__ import annotations

import threading
from typing import Any


class Cancelled(Exception):
    """The operation's calls were cancelled (a closed ``iterate`` generator)."""


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
