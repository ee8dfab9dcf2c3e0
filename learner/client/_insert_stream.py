"""A writer's queue of unacknowledged messages and the thread that streams them to its shard.

An :class:`InsertStream` numbers the messages it is given and keeps them until the shard
acknowledges them. Its background thread owns the bidirectional ``Insert`` stream: it sends
queued messages (several per request when many wait, at most :data:`REQUESTS_IN_FLIGHT`
requests unanswered), reads the acknowledgements, and drops acknowledged messages. When the
shard goes away it reconnects with exponential backoff and re-sends every unacknowledged
segment in sequence order; the shard stores a ``(writer id, sequence)`` once, so nothing is
lost or duplicated. A non-retryable error is kept and raised by the writer's next call.

When the client has a resolver (see :mod:`millpond.learner.client._shards`), each failed
attempt asks it where the shard is: a shard restarted on another port is dialled there (and
the unacknowledged segments re-sent to it), and a shard lost for good stops the stream with
:class:`~millpond.errors.ShardGoneError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from millpond.errors import ClosedError, DeadlineExceededError, MillpondError, ShardGoneError
from millpond.learner.client._errors import from_rpc_error, is_retryable
from millpond.learner.client._insert_messages import MessagePacker, Queued
from millpond.learner.client._shards import ShardHandle
from millpond.protos import wire

logger = logging.getLogger("millpond.client")

#: Reconnect backoff: starts here, doubles after each failed attempt, up to the maximum.
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
#: Insert requests sent and not answered yet, at most. Segments written meanwhile wait and go
#: together in the next request, so batching follows the shard's pace: small segments no
#: longer travel one per request (each request costs the shard and the client far more than
#: a small segment's bytes), while two requests in flight keep the shard busy.
REQUESTS_IN_FLIGHT = 2
#: A stream with nothing to acknowledge for this long is ended (half-closed); the next write
#: opens a new one. An open stream holds a server thread, and a shard admits a bounded
#: number of Insert streams, so an idle writer must not keep a busy one out.
IDLE_STREAM_S = 10.0


class InsertStream:
    """One writer's unacknowledged messages, streamed to its shard by a background thread.

    Args:
        shard: the shard the writer is pinned to.
        table: the table to insert into.
        writer_id: the writer's identity; the shard dedupes re-sent segments by it.
        packer: packs the writer's segments (and refits queued messages to the shard's
            message limit, once the shard says it).
        max_in_flight: :meth:`enqueue` waits while this many segments await
            acknowledgement.
        max_in_flight_bytes: ... or while their messages hold this many bytes (``None``:
            no byte bound).
        timeout_s: the longest :meth:`enqueue` waits for room without an acknowledgement
            (``None``: for ever).
        metadata: gRPC metadata sent with the stream (the bearer token).
        on_stored: called (from the background thread) after acknowledgements arrive.
    """

    def __init__(
        self,
        shard: ShardHandle,
        table: str,
        writer_id: str,
        packer: MessagePacker,
        *,
        max_in_flight: int,
        max_in_flight_bytes: int | None = None,
        timeout_s: float | None,
        metadata: tuple[tuple[str, str], ...] | None,
        on_stored: Callable[[], None],
    ) -> None:
        self._shard, self._table, self._writer_id = shard, table, writer_id
        self._packer, self._metadata, self._on_stored = packer, metadata, on_stored
        self._max_in_flight, self._timeout_s = max_in_flight, timeout_s
        self._max_bytes = max_in_flight_bytes

        self._cv = threading.Condition(threading.Lock())
        # Queued messages by their last sequence, in sequence order, and their segments.
        self._unacked: dict[int, Queued] = {}
        self._pending = 0
        self._pending_bytes = 0
        self._next_sequence = 1
        # Sequences are renumbered once, on the first connection, to follow what the shard
        # already stored from this writer id (an actor restarted under the same id).
        self._numbering_known = False
        # The last stream whose opening request the shard answered.
        self._answered_stream = 0
        #: Segments sent at least once (re-sends are not counted again), and acknowledged.
        self.sent = 0
        self.acked = 0
        self._error: MillpondError | None = None
        self._closing = False
        self._closed = False
        self._aborted = False
        self._stream_id = 0
        self._requests_in_flight = 0  # of the current stream
        self._call: Any = None
        # When the stream last failed to reach the shard (monotonic), None while it answers.
        self._unavailable_since: float | None = None
        self.outages = 0  # times the stream found the shard unreachable
        self._unavailable_before = 0.0  # seconds of the outages that ended

        self._thread = threading.Thread(
            target=self._run, name=f"millpond-writer-{writer_id}", daemon=True
        )
        self._thread.start()

    # -- what the writer reads -----------------------------------------------------------
    @property
    def pending(self) -> int:
        """Segments queued but not acknowledged yet."""
        with self._cv:
            return self._pending

    @property
    def unavailable_s(self) -> float | None:
        """Seconds since the stream found the shard unreachable; ``None`` while it answers."""
        since = self._unavailable_since
        return None if since is None else time.monotonic() - since

    @property
    def unavailable_total_s(self) -> float:
        """Seconds the shard was unreachable, all outages together, the current one too."""
        with self._cv:  # the two change together when the shard answers again
            since, before = self._unavailable_since, self._unavailable_before
        return before + (0.0 if since is None else time.monotonic() - since)

    @property
    def error(self) -> MillpondError | None:
        """The error that stopped the stream, ``None`` while it runs."""
        with self._cv:
            return self._error

    @property
    def sequence(self) -> int:
        """The sequence number of the last segment queued (0 before the first)."""
        return self._next_sequence - 1

    # -- caller side ---------------------------------------------------------------------
    def enqueue(self, messages: Sequence[Queued]) -> list[int]:
        """Queue messages in order, waking the sender once per batch (not once per message);
        returns the sequences of their segments.

        A call's messages are queued together once fewer than ``max_in_flight`` segments
        (holding fewer than ``max_in_flight_bytes``) await acknowledgement (so a large call may pass the bound by its own size): a call
        is queued whole or not at all. The wait lasts at most ``timeout_s`` without an
        acknowledgement; then nothing of the call is queued and it may be written again."""
        sequences: list[int] = []
        timeout_s = self._timeout_s
        with self._cv:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            acked = self.acked
            while True:
                self._raise_if_unusable_locked()
                if self._pending < self._max_in_flight and (
                    self._max_bytes is None or self._pending_bytes < self._max_bytes
                ):
                    break
                if self.acked != acked:  # the shard answers: wait again in full
                    acked = self.acked
                    deadline = None if timeout_s is None else time.monotonic() + timeout_s
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceededError(
                        self.stuck("write", timeout_s, self._pending)
                        + "; nothing of this write was queued"
                    )
                self._cv.wait(remaining)
            for queued in messages:
                queued.number(self._next_sequence)
                self._next_sequence += queued.count
                self._unacked[queued.last] = queued
                self._pending += queued.count
                self._pending_bytes += queued.size
                sequences.extend(range(queued.first, queued.last + 1))
            self._cv.notify_all()
        return sequences

    def flush(self, timeout_s: float | None) -> None:
        """Wait until every queued segment is acknowledged (see :meth:`Writer.flush`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._unacked and self._error is None:
                if not self._thread.is_alive():
                    raise ClosedError(
                        f"writer {self._writer_id!r} is closed with {self._pending} "
                        "segments unacknowledged"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceededError(self.stuck("flush", timeout_s, self._pending))
                self._cv.wait(remaining)
            self._raise_error_locked()

    def close(self, timeout_s: float | None) -> None:
        """Flush, end the stream and stop the thread (see :meth:`Writer.close`)."""
        with self._cv:
            if self._closed:
                return
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abort()
            self._thread.join()
            with self._cv:
                self._closed = True
                lost = self._pending
            raise DeadlineExceededError(self.stuck("close", timeout_s, lost) + "; they are dropped")
        with self._cv:
            self._closed = True
            self._raise_error_locked()
            if self._unacked:  # the thread stopped without an error: aborted
                raise ClosedError(
                    f"writer {self._writer_id!r} closed with {self._pending} segments "
                    "unacknowledged"
                )

    def stuck(self, what: str, timeout_s: float | None, unacked: int) -> str:
        """What a wait for the shard that ran out says."""
        return (
            f"{what}: after {timeout_s} s, {unacked} segments of writer {self._writer_id!r} "
            f"still unacknowledged by shard {self._shard.address} (the shard is down, wedged, "
            "or its rate limiter holds inserts back)"
        )

    def raise_if_unusable(self) -> None:
        """Raise the error that stopped the stream, or :class:`ClosedError` once closing."""
        with self._cv:
            self._raise_if_unusable_locked()

    def _raise_if_unusable_locked(self) -> None:
        self._raise_error_locked()
        if self._closing or self._closed:
            raise ClosedError(f"writer {self._writer_id!r} is closed")

    def _raise_error_locked(self) -> None:
        if self._error is not None:
            err = self._error
            raise type(err)(*err.args) from err

    # -- background thread ---------------------------------------------------------------
    def _run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        failing = False
        while True:
            with self._cv:
                while not (self._unacked or self._closing or self._aborted):
                    self._cv.wait()
                if self._aborted or self._error is not None:
                    return
                if self._closing and not self._unacked:
                    return
                self._stream_id += 1
                stream_id = self._stream_id
                self._requests_in_flight = 0
                acked_before = self.acked
            err: BaseException | None = None
            try:
                call = self._shard.raw_insert(self._requests(stream_id), metadata=self._metadata)
                with self._cv:
                    self._call = call
                    if self._aborted:
                        call.cancel()
                opened = False
                for response in call:
                    if not opened:  # the answer to the stream's opening request
                        opened = True
                        self._on_opened(stream_id, response)
                    self._on_ack(response.sequences)
                    self._on_stored()
                    if failing:
                        with self._cv:
                            if self._unavailable_since is not None:
                                self._unavailable_before += (
                                    time.monotonic() - self._unavailable_since
                                )
                            self._unavailable_since = None
                        logger.info(
                            "writer %r: shard %s is back; re-sent unacknowledged segments",
                            self._writer_id,
                            self._shard.address,
                        )
                        failing = False
                    backoff = BACKOFF_INITIAL_S
            except grpc.RpcError as e:
                err = e
            except Exception as e:  # a closed channel, bad TLS file, ...: not recoverable
                self._fail(e if isinstance(e, MillpondError) else MillpondError(str(e)), e)
                return
            finally:
                with self._cv:
                    self._stream_id += 1  # ends the request generator of this stream
                    self._call = None
                    self._cv.notify_all()
            with self._cv:
                if self._aborted:
                    return
                made_progress = self.acked > acked_before
                stalled = err is None and bool(self._unacked) and not made_progress
            if err is None and not stalled:
                continue  # the server ended the stream after acknowledging: go on
            if err is not None and not is_retryable(err):
                self._fail(from_rpc_error(err, self._shard.address), err)
                return
            where = self._shard.resolve()
            if where == "gone":
                with self._cv:
                    lost = self._pending
                gone = ShardGoneError(
                    f"writer {self._writer_id!r}: shard {self._shard.index} "
                    f"({self._shard.address}) is lost for good; {lost} unacknowledged "
                    "segments are lost with it"
                )
                self._fail(gone, err)
                return
            if where == "moved":
                failing = True  # logs when the shard answers at its new address
                continue
            if not failing:
                self._unavailable_since = time.monotonic()
                self.outages += 1
                reason = "ended the stream early" if err is None else from_rpc_error(err)
                logger.warning(
                    "writer %r: shard %s unavailable (%s); reconnecting with backoff, then "
                    "re-sending the %d unacknowledged segments",
                    self._writer_id,
                    self._shard.address,
                    reason,
                    self.pending,
                )
                failing = True
            with self._cv:
                self._cv.wait_for(lambda: self._aborted, timeout=backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    def _on_opened(self, stream_id: int, response: Any) -> None:
        """The shard answered a stream's opening request: learn how large a request it
        takes (fitting the queued messages to it) and, on the first stream, where this
        writer id's numbering stands; then the stream's requests go."""
        with self._cv:
            self._packer.shard_message_bytes = max(0, int(response.max_message_bytes))
            stored_through = response.stored_through
            if not self._numbering_known:
                if stored_through:
                    for queued in self._unacked.values():
                        queued.number(queued.first + stored_through)
                    self._unacked = {q.last: q for q in self._unacked.values()}
                    self._next_sequence += stored_through
                self._numbering_known = True
            self._unacked = self._packer.refit(self._unacked)
            self._pending_bytes = sum(q.size for q in self._unacked.values())
            self._answered_stream = stream_id
            self._cv.notify_all()

    def _requests(self, stream_id: int) -> Iterator[bytes]:
        """The requests of one stream: every unacknowledged segment in order, then new ones.

        Each stream opens with a request without segments, whose answer tells how large a
        request the shard takes and (on the first stream) where this writer id's numbering
        stands on the shard; nothing is sent before it arrives.
        """
        sent_up_to = 0
        idle_since: float | None = None
        with self._cv:
            self._requests_in_flight += 1
        yield wire.insert_request(self._writer_id, self._table, [])
        with self._cv:
            while self._answered_stream != stream_id:
                if self._stream_id != stream_id or self._aborted:
                    return
                self._cv.wait()
        while True:
            with self._cv:
                while True:
                    if self._stream_id != stream_id or self._aborted:
                        return
                    batch: list[Queued] = []
                    size = 0
                    limit = self._packer.request_limit()
                    if self._requests_in_flight < REQUESTS_IN_FLIGHT:
                        for last, queued in self._unacked.items():
                            if last <= sent_up_to:
                                continue
                            if batch and size + queued.size > limit:
                                break
                            batch.append(queued)
                            size += queued.size
                    if batch:
                        break
                    if self._closing and next(reversed(self._unacked), 0) <= sent_up_to:
                        return  # half-close: the server acknowledges the rest and ends
                    if self._unacked or self._requests_in_flight:
                        idle_since = None
                        self._cv.wait()
                        continue
                    # Everything is stored: an idle stream would only hold one of the
                    # shard's threads, which a writer refused as busy waits for.
                    now = time.monotonic()
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= IDLE_STREAM_S:
                        return
                    self._cv.wait(IDLE_STREAM_S - (now - idle_since))
                sent_up_to = batch[-1].last
                self.sent = max(self.sent, sent_up_to)
                self._requests_in_flight += 1
            yield wire.insert_request(
                self._writer_id, self._table, [(q.first, q.count, q.body) for q in batch]
            )

    def _on_ack(self, sequences: Sequence[int]) -> None:
        with self._cv:
            self._requests_in_flight = max(0, self._requests_in_flight - 1)  # one answer each
            for sequence in sequences:  # a request holds whole messages: each one's last is here
                queued = self._unacked.pop(sequence, None)
                if queued is not None:
                    self._pending -= queued.count
                    self._pending_bytes -= queued.size
                    self.acked += queued.count
            self._cv.notify_all()

    def _fail(self, error: MillpondError, cause: BaseException | None) -> None:
        error.__cause__ = cause
        if isinstance(error, ShardGoneError):
            logger.warning("%s", error)
        else:
            logger.error(
                "writer %r: shard %s refused the stream: %s",
                self._writer_id,
                self._shard.address,
                error,
            )
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def _abort(self) -> None:
        with self._cv:
            self._aborted = True
            call = self._call
            self._cv.notify_all()
        if call is not None:
            call.cancel()
