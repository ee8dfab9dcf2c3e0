"""Checking a reopened table's segments against their checksums after it opens.

A reopen reads the segments' records and slot pointers, not their data
(:meth:`~millpond.service.recovery.Recovery.recover` with ``check_data=False``): the kept
segments are *unverified*, and this module checks them, so that a restarted shard serves at
once whatever its table's size, and never a row that was not checked:

* before a read: every path that returns rows (samples in every form, the ReadTable
  snapshot, exports) first checks the unverified segments it is about to read
  (:meth:`Verifier.check_slots`); a damaged one is dropped as recovery drops one
  (unpublished, counted in ``dropped_segments``, logged), then redrawn or left out;
* in the background: a thread (:meth:`Verifier.start`) checks the rest in slot order, about
  :data:`CHUNK_BYTES` at a time (at most ``rate_mb`` MiB/s if given), so that the whole
  table is verified a while after it opens, read or not. It gives way to reads that are
  checking segments (it waits between chunks while one does): a sample's checks are what
  its caller waits for, and the thread's are not.

Each check reads the segments' bytes outside the table's lock and records what it found
under it, where a segment overwritten meanwhile (its generation changed) is told apart from
a damaged one (:meth:`~millpond.service.recovery.Recovery.settle`). Segments published
after the open were checksummed from their rows by their writers: verified from the start.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from millpond.errors import InvalidConfigError
from millpond.service.segment_batch import SegmentBatch

if TYPE_CHECKING:
    from millpond.service.storage import SegmentStorage

log = logging.getLogger(__name__)

#: When a reopened table checks its segments' data: ``background`` (a thread checks them
#: all after the open; reads check what they touch first), ``reads`` (only what reads
#: touch, and everything before an export), ``open`` (all of them before the open returns).
VERIFY_MODES = ("background", "reads", "open")
#: About this many bytes of segment data per check of the background thread (the table's
#: lock is taken twice per chunk, briefly; never held while reading).
CHUNK_BYTES = 8 << 20


def check_verify_settings(verify: str, rate_mb: float) -> None:
    """Refuse an unknown verify mode or a negative rate (:class:`InvalidConfigError`)."""
    if verify not in VERIFY_MODES:
        raise InvalidConfigError(f"verify ({verify!r}) must be one of {', '.join(VERIFY_MODES)}")
    if not rate_mb >= 0:
        raise InvalidConfigError(f"verify_rate_mb ({rate_mb!r}) must be >= 0 (0: no limit)")


class Verifier:
    """The checks of one table's unverified segments (see the module docstring).

    Args:
        name: the table's, for the thread's name and the log.
        cond: the table's lock.
        storage: the table's storage.
        drop: unpublishes damaged segments, counts and logs them (called under ``cond``).
        rate_mb: the background thread reads at most this many MiB/s (0: no limit).
    """

    def __init__(
        self,
        name: str,
        cond: threading.Condition,
        storage: SegmentStorage,
        drop: Callable[[SegmentBatch], None],
        rate_mb: float = 0.0,
    ) -> None:
        self._name = name
        self._cond = cond
        self._storage = storage
        # Weakly: a table that holds its verifier is freed (its maps unmapped) when dropped.
        self._drop_ref = weakref.WeakMethod(drop)
        self._rate = rate_mb * (1 << 20)
        self._chunk = threading.Lock()  # one background chunk at a time, whoever runs it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._readers = 0  # reads checking segments now: the thread waits for them
        self._idle = threading.Condition(threading.Lock())

    def check_slots(self, slots: np.ndarray, everything: bool = False) -> bool:
        """Check the unverified segments holding ``slots`` (``everything``: every one of
        them), outside the table's lock; returns whether any was damaged (and dropped)."""
        if not everything and not self._storage.unverified:
            return False
        with self._cond:
            records, rows = self._storage.to_check(slots, everything)
        if not len(records):
            return False
        with self._idle:
            self._readers += 1
        try:
            return self._check(records, rows)
        finally:
            with self._idle:
                self._readers -= 1
                self._idle.notify_all()

    def check_locked(self, slots: np.ndarray, everything: bool = False) -> bool:
        """:meth:`check_slots` for a caller holding the table's lock (a queue's batch,
        read under it)."""
        records, rows = self._storage.to_check(slots, everything)
        if not len(records):
            return False
        damaged = self._storage.settle(records, rows, self._storage.check(records, rows))
        return self._drop(damaged)

    def _check(self, records: np.ndarray, rows: np.ndarray) -> bool:
        if not len(records):
            return False
        ok = self._storage.check(records, rows)
        with self._cond:
            if self._stop.is_set():  # closing: the storage may be gone
                return False
            return self._drop(self._storage.settle(records, rows, ok))

    def _drop(self, damaged: SegmentBatch) -> bool:
        """Have the table drop ``damaged`` (under its lock); whether there were any."""
        drop = self._drop_ref()
        if len(damaged) and drop is not None:
            drop(damaged)
        return bool(len(damaged))

    def _step(self) -> int | None:
        """Check the next chunk of unverified segments: the bytes read, ``None`` when none
        is left."""
        with self._idle:  # reads first
            while self._readers and not self._stop.is_set():
                self._idle.wait(0.1)
        with self._chunk:
            with self._cond:
                if self._stop.is_set():
                    return None
                records, rows, size = self._storage.next_unverified(CHUNK_BYTES)
            if not len(records):
                return None
            self._check(records, rows)
        return size

    def finish(self) -> None:
        """Check every segment still unverified, in the calling thread (taking turns with
        the background thread, a chunk each)."""
        while self._step() is not None:
            pass

    def start(self) -> None:
        """Check the unverified segments in a background thread (none if there are none)."""
        if self._storage.unverified and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"millpond-verify-{self._name}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        segments, total = self._storage.unverified, 0
        try:
            while (read := self._step()) is not None:
                total += read
                if self._rate:  # the time this chunk may take at the rate, less what it took
                    ahead = start + total / self._rate - time.monotonic()
                    if ahead > 0 and self._stop.wait(ahead):
                        break
        except Exception:  # a bug: logged, and reads still check what they touch
            log.exception("table %r: background verification stopped", self._name)
            return
        if not self._stop.is_set():
            log.info(
                "table %r: verified the %d segments left unchecked at open (%.1f MiB) in %.2f s",
                self._name,
                segments,
                total / (1 << 20),
                time.monotonic() - start,
            )

    @property
    def running(self) -> bool:
        """Whether the background thread is still checking."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop checking (the table is closing): the thread ends after its chunk."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
