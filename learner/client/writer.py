"""The pinned writer: segments streamed to one shard, acknowledged asynchronously.

A :class:`Writer` validates each segment in the caller's thread (the same checks as the
server, so bad data raises at once), gives it the next sequence number and queues it.
Segments travel as ``PackedSegments`` messages: those written together (a collector's
chunk, :meth:`Writer.write_packed`) as one message with one tensor per key, not one per
segment, as large as the shard's message limit allows (up to :data:`REQUEST_BYTES_MAX`;
:data:`REQUEST_BYTES` until the shard has said its limit). A background thread owns the
bidirectional ``Insert`` stream: it sends queued messages (several per request when many
wait), reads the acknowledgements, and drops acknowledged segments from its buffer. When the shard goes away it reconnects with exponential backoff
and re-sends every unacknowledged segment in sequence order; the shard stores a
``(writer id, sequence)`` once, so nothing is lost or duplicated. A non-retryable error is
kept and raised by the next :meth:`~Writer.write_segment`, :meth:`~Writer.flush` or
:meth:`~Writer.close`.

When the client has a resolver (see :mod:`millpond.learner._shards`), each failed attempt
asks it where the shard is: a shard restarted on another port is dialled there (and the
unacknowledged segments re-sent to it), and a shard lost for good stops the writer with
:class:`~millpond.learner._shards.ShardGoneError`: its unacknowledged segments are lost
with the shard, and the owner may write on to another shard (an env actor does, starting
new episodes there, so that no episode continues on a shard that lacks its beginning).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.config import TableConfig
from millpond.errors import (
    ClosedError,
    DeadlineExceededError,
    InvalidConfigError,
    InvalidDataError,
    MillpondError,
    ResourceExhaustedError,
)
from millpond.frame_stacks import compact_stacks, stack_examples
from millpond.learner._errors import from_rpc_error, is_retryable
from millpond.learner._shards import ShardGoneError, ShardHandle
from millpond.protos import codec, wire
from millpond.routing import writer_hash
from millpond.segments import PackedSegments, Segment, pack, pack_columns
from millpond.spec import OBSERVATION, STEP, TERMINATED, TRUNCATED, TableSpec

logger = logging.getLogger("millpond.client")

#: Reconnect backoff: starts here, doubles after each failed attempt, up to the maximum.
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
_MESSAGE_OVERHEAD = 64 * 1024
#: Queued segments are batched into one InsertRequest up to about this many bytes until the
#: shard says how large a message it takes: under the smallest message limit a server takes
#: (1 MiB), so batching never makes a request that a server refuses when each segment alone
#: would pass. A larger segment goes alone.
REQUEST_BYTES = 1024 * 1024 - _MESSAGE_OVERHEAD
#: Once the shard has said its message limit (the answer that opens every stream does),
#: segments written together travel in messages up to this size or that limit, whichever is
#: smaller: a collector's chunk of image observations (4 lanes x 128 steps of
#: ``uint8[4, 84, 84]``, 14.5 MB) goes as one message, which the shard decodes and stores in
#: one pass instead of one per segment. Larger messages would leave glibc's reused heap
#: (:mod:`millpond.allocator`) for fresh mappings, faulted in page by page.
REQUEST_BYTES_MAX = 16 * 1024 * 1024 - _MESSAGE_OVERHEAD
#: Insert requests sent and not answered yet, at most. Segments written meanwhile wait and go
#: together in the next request, so batching follows the shard's pace: small segments no
#: longer travel one per request (each request costs the shard and the client far more than
#: a small segment's bytes), while two requests in flight keep the shard busy.
REQUESTS_IN_FLIGHT = 2
#: How long a writer waits for its shard by default: for room in ``max_in_flight`` in a
#: write, for the acknowledgements in :meth:`Writer.flush` and :meth:`Writer.close`. A shard
#: that accepts the stream and then never answers (wedged, or its rate limiter holding
#: inserts back with nobody sampling) would otherwise block an actor, and the ``with`` block
#: around its writer, forever.
DEFAULT_TIMEOUT_S = 60.0
#: A stream with nothing to acknowledge for this long is ended (half-closed); the next write
#: opens a new one. An open stream holds a server thread, and a shard admits a bounded
#: number of Insert streams, so an idle writer must not keep a busy one out.
IDLE_STREAM_S = 10.0
_SEQUENCE_BYTES = 11  # a sequence number's bytes, set after a message's size is taken


class _Queued:
    """Consecutive segments queued as one ``pb.PackedSegments`` message: its bytes without
    the sequences (:func:`~millpond.protos.wire.encode_packed`), numbered when sent."""

    __slots__ = ("body", "count", "first", "size")

    def __init__(self, body: bytes, count: int, size: int) -> None:
        self.body = body
        self.first = 0
        self.count = count
        self.size = size + count * _SEQUENCE_BYTES

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def number(self, first: int) -> None:
        """Give the segments the sequences ``first, first + 1, ...``."""
        self.first = first


class Writer:
    """Streams segments of experience to the shard its ``writer_id`` is pinned to.

    Create one with :meth:`ReplayClient.writer`; use it as a context manager (leaving the
    ``with`` block flushes and closes it). Thread-safe; one writer per env loop is the norm.

    Args:
        shard: the shard this writer is pinned to.
        table: the table to insert into.
        writer_id: this writer's identity; the shard dedupes re-sent segments by it.
        max_in_flight: :meth:`write_segment` blocks while this many segments await
            acknowledgement.
        metadata: gRPC metadata sent with the stream (the bearer token).
        max_message_bytes: the channel's message size limit.
        table_config: returns the table's config as far as the client knows it (``None``
            if unknown); its spec is enforced here, and its ``compression`` applied to
            observations on the wire.
        on_stored: called (from the background thread) after acknowledgements arrive.
        timeout_s: the longest any call waits for the shard (:data:`DEFAULT_TIMEOUT_S`
            unless given): a write for room in ``max_in_flight``, :meth:`flush` and
            :meth:`close` for the acknowledgements. Past it they raise
            :class:`DeadlineExceededError`, naming the shard, the writer and the segments
            still unacknowledged. ``None``: wait for ever (a rate limiter may legitimately
            hold inserts back while a learner is slow).
    """

    def __init__(
        self,
        shard: ShardHandle,
        table: str,
        writer_id: str,
        max_in_flight: int = 64,
        *,
        metadata: Sequence[tuple[str, str]] | None = None,
        max_message_bytes: int = 256 * 1024 * 1024,
        table_config: Callable[[], TableConfig | None] = lambda: None,
        on_stored: Callable[[], None] = lambda: None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(writer_id, str) or not writer_id:
            raise InvalidConfigError(f"writer_id ({writer_id!r}) must be a non-empty string")
        if (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise InvalidConfigError(
                f"max_in_flight ({max_in_flight!r}) must be a positive integer"
            )
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s < 0
        ):
            raise InvalidConfigError(f"timeout_s ({timeout_s!r}) must be a number >= 0 or None")
        self._timeout_s = None if timeout_s is None else float(timeout_s)
        self._shard = shard
        self._table = table
        self._writer_id = writer_id
        self._max_in_flight = max_in_flight
        self._metadata = tuple(metadata) if metadata else None
        self._max_message_bytes = max_message_bytes
        self._table_config = table_config
        self._on_stored = on_stored

        self._cv = threading.Condition(threading.Lock())
        # Queued messages by their last sequence, in sequence order, and their segments.
        self._unacked: dict[int, _Queued] = {}
        self._pending = 0
        self._next_sequence = 1
        # Sequences are renumbered once, on the first connection, to follow what the shard
        # already stored from this writer id (an actor restarted under the same id).
        self._numbering_known = False
        # The shard's message limit (0: not said yet, or a shard that does not say), and the
        # last stream whose opening request the shard answered.
        self._shard_message_bytes = 0
        self._answered_stream = 0
        self._max_sent = 0
        self._acked = 0
        self._error: MillpondError | None = None
        self._closing = False
        self._closed = False
        self._aborted = False
        self._stream_id = 0
        self._requests_in_flight = 0  # of the current stream
        self._call: Any = None

        # Episode bookkeeping for write_segment (guarded by _write_lock).
        self._write_lock = threading.RLock()
        self._spec: TableSpec | None = None
        self._episode_base = (writer_hash(writer_id) % 2**31) * 2**32
        self._episode_counter = 0
        self._current_episode: int | None = None
        self._next_step: dict[int, int] = {}

        self._thread = threading.Thread(
            target=self._run, name=f"millpond-writer-{writer_id}", daemon=True
        )
        self._thread.start()

    # -- public API ----------------------------------------------------------------------
    @property
    def writer_id(self) -> str:
        return self._writer_id

    @property
    def table(self) -> str:
        return self._table

    @property
    def address(self) -> str:
        """The address of the shard this writer is pinned to."""
        return self._shard.address

    @property
    def shard_index(self) -> int:
        """The index of the shard this writer is pinned to, in the client's list."""
        return self._shard.index

    @property
    def timeout_s(self) -> float | None:
        """The longest a write, :meth:`flush` or :meth:`close` waits for the shard."""
        return self._timeout_s

    @property
    def sent(self) -> int:
        """Segments sent to the shard at least once (re-sends are not counted again)."""
        return self._max_sent

    @property
    def acked(self) -> int:
        """Segments the shard acknowledged (stored)."""
        return self._acked

    @property
    def pending(self) -> int:
        """Segments written but not acknowledged yet."""
        with self._cv:
            return self._pending

    @property
    def error(self) -> MillpondError | None:
        """The error that stopped this writer (its stream was refused), ``None`` while it
        runs; once set, every write, :meth:`flush` and :meth:`close` raises it."""
        with self._cv:
            return self._error

    @property
    def sequence(self) -> int:
        """The sequence number of the last segment written (0 before the first)."""
        return self._next_sequence - 1

    def write_segment(
        self,
        steps: TensorDictBase | Mapping[Any, Any],
        tail: TensorDictBase | Mapping[Any, Any],
        episode_id: int | None = None,
        first_step: int | None = None,
    ) -> int:
        """Queue one segment; returns its sequence number.

        Args:
            steps: TensorDict ``[L]`` in TED form without ``("next", obs)``: observations and
                per-step keys at the root; ``reward``, ``terminated`` and ``truncated`` (or
                ``done``) under ``"next"``. An episode may end only at the last step.
            tail: TensorDict ``[]`` of the observation keys: the observation after the last
                step.
            episode_id: the episode this segment belongs to. ``None``: the writer's current
                episode if the previous segment did not end it, else a new id, unique across
                writers (``(writer_hash(writer_id) % 2**31) * 2**32 + counter``).
            first_step: the index of the first step within the episode. ``None``: the number
                of steps this writer has written in that episode so far.

        Raises:
            InvalidDataError: the segment does not fit the segment layout or the table's
                spec (raised before anything is queued).
            DeadlineExceededError: ``max_in_flight`` segments stayed unacknowledged for
                :attr:`timeout_s`; nothing of this call was queued.
            MillpondError: the error that stopped the writer earlier (server-side rejection,
                missing table, authentication), or :class:`ClosedError` after :meth:`close`.

        Blocks while ``max_in_flight`` segments await acknowledgement.
        """
        episode_id = _optional_index("episode_id", episode_id)
        first_step = _optional_index("first_step", first_step)
        self._raise_if_unusable()
        packed = pack([Segment(steps, tail, episode_id or 0, first_step or 0)])
        with self._write_lock:
            packed = self._check_spec(packed)
            length = int(packed.lengths[0])
            ended = bool(packed.steps[TERMINATED][-1] | packed.steps[TRUNCATED][-1])
            if episode_id is None:
                if self._current_episode is not None:
                    episode_id = self._current_episode
                else:
                    episode_id = self._episode_base + self._episode_counter
                    self._episode_counter += 1
            if first_step is None:
                first_step = self._next_step.get(episode_id, 0)
            packed.episode_ids[0], packed.first_steps[0] = episode_id, first_step
            (sequence,) = self._enqueue_many(self._encode_packed(packed))
            self._track_episode(episode_id, first_step, length, ended)
            return sequence

    def write_segments(self, segments: Sequence[Segment]) -> list[int]:
        """Queue several segments, in order; returns their sequence numbers.

        The same as :meth:`write_segment` for each (``segment.episode_id`` and
        ``segment.first_step`` are used as given), but validated and packed in one pass and
        queued under one lock: with short episodes the per-segment Python work is most of
        an actor's cost. On a validation error nothing is queued. Blocks while
        ``max_in_flight`` segments await acknowledgement.
        """
        if not segments:
            return []
        for s in segments:
            _optional_index("episode_id", s.episode_id)
            _optional_index("first_step", s.first_step)
        self._raise_if_unusable()
        return self.write_packed(
            pack([Segment(s.steps, s.tail, int(s.episode_id), int(s.first_step)) for s in segments])
        )

    def write_packed(self, packed: PackedSegments, *, track_episodes: bool = True) -> list[int]:
        """Queue segments already laid out as columns; returns their sequence numbers.

        What :meth:`write_segments` does after packing, for producers whose steps are in one
        block already (see :func:`millpond.segmenting.pack_batch`,
        :func:`millpond.segments.pack_columns` and :func:`millpond.ted.compact_ted`). The
        segments travel as columns, in as few messages as the request size allows. On a
        validation error nothing is queued.

        ``track_episodes=False``: do not remember where each episode stands (that serves
        later :meth:`write_segment` calls without ``episode_id``/``first_step``). For a
        producer that numbers every segment itself, such as :meth:`ReplayClient.extend`,
        whose episodes without trajectory ids get fresh ids and would pile up here.
        """
        if len(packed) == 0:
            return []
        if np.any(packed.episode_ids < 0) or np.any(packed.first_steps < 0):
            raise InvalidDataError("episode ids and first steps must be >= 0")
        self._raise_if_unusable()
        with self._write_lock:
            packed = self._check_spec(packed)
            sequences = self._enqueue_many(self._encode_packed(packed))
            if not track_episodes:
                return sequences
            ends = torch.cumsum(torch.from_numpy(packed.lengths), 0) - 1
            ended = (packed.steps[TERMINATED][ends] | packed.steps[TRUNCATED][ends]).tolist()
            for episode_id, first_step, length, end in zip(
                packed.episode_ids.tolist(),
                packed.first_steps.tolist(),
                packed.lengths.tolist(),
                ended,
            ):
                self._track_episode(episode_id, first_step, length, end)
            return sequences

    def _track_episode(self, episode_id: int, first_step: int, length: int, ended: bool) -> None:
        """Remember where an episode stands, for segments written without ids or steps."""
        if ended:
            self._next_step.pop(episode_id, None)
            self._current_episode = None
        else:
            self._next_step[episode_id] = first_step + length
            self._current_episode = episode_id

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every written segment is acknowledged.

        Raises :class:`DeadlineExceededError` after ``timeout_s`` seconds (``None``: the
        writer's :attr:`timeout_s`; the segments stay queued and are still sent), or the
        error that stopped the writer.
        """
        if timeout_s is None:
            timeout_s = self._timeout_s
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
                    raise DeadlineExceededError(self._stuck("flush", timeout_s, self._pending))
                self._cv.wait(remaining)
            self._raise_error_locked()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, end the stream and stop the background thread.

        After ``timeout_s`` seconds (``None``: the writer's :attr:`timeout_s`) the stream is
        cancelled, unacknowledged segments are dropped, and :class:`DeadlineExceededError`
        is raised. Closing twice is harmless.
        """
        if timeout_s is None:
            timeout_s = self._timeout_s
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
            raise DeadlineExceededError(
                self._stuck("close", timeout_s, lost) + "; they are dropped"
            )
        with self._cv:
            self._closed = True
            self._raise_error_locked()
            if self._unacked:  # the thread stopped without an error: aborted
                raise ClosedError(
                    f"writer {self._writer_id!r} closed with {self._pending} segments "
                    "unacknowledged"
                )

    def _stuck(self, what: str, timeout_s: float | None, unacked: int) -> str:
        return (
            f"{what}: after {timeout_s} s, {unacked} segments of writer {self._writer_id!r} "
            f"still unacknowledged by shard {self._shard.address} (the shard is down, wedged, "
            "or its rate limiter holds inserts back)"
        )

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception that left the block
            self.close()
        except MillpondError as e:
            logger.warning("writer %r: closing after an exception failed: %s", self._writer_id, e)

    def __repr__(self) -> str:
        return (
            f"Writer({self._writer_id!r}, table={self._table!r}, shard={self._shard.address!r}, "
            f"sent={self.sent}, acked={self.acked})"
        )

    # -- encoding ------------------------------------------------------------------------
    def _encode_packed(self, packed: PackedSegments) -> list[_Queued]:
        """``packed`` as ``PackedSegments`` messages of consecutive segments, each within
        the request size (so a shard that takes each segment alone takes them batched)."""
        limit = self._request_limit()
        row_bytes = sum(v[0].numel() * v.element_size() for v in packed.steps.values())
        tail_bytes = sum(v[0].numel() * v.element_size() for v in packed.tails.values())
        for key, v in packed.frames.items():  # L + k frames per segment
            row_bytes += v[0].numel() * v.element_size()
            tail_bytes += v[0].numel() * v.element_size() * packed.stacks[key]
        sizes = (packed.lengths * row_bytes + tail_bytes).tolist()
        messages, i, n = [], 0, len(packed)
        while i < n:
            j, size = i + 1, sizes[i]
            while j < n and size + sizes[j] <= limit:
                size += sizes[j]
                j += 1
            messages.append(self._encode_group(packed.group(i, j)))
            i = j
        return messages

    def _request_limit(self) -> int:
        """The most bytes of segments one request, and one queued message, carries."""
        own = self._max_message_bytes - _MESSAGE_OVERHEAD
        shard = self._shard_message_bytes - _MESSAGE_OVERHEAD
        if shard <= 0:
            return min(REQUEST_BYTES, own)
        return min(REQUEST_BYTES_MAX, own, shard)

    def _fit_queued_locked(self) -> None:
        """Cut queued messages of several segments that the request size no longer admits
        (the shard restarted with a lower message limit, or a shard that does not say took
        over) into messages that it does, numbered as before: a request the shard would
        refuse is never sent where each segment alone would pass."""
        limit = self._request_limit()
        if all(q.size <= limit or q.count == 1 for q in self._unacked.values()):
            return
        fitted: dict[int, _Queued] = {}
        for queued in self._unacked.values():
            if queued.size <= limit or queued.count == 1:
                fitted[queued.last] = queued
                continue
            first = queued.first
            for part in self._encode_packed(self._decode_queued(queued)):
                part.number(first)
                first += part.count
                fitted[part.last] = part
            assert first == queued.last + 1
        self._unacked = fitted

    def _decode_queued(self, queued: _Queued) -> PackedSegments:
        """The segments of a queued message, as columns again (views of its bytes)."""
        view = wire.parse_packed(queued.body)
        steps, _ = codec.from_tensor_map_flat(view.steps, copy=False)
        tails, _ = codec.from_tensor_map_flat(view.tails, copy=False)
        frames: dict = {}
        stacks: dict = {}
        if view.frames.tensors:
            frames, _ = codec.from_tensor_map_flat(view.frames, copy=False)
            config = self._table_config()
            stacks = {k: config.frame_stacks[k] for k in frames} if config is not None else {}
        packed = pack_columns(
            steps,
            tails,
            view.fields.lengths,
            view.fields.episode_ids,
            view.fields.first_steps,
            frames=frames,
        )
        packed.stacks = stacks
        return packed

    def _encode_group(self, packed: PackedSegments) -> _Queued:
        config = self._table_config()
        compress = (
            set(packed.tails) | set(packed.frames)
            if config is not None and config.compression == "zstd"
            else set()
        )
        # Encoded by hand, straight from the tensors' memory: one copy, where protobuf's
        # message, request and serialization made four.
        body = wire.encode_packed(packed, compress)
        size = len(body)
        limit = self._max_message_bytes - _MESSAGE_OVERHEAD
        if size > limit:
            raise ResourceExhaustedError(
                f"a segment of {packed.num_steps} steps takes {size} bytes on the wire, more "
                f"than the message limit ({limit} bytes; raise max_message_mb or cut shorter "
                "segments)"
            )
        return _Queued(body, len(packed), size)

    # -- caller side ---------------------------------------------------------------------
    def _check_spec(self, packed: PackedSegments) -> PackedSegments:
        """``packed`` checked against the table's spec, as far as it is known, with the
        table's frame-stacked keys cut to frames (checked to overlap first): each frame
        travels once. Unknown stacks: whole stacks go, and the shard cuts them."""
        config = self._table_config()
        if config is not None:
            packed = compact_stacks(packed, config.frame_stacks)
        if any(key not in packed.stacks for key in packed.frames):
            raise InvalidDataError("frames are sent only for the table's frame-stacked keys")
        stacks = stack_examples(packed)
        tails, steps = {**packed.tails, **stacks}, {**packed.steps, **stacks}
        spec = config.spec if config is not None and config.spec is not None else self._spec
        if spec is None:  # unknown: the first segment sets it, as on the server
            try:
                spec = TableSpec.from_example(steps, tails)
            except InvalidConfigError as e:
                raise InvalidDataError(str(e)) from None
        spec.check(tails, (OBSERVATION,), "tail")
        spec.check(steps, (OBSERVATION, STEP), "steps")
        self._spec = spec
        return packed

    def _enqueue_many(self, messages: Sequence[_Queued]) -> list[int]:
        """Queue messages in order, waking the sender once per batch (not once per message);
        returns the sequences of their segments.

        A call's messages are queued together once fewer than ``max_in_flight`` segments
        await acknowledgement (so a large call may pass the bound by its own size): a call
        is queued whole or not at all. The wait lasts at most :attr:`timeout_s` without an
        acknowledgement; then nothing of the call is queued and it may be written again."""
        sequences: list[int] = []
        timeout_s = self._timeout_s
        with self._cv:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            acked = self._acked
            while True:
                self._raise_if_unusable_locked()
                if self._pending < self._max_in_flight:
                    break
                if self._acked != acked:  # the shard answers: wait again in full
                    acked = self._acked
                    deadline = None if timeout_s is None else time.monotonic() + timeout_s
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceededError(
                        self._stuck("write", timeout_s, self._pending)
                        + "; nothing of this write was queued"
                    )
                self._cv.wait(remaining)
            for queued in messages:
                queued.number(self._next_sequence)
                self._next_sequence += queued.count
                self._unacked[queued.last] = queued
                self._pending += queued.count
                sequences.extend(range(queued.first, queued.last + 1))
            self._cv.notify_all()
        return sequences

    def _raise_if_unusable(self) -> None:
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
                acked_before = self._acked
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
                made_progress = self._acked > acked_before
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
            self._shard_message_bytes = max(0, int(response.max_message_bytes))
            stored_through = response.stored_through
            if not self._numbering_known:
                if stored_through:
                    for queued in self._unacked.values():
                        queued.number(queued.first + stored_through)
                    self._unacked = {q.last: q for q in self._unacked.values()}
                    self._next_sequence += stored_through
                self._numbering_known = True
            self._fit_queued_locked()
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
                    batch: list[_Queued] = []
                    size = 0
                    limit = self._request_limit()
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
                self._max_sent = max(self._max_sent, sent_up_to)
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
                    self._acked += queued.count
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


def _optional_index(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 0:
        raise InvalidDataError(f"{name} ({value!r}) must be a non-negative integer")
    return int(value)
