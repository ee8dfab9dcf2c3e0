"""The gRPC edge of a shard: decode requests, call the shard, map errors to status codes.

Nothing here decides anything about data: every rule lives in :class:`Table`. A bad
request is answered with a status (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, ...) and never changes what is stored or stops the server.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from millpond.errors import (
    InvalidDataError,
    RateLimiterTimeoutError,
    ResourceExhaustedError,
)
from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.status import ERROR_KEY, status_of
from millpond.protos.tables import config_from_proto, config_to_proto, info_to_proto
from millpond.protos.weights import chunks as weight_chunks
from millpond.segments import PackedSegments, Segment, concat, pack, pack_columns
from millpond.service.shard import Shard
from millpond.service.weights import WeightStore

log = logging.getLogger("millpond.server")
T = TypeVar("T")

# Blocking waits are cut into slices this long, to notice a cancelled call.
_POLL_S = 0.5


def _edge(method: Callable) -> Callable:
    """Map exceptions raised by an RPC method (plain or generator) to gRPC statuses."""

    def fail(exc: BaseException, context: grpc.ServicerContext) -> None:
        if isinstance(exc, grpc.RpcError) or not context.is_active():
            return  # the client went away (or the server is stopping): nobody to answer
        code, message, error_name = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method.__name__)
        if error_name is not None:
            context.set_trailing_metadata(((ERROR_KEY, error_name),))
        context.abort(code, message)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:
                fail(exc, context)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:
            fail(exc, context)

    return unary


class _Cancelled(Exception):
    """The client cancelled the call (or it timed out) while the shard waited for it."""


class _NotYet(RateLimiterTimeoutError):
    """GetWeights: the weights asked for are not published yet (``version`` is)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"weights version {version} is older than asked")
        self.version = version


