"""The pinned writer: segments streamed to one shard, acknowledged asynchronously.

A :class:`Writer` validates each segment in the caller's thread (the same checks as the
server, :func:`millpond.insert_checks.check_insert`, so bad data raises at once), gives it
the next sequence number and queues it, keeping track of where each episode stands for the
segments written without ids or steps. Segments travel as ``PackedSegments`` messages: those
written together (a collector's chunk, :meth:`Writer.write_packed`) as one message with one
tensor per key, not one per segment, as large as the shard's message limit allows
(:mod:`millpond.learner.client._insert_messages`). A background thread streams them to the
shard, re-sending what is unacknowledged when the shard comes back
(:mod:`millpond.learner.client._insert_stream`); a non-retryable error is kept and raised by
the next :meth:`~Writer.write_segment`, :meth:`~Writer.flush` or :meth:`~Writer.close`.

A shard lost for good (the client's resolver says so) stops the writer with
:class:`~millpond.errors.ShardGoneError`: its unacknowledged segments are lost with the
shard, and the owner may write on to another shard (an env actor does, starting new
episodes there, so that no episode continues on a shard that lacks its beginning).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.config import TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError, MillpondError
from millpond.insert_checks import check_insert, check_insert_priorities
from millpond.learner.client._insert_messages import MessagePacker
from millpond.learner.client._insert_stream import InsertStream
from millpond.learner.client._shards import ShardHandle
from millpond.routing import writer_hash
from millpond.segments import PackedSegments, Segment, pack
from millpond.spec import TERMINATED, TRUNCATED, TableSpec

logger = logging.getLogger("millpond.client")

#: How long a writer waits for its shard by default: for room in ``max_in_flight`` in a
#: write, for the acknowledgements in :meth:`Writer.flush` and :meth:`Writer.close`. A shard
#: that accepts the stream and then never answers (wedged, or its rate limiter holding
#: inserts back with nobody sampling) would otherwise block an actor, and the ``with`` block
#: around its writer, forever.
DEFAULT_TIMEOUT_S = 60.0
#: The default window: segments a writer sends ahead of the shard's acknowledgements, and
#: the bytes they may hold. A writer gets at most a window per round trip: with a 100 ms
#: round trip, 64 small segments got 5% of what the writer sends without delay, 1,024 got
#: 44-47%, 4,096 67% (``benchmarks/network_faults.py``); the byte bound keeps large
#: segments (images) from holding more than 32 MiB per writer.
DEFAULT_MAX_IN_FLIGHT = 4096
DEFAULT_MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024


class Writer:
    """Streams segments of experience to the shard its ``writer_id`` is pinned to.

    Create one with :meth:`ReplayClient.writer`; use it as a context manager (leaving the
    ``with`` block flushes and closes it). Thread-safe; one writer per env loop is the norm.

    Args:
        shard: the shard this writer is pinned to.
        table: the table to insert into.
        writer_id: this writer's identity; the shard dedupes re-sent segments by it.
        max_in_flight: :meth:`write_segment` blocks while this many segments await
            acknowledgement (:data:`DEFAULT_MAX_IN_FLIGHT`).
        max_in_flight_bytes: ... or while the segments awaiting acknowledgement hold this
            many bytes on the wire (:data:`DEFAULT_MAX_IN_FLIGHT_BYTES`; ``None``: no bound
            but ``max_in_flight``). A write is queued whole once below both bounds.
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
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        *,
        max_in_flight_bytes: int | None = DEFAULT_MAX_IN_FLIGHT_BYTES,
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
        if max_in_flight_bytes is not None and (
            isinstance(max_in_flight_bytes, bool)
            or not isinstance(max_in_flight_bytes, int)
            or max_in_flight_bytes < 1
        ):
            raise InvalidConfigError(
                f"max_in_flight_bytes ({max_in_flight_bytes!r}) must be a positive integer or None"
            )
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s < 0
        ):
            raise InvalidConfigError(f"timeout_s ({timeout_s!r}) must be a number >= 0 or None")
        self._timeout_s = None if timeout_s is None else float(timeout_s)
        self._shard = shard
        self._table = table
        self._writer_id = writer_id
        self._table_config = table_config

        # Episode bookkeeping for write_segment (guarded by _write_lock).
        self._write_lock = threading.RLock()
        self._spec: TableSpec | None = None
        self._episode_base = (writer_hash(writer_id) % 2**31) * 2**32
        self._episode_counter = 0
        self._current_episode: int | None = None
        self._next_step: dict[int, int] = {}

        # The config is read through the writer, so that what the spec check and the
        # packing see is one and the same.
        self._packer = MessagePacker(max_message_bytes, lambda: self._table_config())
        self._stream = InsertStream(
            shard,
            table,
            writer_id,
            self._packer,
            max_in_flight=max_in_flight,
            max_in_flight_bytes=max_in_flight_bytes,
            timeout_s=self._timeout_s,
            metadata=tuple(metadata) if metadata else None,
            on_stored=on_stored,
        )

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
        return self._stream.sent

    @property
    def acked(self) -> int:
        """Segments the shard acknowledged (stored)."""
        return self._stream.acked

    @property
    def pending(self) -> int:
        """Segments written but not acknowledged yet."""
        return self._stream.pending

    @property
    def unavailable_s(self) -> float | None:
        """Seconds since this writer found its shard unreachable (a stream failed without an
        answer: the shard is down, or the link silent past the keepalive timeout); ``None``
        while the shard answers. Unacknowledged segments are kept and re-sent meanwhile."""
        return self._stream.unavailable_s

    @property
    def outages(self) -> int:
        """Times this writer found its shard unreachable (each outage counted once)."""
        return self._stream.outages

    @property
    def unavailable_total_s(self) -> float:
        """Seconds this writer's shard was unreachable, all outages together (the current
        one so far included)."""
        return self._stream.unavailable_total_s

    @property
    def error(self) -> MillpondError | None:
        """The error that stopped this writer (its stream was refused), ``None`` while it
        runs; once set, every write, :meth:`flush` and :meth:`close` raises it."""
        return self._stream.error

    @property
    def sequence(self) -> int:
        """The sequence number of the last segment written (0 before the first)."""
        return self._stream.sequence

    def write_segment(
        self,
        steps: TensorDictBase | Mapping[Any, Any],
        tail: TensorDictBase | Mapping[Any, Any],
        episode_id: int | None = None,
        first_step: int | None = None,
        priorities: torch.Tensor | np.ndarray | Sequence[float] | None = None,
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
            priorities: each step's initial priority, ``[L]`` (finite, >= 0), as an Ape-X
                actor computes them; a prioritized table samples the steps with those until
                a learner updates them. ``None``: the table's rule for new steps (the
                largest priority so far). Other tables refuse priorities.

        Raises:
            InvalidDataError: the segment does not fit the segment layout or the table's
                spec, or its priorities are not one finite number >= 0 per step, or the
                table keeps no priorities (raised before anything is queued).
            DeadlineExceededError: ``max_in_flight`` segments stayed unacknowledged for
                :attr:`timeout_s`; nothing of this call was queued.
            MillpondError: the error that stopped the writer earlier (server-side rejection,
                missing table, authentication), or :class:`ClosedError` after :meth:`close`.

        Blocks while ``max_in_flight`` segments await acknowledgement.
        """
        episode_id = _optional_index("episode_id", episode_id)
        first_step = _optional_index("first_step", first_step)
        self._raise_if_unusable()
        packed = pack([Segment(steps, tail, episode_id or 0, first_step or 0, None, priorities)])
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
            (sequence,) = self._enqueue(packed)
            self._track_episode(episode_id, first_step, length, ended)
            return sequence

    def write_segments(self, segments: Sequence[Segment]) -> list[int]:
        """Queue several segments, in order; returns their sequence numbers.

        The same as :meth:`write_segment` for each (``segment.episode_id``,
        ``segment.first_step`` and ``segment.priorities`` are used as given; every segment
        has priorities or none does), but validated and packed in one pass and
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
            pack(
                [
                    Segment(
                        s.steps, s.tail, int(s.episode_id), int(s.first_step), None, s.priorities
                    )
                    for s in segments
                ]
            )
        )

    def write_packed(self, packed: PackedSegments, *, track_episodes: bool = True) -> list[int]:
        """Queue segments already laid out as columns; returns their sequence numbers.

        What :meth:`write_segments` does after packing, for producers whose steps are in one
        block already (see :func:`millpond.segmenting.pack_batch`,
        :func:`millpond.segments.pack_columns` and :func:`millpond.ted.compact_ted`). The
        segments travel as columns, in as few messages as the request size allows, with
        ``packed.priorities`` (one per step) if set. On a validation error nothing is queued.

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
            sequences = self._enqueue(packed)
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
        self._stream.flush(self._timeout_s if timeout_s is None else timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, end the stream and stop the background thread.

        After ``timeout_s`` seconds (``None``: the writer's :attr:`timeout_s`) the stream is
        cancelled, unacknowledged segments are dropped, and :class:`DeadlineExceededError`
        is raised. Closing twice is harmless.
        """
        self._stream.close(self._timeout_s if timeout_s is None else timeout_s)

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

    # -- caller side ---------------------------------------------------------------------
    def _check_spec(self, packed: PackedSegments) -> PackedSegments:
        """``packed`` checked against the table's spec, as far as it is known, with the
        table's frame-stacked keys cut to frames (checked to overlap first): each frame
        travels once. Unknown stacks: whole stacks go, and the shard cuts them."""
        config = self._table_config()
        if config is not None:  # unknown: the shard refuses misplaced priorities itself
            packed = check_insert_priorities(packed, self._table, config.sampler)
        stacks = config.frame_stacks if config is not None else {}
        spec = config.spec if config is not None and config.spec is not None else self._spec
        packed, self._spec = check_insert(packed, stacks, spec)
        return packed

    def _enqueue(self, packed: PackedSegments) -> list[int]:
        """Queue ``packed`` as messages; returns the sequences of its segments."""
        return self._stream.enqueue(self._packer.encode(packed))

    def _raise_if_unusable(self) -> None:
        self._stream.raise_if_unusable()


def _optional_index(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 0:
        raise InvalidDataError(f"{name} ({value!r}) must be a non-negative integer")
    return int(value)
