"""The gRPC edge of a shard: decode requests, call the shard, map errors to status codes.

Nothing here decides anything about data: every rule lives in :class:`Table`. A bad
request is answered with a status (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, ...) and never changes what is stored or stops the server.

What a request declares is bounded before anything is allocated for it: the tensors of one
insert message decode to at most the message limit (their shapes are charged first, and
checked against the table's spec), a sampled batch must fit the table's capacity and, from
its spec, the message limit, PublishWeights' ``total_size`` must not pass
``max_weights_bytes``, and every ``timeout_ms`` is at most
:data:`~millpond.config.MAX_TIMEOUT_MS`. Each refusal names the field, its value and the
limit.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
import torch

from millpond.colocated import host_id
from millpond.config import MAX_NAME_BYTES, MAX_TIMEOUT_MS
from millpond.errors import (
    InvalidDataError,
    RateLimiterTimeoutError,
    ResourceExhaustedError,
)
from millpond.protos import codec, wire
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.status import ERROR_KEY, status_of
from millpond.protos.tables import config_from_proto, config_to_proto, info_to_proto
from millpond.protos.weights import chunks as weight_chunks
from millpond.sample_format import ColocatedSample, SlotSample
from millpond.segments import PackedSegments, Segment, concat, pack, pack_columns
from millpond.service.metrics import ServiceMetrics
from millpond.service.shard import Shard
from millpond.service.snapshot import pin
from millpond.service.weights import WeightStore
from millpond.spec import DONE, TERMINATED, TRUNCATED, FieldSpec, Key, TableSpec
from millpond.storage_format import ensure_token, storage_identity

log = logging.getLogger("millpond.server")
T = TypeVar("T")

# Blocking waits are cut into slices this long, to notice a cancelled call.
_POLL_S = 0.5
#: The largest weights a shard takes by default (``ReplayServicer(max_weights_bytes=)``).
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30
# Error details travel in a header: a message quoting a megabyte name would not arrive.
_MAX_DETAILS = 2000
# Bytes every sampled row carries besides the spec's keys, at the least: its slot,
# generation, episode id and step (int64 each) and the done/terminated/truncated flags.
_SAMPLED_ROW_BYTES = 36
# What a colocated answer adds per row instead of its observations: its two row indices
# (int32 each).
_COLOCATED_ROW_BYTES = 8
#: ReadTable streams one shard serves at once: each holds its snapshot's segment list (40
#: bytes a segment) and one group of rows.
MAX_TABLE_READS = 4
# Episode-end flags are normalised on insert (any integer dtype, [L] or [L, 1]): the
# spec's bool [] is not what a writer must send.
_FLAG_KEYS = frozenset({DONE, TERMINATED, TRUNCATED})


def _edge(method: Callable) -> Callable:
    """Map exceptions raised by an RPC method (plain or generator) to gRPC statuses."""

    def fail(servicer, exc: BaseException, context: grpc.ServicerContext) -> None:
        if isinstance(exc, grpc.RpcError) or not context.is_active():
            return  # the client went away (or the server is stopping): nobody to answer
        if isinstance(exc, MemoryError):  # what a request asked for does not fit: say so
            exc = ResourceExhaustedError(f"out of memory serving {method.__name__}: {exc}")
        code, message, error_name = status_of(exc)
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
    """``timeout_ms`` in seconds (``None``: 0, wait forever), at most :data:`MAX_TIMEOUT_MS`
    (longer waits overflow the thread waits they end up in)."""
    if not 0 <= ms <= MAX_TIMEOUT_MS:
        raise InvalidDataError(
            f"timeout_ms ({ms}) must be in [0, {MAX_TIMEOUT_MS}] (0: no timeout; the most "
            "is 30 days)"
        )
    return ms / 1000 if ms else None


def _check_name(name: str) -> str:
    """A table name of a request, refused by name when longer than any table's can be."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise InvalidDataError(
            f"table name ({name[:64]!r}...) takes {size} bytes, more than the limit "
            f"({MAX_NAME_BYTES} bytes)"
        )
    return name


def _size_bound(batch, extra: Sequence[torch.Tensor] = ()) -> int:
    """An upper bound on the bytes of the SampleResponse that encodes ``batch``.

    The tensors' bytes (every leaf, ``("next", obs)`` whole, so more than is sent), zstd's
    worst case for incompressible data (+1/256, +64 per tensor), and generous room for keys,
    dtypes, shapes, ``next_rows`` varints and the other fields.
    """
    leaves = [*batch.values(include_nested=True, leaves_only=True), *extra]
    data = sum(t.numel() * t.element_size() for t in leaves)
    return data + data // 256 + 1024 * (len(leaves) + 1) + 11 * batch.numel()