def _in_slices(attempt: Callable[[float], T], timeout: float | None, context) -> T:
    """``attempt(wait_s)`` again and again in slices of :data:`_POLL_S`, until it returns.

    A blocking wait (the rate limiter's, or for newer weights) cannot see a cancelled call:
    cutting it into slices does, so a cancelled call frees its thread within a slice
    (raising :class:`_Cancelled`). The last :class:`RateLimiterTimeoutError` passes once
    ``timeout`` (``None``: none) has run out.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if not context.is_active():
            raise _Cancelled
        wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        try:
            return attempt(max(0.0, wait))
        except RateLimiterTimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def _timeout(ms: int) -> float | None:
    if ms < 0:
        raise InvalidDataError(f"timeout_ms ({ms}) must be >= 0")
    return ms / 1000 if ms else None


def _size_bound(batch) -> int:
    """An upper bound on the bytes of the SampleResponse that encodes ``batch``.

    The tensors' bytes (every leaf, ``("next", obs)`` whole, so more than is sent), zstd's
    worst case for incompressible data (+1/256, +64 per tensor), and generous room for keys,
    dtypes, shapes, ``next_rows`` varints and the other fields.
    """
    leaves = list(batch.values(include_nested=True, leaves_only=True))
    data = sum(t.numel() * t.element_size() for t in leaves)
    return data + data // 256 + 1024 * (len(leaves) + 1) + 11 * batch.numel()


class ReplayServicer(pb_grpc.ReplayServicer):
    """Serves one :class:`Shard` and its :class:`WeightStore`."""

    def __init__(
        self, shard: Shard, weights: WeightStore, max_message_bytes: int = 256 << 20
    ) -> None:
        self.shard = shard
        self.weights = weights
        self.max_message_bytes = max_message_bytes

    @_edge
    def CreateTable(self, request: pb.CreateTableRequest, context) -> pb.CreateTableResponse:
        table = self.shard.create_table(
            config_from_proto(request.config), exist_ok=request.exist_ok
        )
        return pb.CreateTableResponse(config=config_to_proto(table.config))

    @_edge
    def Insert(self, request_iterator: Iterator[pb.InsertRequest], context):
        writer_id = table_name = None
        for request in request_iterator:
            writer_id = request.writer_id or writer_id
            table_name = request.table or table_name
            if not table_name:
                raise InvalidDataError("the first insert message must name the table")
            table = self.shard.table(table_name)
            groups = [self._packed(p) for p in request.packed]
            if request.segments:
                groups.insert(0, pack([self._segment(s) for s in request.segments]))
            if groups:
                packed = concat(groups)
                self._insert(table, packed, _timeout(request.timeout_ms), writer_id, context)
            sequences = [s.sequence for s in request.segments]
            for p in request.packed:
                sequences.extend(p.sequences)
            yield pb.InsertResponse(
                sequences=sequences,
                stored_through=table.writer_sequence(writer_id) if writer_id else 0,
            )

    @staticmethod
    def _insert(
        table, packed: PackedSegments, timeout: float | None, writer_id: str | None, context
    ) -> None:
        """Insert, waiting in short slices so that a cancelled call frees its thread.

        Retrying a slice is safe: with a writer id, segments already stored are skipped.
        Without one, the insert waits in one piece.
        """
        if not writer_id:
            table.insert_packed(packed, timeout)
            return
        _in_slices(lambda wait: table.insert_packed(packed, wait, writer_id), timeout, context)

    @staticmethod
    def _packed(msg: pb.PackedSegments) -> PackedSegments:
        steps, batch = codec.from_tensor_map_flat(msg.steps)
        tails, tail_batch = codec.from_tensor_map_flat(msg.tails)
        n, rows = len(msg.lengths), sum(msg.lengths)
        if batch != [rows]:
            raise InvalidDataError(
                f"packed segments: steps must have batch size [{rows}] (the lengths' sum), "
                f"received {batch}"
            )
        if tail_batch != [n]:
            raise InvalidDataError(
                f"packed segments: tails must have batch size [{n}] (one per segment), "
                f"received {tail_batch}"
            )
        if any(q >= 2**63 for q in msg.sequences):
            raise InvalidDataError("packed segments: a sequence is out of range (>= 2**63)")
        return pack_columns(
            steps,
            tails,
            msg.lengths,
            msg.episode_ids,
            msg.first_steps,
            msg.sequences if len(msg.sequences) else None,
        )

    @staticmethod
    def _segment(msg: pb.Segment) -> Segment:
        steps, batch = codec.from_tensor_map_flat(msg.steps)
        tail, tail_batch = codec.from_tensor_map_flat(msg.tail)
        if len(batch) != 1:
            raise InvalidDataError(f"segment steps must have batch size [L], received {batch}")
        if tail_batch not in ([], [1]):
            raise InvalidDataError(f"segment tail must have batch size [], received {tail_batch}")
        if tail_batch == [1]:
            tail = {k: v[0] for k, v in tail.items()}
        return Segment(
            steps, tail, msg.episode_id, msg.first_step, msg.sequence if msg.sequence else None
        )

    @_edge
    def Sample(self, request: pb.SampleRequest, context):
        table = self.shard.table(request.table)
        if request.batch_size < 1:
            raise InvalidDataError(f"batch_size ({request.batch_size}) must be a positive integer")
        if request.num_batches < 0:
            raise InvalidDataError(f"num_batches ({request.num_batches}) must be >= 0")
        timeout = _timeout(request.timeout_ms)
        sent = 0
        while request.num_batches == 0 or sent < request.num_batches:
            batch = self._sample_one(table, request.batch_size, timeout, context)
            if batch is None:
                return
            assert table.spec is not None
            response = codec.encode_sample(
                batch, table.spec.observation_keys, compress=table.config.compression == "zstd"
            )
            response.mass = table.sampler.mass
            # upb's ByteSize serializes the whole message (a second copy of every byte, ~10 ms
            # for an Atari batch): take it only when a cheap upper bound does not settle it.
            size = _size_bound(batch)
            if size > self.max_message_bytes:
                size = response.ByteSize()
            if size > self.max_message_bytes or not context.is_active():
                table.give_back(batch)  # nobody receives it: not counted, a queue's not lost
                if size > self.max_message_bytes:
                    raise ResourceExhaustedError(
                        f"a batch of {len(batch)} steps takes {size} bytes, more than the "
                        f"message limit ({self.max_message_bytes}); sample fewer at a time"
                    )
                return
            yield response
            sent += 1

    @staticmethod
    def _sample_one(table, batch_size: int, timeout: float | None, context):
        """One batch, or ``None`` when the call was cancelled while it waited."""
        try:
            return _in_slices(lambda wait: table.sample(batch_size, timeout=wait), timeout, context)
        except _Cancelled:
            return None

    @_edge
    def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest, context):
        table = self.shard.table(request.table)
        applied = table.update_priorities(
            list(request.slots), list(request.generations), list(request.priorities)
        )
        return pb.UpdatePrioritiesResponse(applied=applied)

    @_edge
    def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        tables = [self.shard.table(request.table)] if request.table else self.shard.tables.values()
        return pb.InfoResponse(
            tables=[info_to_proto(t.info(), t.config) for t in tables],
            weights_version=self.weights.version,
        )

    @_edge
    def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointResponse:
        self.shard.checkpoint()
        return pb.CheckpointResponse(path=str(self.shard.path))

    @_edge
    def Reset(self, request: pb.ResetRequest, context) -> pb.ResetResponse:
        self.shard.table(request.table).reset()
        return pb.ResetResponse()

    @_edge
    def PublishWeights(self, request_iterator, context) -> pb.PublishWeightsResponse:
        version = total = None
        chunks: list[bytes] = []
        received = 0
        for request in request_iterator:
            if version is None:
                version, total = request.version, request.total_size
                if total < 0:
                    raise InvalidDataError(f"total_size ({total}) must be >= 0")
            received += len(request.chunk)
            if received > total:
                raise InvalidDataError(f"weights larger than the announced {total} bytes")
            chunks.append(request.chunk)
        if version is None:
            raise InvalidDataError("PublishWeights received no message")
        if received != total:
            raise InvalidDataError(f"weights truncated: {received} of {total} bytes")
        self.weights.publish(version, b"".join(chunks))
        return pb.PublishWeightsResponse(version=version)

    @_edge
    def GetWeights(self, request: pb.GetWeightsRequest, context):
        def attempt(wait: float) -> tuple[int, bytes]:
            version, blob = self.weights.get(request.min_version, wait)
            if blob is None:
                raise _NotYet(version)
            return version, blob

        try:  # in slices, as Sample waits, so that an abandoned call frees its thread
            version, blob = _in_slices(attempt, _timeout(request.timeout_ms) or 0.0, context)
        except _NotYet as not_yet:  # the timeout ran out first: say which version there is
            version, blob = not_yet.version, None
        except _Cancelled:
            return
        size = len(blob) if blob is not None else 0
        yield pb.GetWeightsResponse(version=version, total_size=size)
        if blob is None:
            return
        for chunk in weight_chunks(blob):
            yield pb.GetWeightsResponse(chunk=chunk)
