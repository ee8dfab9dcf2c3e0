"""The gRPC servicer of a shard: decode requests, call the shard, map errors to status codes.

:class:`ReplayServicer` serves the table and insert RPCs itself; its Sample RPC is
:mod:`.sample_rpc`, its weights RPCs :mod:`.weights_rpc`, and the edge they share (status
codes, waits in slices, request bounds) :mod:`.rpc_edge`.

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

import logging
import os
import threading
import weakref
from collections.abc import Iterator

import numpy as np

from millpond.colocated import host_id
from millpond.errors import InvalidDataError, ResourceExhaustedError
from millpond.protos import codec, wire
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.tables import config_from_proto, config_to_proto, info_to_proto
from millpond.segments import PackedSegments, Segment, concat, pack, pack_columns
from millpond.service.metrics import ServiceMetrics
from millpond.service.rpc_edge import check_name, edge, in_slices, timeout_s
from millpond.service.sample_rpc import SampleRPC
from millpond.service.shard import Shard
from millpond.service.snapshot import pin
from millpond.service.weights import WeightStore
from millpond.service.weights_rpc import WeightRPCs
from millpond.spec import DONE, TERMINATED, TRUNCATED, FieldSpec, Key, TableSpec
from millpond.storage_format import ensure_token, storage_identity

log = logging.getLogger("millpond.server")

#: The largest weights a shard takes by default (``ReplayServicer(max_weights_bytes=)``).
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30
#: ReadTable streams one shard serves at once: each holds its snapshot's segment list (40
#: bytes a segment) and one group of rows.
MAX_TABLE_READS = 4
# Episode-end flags are normalised on insert (any integer dtype, [L] or [L, 1]): the
# spec's bool [] is not what a writer must send.
_FLAG_KEYS = frozenset({DONE, TERMINATED, TRUNCATED})


class ReplayServicer(SampleRPC, WeightRPCs, pb_grpc.ReplayServicer):
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
        return self.shard.table(check_name(name))

    @edge
    def CreateTable(self, request: pb.CreateTableRequest, context) -> pb.CreateTableResponse:
        config = config_from_proto(request.config)
        if config.name not in self.shard.tables:
            _check_memory(config)
        table = self.shard.create_table(config, exist_ok=request.exist_ok)
        return pb.CreateTableResponse(config=config_to_proto(table.config))

    @edge
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
                timeout = timeout_s(request.timeout_ms)
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
        in_slices(lambda wait: table.insert_packed(packed, wait, writer_id), timeout, context)

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
            np.asarray(msg.priorities, dtype=np.float64) if len(msg.priorities) else None,
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
            steps,
            tail,
            msg.episode_id,
            msg.first_step,
            msg.sequence if msg.sequence else None,
            np.asarray(msg.priorities, dtype=np.float64) if len(msg.priorities) else None,
        )

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

    @edge
    def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest, context):
        table = self._table(request.table)
        applied = table.update_priorities(
            list(request.slots), list(request.generations), list(request.priorities)
        )
        return pb.UpdatePrioritiesResponse(applied=applied)

    @edge
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

    @edge
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

    @edge
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

    @edge
    def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointResponse:
        self.shard.checkpoint()
        return pb.CheckpointResponse(path=str(self.shard.path))

    @edge
    def Reset(self, request: pb.ResetRequest, context) -> pb.ResetResponse:
        self._table(request.table).reset()
        return pb.ResetResponse()


def _wire_spec(spec: TableSpec | None) -> dict[Key, FieldSpec] | None:
    """The fields of ``spec`` whose dtype and shape an insert must send as stored."""
    if spec is None:
        return None
    return {k: f for k, f in spec.fields.items() if k not in _FLAG_KEYS}


def _check_memory(config) -> None:
    """Refuse a new prioritized table whose sum tree would take more than half this
    machine's memory: it is held in memory and filled at once (its files are not), so
    creating it would have the shard killed rather than a request refused."""
    if not config.has_priorities:
        return
    leaves = 1 << max(0, (config.capacity - 1).bit_length())
    need = 2 * 2 * leaves * 8  # a sum tree and a min tree, float64, two nodes per leaf
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return  # no way to tell on this platform
    if need > have // 2:
        raise ResourceExhaustedError(
            f"capacity ({config.capacity}) of a {config.sampler} table needs {need} bytes of memory "
            f"for its sum tree, more than half of this machine's ({have} bytes)"
        )