class ReplayServicer(pb_grpc.ReplayServicer):
    """Serves one :class:`Shard` and its :class:`WeightStore`."""

    def __init__(
        self,
        shard: Shard,
        weights: WeightStore,
        max_message_bytes: int = 256 << 20,
        *,
        max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
        slot_samples: bool = True,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        """``max_message_bytes``: the channel's message limit, which also bounds the decoded
        tensors of one insert message and the bytes of one sampled batch.
        ``max_weights_bytes``: the largest weights PublishWeights takes (announced in
        ``total_size`` and refused before anything is buffered).
        ``slot_samples``: answer Sample with each distinct observation slot once
        (``SampleResponse.slot_observations``); ``False`` sends the form older clients
        read (``next_rows``), kept to compare the two.
        ``metrics``: where calls are recorded (a registry of its own by default)."""
        self.shard = shard
        self.weights = weights
        self.max_message_bytes = max_message_bytes
        self.max_weights_bytes = max_weights_bytes
        self.slot_samples = slot_samples
        self.metrics = metrics or ServiceMetrics(lambda: shard.tables)
        self._writers: dict[str, int] = {}  # Insert streams open, by table
        self._writers_lock = threading.Lock()
        #: Answer Sample (slot layout) with bytes framed by hand, which only a server
        #: registered by :func:`~millpond.service.server.add_replay_servicer` sends as
        #: they are; the generated registration serializes messages.
        self.framed_samples = False
        #: What Info reports as this shard's host (colocated readers compare it with theirs).
        self.host_id = host_id()
        self._locations: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._snapshot_readers = threading.BoundedSemaphore(MAX_TABLE_READS)

    def _table(self, name: str):
        return self.shard.table(_check_name(name))

    @_edge
    def CreateTable(self, request: pb.CreateTableRequest, context) -> pb.CreateTableResponse:
        config = config_from_proto(request.config)
        if config.name not in self.shard.tables:
            _check_memory(config)
        table = self.shard.create_table(config, exist_ok=request.exist_ok)
        return pb.CreateTableResponse(config=config_to_proto(table.config))

    @_edge
    def Insert(self, request_iterator: Iterator[pb.InsertRequest], context):
        writer_id = table_name = None
        streaming_to = None  # the table this stream counts as a writer of (Info's writers)
        try:
            for request in request_iterator:
                if isinstance(request, bytes):  # the server's raw-bytes Insert (see server.py)
                    self.metrics.received("Insert", len(request))
                    request = wire.parse_insert_request(request)
                writer_id = request.writer_id or writer_id
                table_name = request.table or table_name
                if not table_name:
                    raise InvalidDataError("the first insert message must name the table")
                table = self._table(table_name)
                if streaming_to is None:
                    streaming_to = table_name
                    self._count_writer(table_name, 1)
                timeout = _timeout(request.timeout_ms)
                # One budget for the whole message: its declared shapes are what decoding
                # allocates, so they are held to the message limit before anything is decoded.
                budget = codec.Budget(self.max_message_bytes, "the message limit")
                spec = _wire_spec(table.spec)
                if request.segments:
                    segments = [self._segment(s, budget, spec) for s in request.segments]
                    groups = [pack(segments)]
                else:
                    groups = []
                groups += [self._packed(p, budget, spec) for p in request.packed]
                if groups:
                    packed = concat(groups)
                    self._insert(table, packed, timeout, writer_id, context)
                sequences = [s.sequence for s in request.segments]
                for p in request.packed:
                    sequences.extend(p.sequences)
                yield pb.InsertResponse(
                    sequences=sequences,
                    stored_through=table.writer_sequence(writer_id) if writer_id else 0,
                    max_message_bytes=self.max_message_bytes,
                )
        finally:
            if streaming_to is not None:
                self._count_writer(streaming_to, -1)

    def _count_writer(self, table: str, change: int) -> None:
        with self._writers_lock:
            self._writers[table] = self._writers.get(table, 0) + change
            if not self._writers[table]:
                del self._writers[table]

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
    def _packed(
        msg: pb.PackedSegments | wire.PackedView,
        budget: codec.Budget,
        spec: dict[Key, FieldSpec] | None,
    ) -> PackedSegments:
        # Views of the request's bytes, not copies: the table copies them once, into its
        # memory maps, and nothing writes to them.
        steps, batch = codec.from_tensor_map_flat(msg.steps, budget, spec, "steps", copy=False)
        tails, tail_batch = codec.from_tensor_map_flat(msg.tails, budget, spec, "tail", copy=False)
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
        # Frame-stacked keys: their rows (L + k per segment) are checked by the table.
        frames = {}
        if msg.frames.tensors:
            frames, _ = codec.from_tensor_map_flat(msg.frames, budget, None, "frames", copy=False)
        return pack_columns(
            steps,
            tails,
            msg.lengths,
            msg.episode_ids,
            msg.first_steps,
            msg.sequences if len(msg.sequences) else None,
            frames,
        )

    @staticmethod
    def _segment(
        msg: pb.Segment, budget: codec.Budget, spec: dict[Key, FieldSpec] | None
    ) -> Segment:
        steps, batch = codec.from_tensor_map_flat(msg.steps, budget, spec, "steps")
        tail, tail_batch = codec.from_tensor_map_flat(msg.tail, budget, spec, "tail")
        if len(batch) != 1:
            raise InvalidDataError(f"segment steps must have batch size [L], received {batch}")
        if tail_batch not in ([], [1]):
            raise InvalidDataError(f"segment tail must have batch size [], received {tail_batch}")
        if tail_batch == [1]:
            tail = {k: v[0] for k, v in tail.items()}
        if msg.sequence >= 2**63:  # uint64 on the wire, int64 in the table
            raise InvalidDataError(f"segment sequence ({msg.sequence}) must be < 2**63")
        return Segment(
            steps, tail, msg.episode_id, msg.first_step, msg.sequence if msg.sequence else None
        )

    @_edge
    def Sample(self, request: pb.SampleRequest, context):
        table = self._table(request.table)
        if request.batch_size < 1:
            raise InvalidDataError(f"batch_size ({request.batch_size}) must be a positive integer")
        if request.num_batches < 0:
            raise InvalidDataError(f"num_batches ({request.num_batches}) must be >= 0")
        timeout = _timeout(request.timeout_ms)
        queue = table.config.sampler == "queue"
        self._check_batch_size(table, request.batch_size, colocated=request.colocated and not queue)
        if request.redraw and queue:
            raise InvalidDataError(
                f"table {table.name!r} is a queue: its batches are never redrawn (redraw is "
                "for rows a colocated reader found overwritten)"
            )
        # A queue's delivered segments may be overwritten at once: its rows go on the wire.
        form = "colocated" if request.colocated and not queue else None
        form = form or ("slots" if self.slot_samples else "ted")
        counted = not request.redraw
        sent = 0
        while request.num_batches == 0 or sent < request.num_batches:
            started = time.monotonic()
            sampled = self._sample_one(table, request.batch_size, timeout, context, form, counted)
            if sampled is None:
                return
            assert table.spec is not None
            compress = table.config.compression == "zstd"
            if isinstance(sampled, ColocatedSample):
                batch = sampled.ted
                response = self._colocated_response(table, sampled)
                size = _size_bound(batch, [sampled.slots, sampled.generations, sampled.rows])
            elif isinstance(sampled, SlotSample):
                batch = sampled.ted
                leaves = [*sampled.observations.values(), sampled.rows, sampled.next_rows]
                if (
                    self.framed_samples
                    and _size_bound(batch, leaves) <= self.max_message_bytes
                    and context.is_active()
                ):
                    # Framed by hand: the gathered rows are copied once, into the response
                    # (server.py sends these bytes as they are).
                    framed = wire.encode_slot_sample(sampled, table.sampler.mass, compress)
                    self.metrics.sampled(
                        table.name, time.monotonic() - started, batch.numel(), len(framed)
                    )
                    yield framed
                    sent += 1
                    continue
                response = codec.encode_slot_sample(sampled, compress=compress)
                size = _size_bound(batch, leaves)
            else:
                batch = sampled
                response = codec.encode_sample(
                    batch, table.spec.observation_keys, compress=compress
                )
                size = _size_bound(batch)
            response.mass = table.sampler.mass
            # upb's ByteSize serializes the whole message (a second copy of every byte, ~10 ms
            # for an Atari batch): take it only when a cheap upper bound does not settle it.
            if size > self.max_message_bytes:
                size = response.ByteSize()
            if size > self.max_message_bytes or not context.is_active():
                if counted:  # nobody receives it: not counted, a queue's not lost
                    table.give_back(batch)
                if size > self.max_message_bytes:
                    raise ResourceExhaustedError(
                        f"a batch of {len(batch)} steps takes {size} bytes, more than the "
                        f"message limit ({self.max_message_bytes}); sample fewer at a time"
                    )
                return
            self.metrics.sampled(table.name, time.monotonic() - started, batch.numel(), size)
            yield response
            sent += 1

    def _check_batch_size(self, table, batch_size: int, colocated: bool = False) -> None:
        """Refuse a batch that can never be sent, before sampling allocates it.

        Its steps must fit the table (more than its capacity is never a useful batch, and
        is what would be allocated) and their least bytes on the wire (from the spec) the
        message limit. Rows of uniform and prioritized batches carry their next observation
        too; consecutive rows of slices and queue batches carry each other's; a
        ``colocated`` answer carries no observation, only the slots to read them from.
        """
        config = table.config
        k = config.slice_len or 1
        steps = batch_size * k
        what = f"batch_size ({batch_size})" + (
            f" x slice_len ({k}) = {steps} steps" if k > 1 else ""
        )
        if steps > config.capacity:
            raise InvalidDataError(
                f"{what} exceeds the capacity of table {config.name!r} ({config.capacity} slots)"
            )
        spec = table.spec
        if spec is None:  # nothing stored yet: the message limit is checked on each batch
            return
        obs, row = spec.observation_bytes, spec.slot_bytes + _SAMPLED_ROW_BYTES
        if colocated:
            least = steps * (spec.step_bytes + _SAMPLED_ROW_BYTES + _COLOCATED_ROW_BYTES)
        elif config.sampler in ("uniform", "prioritized"):
            least = steps * (row + obs)
        else:
            least = steps * row + (batch_size if k > 1 else 1) * obs
        if least > self.max_message_bytes:
            per_step = -(-least // steps)
            raise ResourceExhaustedError(
                f"{what} takes at least {least} bytes ({per_step} per step), more than the "
                f"message limit ({self.max_message_bytes} bytes): batch_size must be at most "
                f"{max(1, batch_size * self.max_message_bytes // least)}"
            )

    @staticmethod
    def _sample_one(
        table, batch_size: int, timeout: float | None, context, form: str, counted: bool
    ):
        """One batch in ``form`` (``"ted"``, ``"slots"`` or ``"colocated"``), or ``None``
        when the call was cancelled while it waited."""
        sample = {
            "ted": table.sample,
            "slots": table.sample_slots,
            "colocated": table.sample_colocated,
        }[form]
        try:
            return _in_slices(
                lambda wait: sample(batch_size, timeout=wait, counted=counted), timeout, context
            )
        except _Cancelled:
            return None

    def _colocated_response(self, table, sampled: ColocatedSample) -> pb.SampleResponse:
        """The step keys, and which observation slots a reader on this host reads."""
        response = pb.SampleResponse()
        codec.to_tensor_map(sampled.ted, out=response.batch)
        part = response.colocated_rows
        for name, field, t in (
            ("slots", part.slots, sampled.slots),
            ("generations", part.generations, sampled.generations),
            ("rows", part.rows, sampled.rows),
            ("next_rows", part.next_rows, sampled.next_rows),
        ):
            field.CopyFrom(codec.tensor_to_proto((name,), t))
        part.storage_token = self._location(table)[1]
        return response

    def _location(self, table) -> tuple[str, str]:
        """``(storage_dir, storage_token)`` of ``table`` for colocated readers: the token is
        :func:`storage_identity`, its random part written into the directory the first time
        it is asked for (``""`` where it cannot be)."""
        found = self._locations.get(table)
        if found is None:
            directory = table.storage.path.resolve()
            token = ensure_token(directory) and storage_identity(directory)
            found = (str(directory), token or "")
            self._locations[table] = found
        return found

    @_edge
    def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest, context):
        table = self._table(request.table)
        applied = table.update_priorities(
            list(request.slots), list(request.generations), list(request.priorities)
        )
        return pb.UpdatePrioritiesResponse(applied=applied)

    @_edge
    def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        tables = [self._table(request.table)] if request.table else self.shard.tables.values()
        infos = []
        for t in tables:
            info = info_to_proto(t.info(), t.config)
            with self._writers_lock:
                info.writers = self._writers.get(t.name, 0)
            info.storage_dir, info.storage_token = self._location(t)
            if info.storage_token:
                info.host_id = self.host_id
            infos.append(info)
        return pb.InfoResponse(
            tables=infos,
            weights_version=self.weights.version,
            refused_tables=self.shard.refused,
        )

    @_edge
    def ConfigureTable(
        self, request: pb.ConfigureTableRequest, context
    ) -> pb.ConfigureTableResponse:
        table = self._table(request.table)
        settings: dict = {
            name: getattr(request, name)
            for name in ("min_size", "samples_per_insert", "error_buffer", "alpha", "beta")
            if request.HasField(name)
        }
        if request.no_samples_per_insert:
            if "samples_per_insert" in settings:
                raise InvalidDataError("samples_per_insert and no_samples_per_insert together")
            settings["samples_per_insert"] = None
        if not settings:
            raise InvalidDataError(f"nothing to configure on table {table.name!r}")
        config = table.configure(**settings)  # a bad value: InvalidConfigError, by name
        log.info("table %r configured: %s", table.name, settings)
        return pb.ConfigureTableResponse(config=config_to_proto(config))

    @_edge
    def ReadTable(self, request: pb.ReadTableRequest, context):
        """A consistent snapshot of a table, streamed whole segments at a time while inserts
        go on (:mod:`millpond.service.snapshot`)."""
        table = self._table(request.table)
        if request.max_message_bytes < 0:
            raise InvalidDataError(
                f"max_message_bytes ({request.max_message_bytes}) must be >= 0 (0: the shard's)"
            )
        limit = min(request.max_message_bytes or self.max_message_bytes, self.max_message_bytes)
        if not self._snapshot_readers.acquire(blocking=False):
            raise ResourceExhaustedError(
                f"this shard serves {MAX_TABLE_READS} ReadTable streams at once, all open: "
                "retry when one has ended"
            )
        try:
            snapshot = pin(table)
            groups = snapshot.groups(limit)  # a segment too large is refused before the header
            config = config_to_proto(snapshot.config)
            header = pb.TableSnapshot(
                config=config, segments=snapshot.num_segments, steps=snapshot.num_steps
            )
            yield pb.ReadTableResponse(snapshot=header)
            spec = snapshot.spec
            compressed = (
                frozenset(spec.observation_keys)
                if spec is not None and snapshot.config.compression == "zstd"
                else frozenset()
            )
            for i, j in groups:
                if not context.is_active():
                    return
                packed = snapshot.read(table, i, j)
                if packed is None:
                    continue
                response = pb.ReadTableResponse()
                part = response.segments
                part.episode_ids.extend(packed.episode_ids.tolist())
                part.first_steps.extend(packed.first_steps.tolist())
                part.lengths.extend(packed.lengths.tolist())
                codec.to_tensor_map(packed.steps, [packed.num_steps], compressed, out=part.steps)
                codec.to_tensor_map(packed.tails, [len(packed)], compressed, out=part.tails)
                yield response
            yield pb.ReadTableResponse(
                end=pb.SnapshotEnd(
                    segments=snapshot.sent_segments,
                    steps=snapshot.sent_steps,
                    overwritten_segments=snapshot.overwritten_segments,
                    overwritten_steps=snapshot.overwritten_steps,
                    cut_segments=snapshot.cut_segments,
                    cut_steps=snapshot.cut_steps,
                )
            )
        finally:
            self._snapshot_readers.release()

    @_edge
    def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointResponse:
        self.shard.checkpoint()
        return pb.CheckpointResponse(path=str(self.shard.path))

    @_edge
    def Reset(self, request: pb.ResetRequest, context) -> pb.ResetResponse:
        self._table(request.table).reset()
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
                if total > self.max_weights_bytes:
                    raise ResourceExhaustedError(
                        f"total_size ({total}) exceeds the largest weights this shard takes "
                        f"({self.max_weights_bytes} bytes)"
                    )
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


def _wire_spec(spec: TableSpec | None) -> dict[Key, FieldSpec] | None:
    """The fields of ``spec`` whose dtype and shape an insert must send as stored."""
    if spec is None:
        return None
    return {k: f for k, f in spec.fields.items() if k not in _FLAG_KEYS}


def _check_memory(config) -> None:
    """Refuse a new prioritized table whose sum tree would take more than half this
    machine's memory: it is held in memory and filled at once (its files are not), so
    creating it would have the shard killed rather than a request refused."""
    if config.sampler != "prioritized":
        return
    leaves = 1 << max(0, (config.capacity - 1).bit_length())
    need = 2 * 2 * leaves * 8  # a sum tree and a min tree, float64, two nodes per leaf
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return  # no way to tell on this platform
    if need > have // 2:
        raise ResourceExhaustedError(
            f"capacity ({config.capacity}) of a prioritized table needs {need} bytes of memory "
            f"for its sum tree, more than half of this machine's ({have} bytes)"
        )
