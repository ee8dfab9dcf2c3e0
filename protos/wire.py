"""Insert and Sample messages framed by hand (:mod:`.framing`): tensor bytes go from
memory into the message, and come back out as views of it, without protobuf's copies.

An image-shaped insert or sample moves megabytes per message. A writer encodes each
``PackedSegments`` straight from the tensors' memory (:func:`encode_packed`: one copy) and
joins requests from those bytes (:func:`insert_request`: one more); the shard walks the
framing itself (:func:`parse_insert_request`) and takes each tensor's data as a view of the
request, which the table copies once, into its memory maps. A sample goes the other way:
the shard joins the gathered rows into the response (:func:`encode_slot_sample`), and the
client indexes ``obs`` and ``("next", obs)`` straight out of the received bytes
(:func:`parse_sample_response`).

The bytes are the protobuf encoding of the same messages, so any protobuf client or server
reads them, and messages built either way mix freely on one stream.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from millpond.protos import millpond_pb2 as pb
from millpond.protos.codec import to_tensor_map
from millpond.protos.framing import (
    FIXED64,
    LEN,
    Piece,
    TensorMapView,
    TensorView,
    fields,
    message,
    packed_doubles,
    packed_ints,
    parse_rest,
    read_tensor,
    read_tensor_map,
    tag,
    tensor,
    tensor_map,
    varint,
)
from millpond.sample_format import SlotSample
from millpond.segments import PackedSegments
from millpond.spec import Key

#: Messages smaller than this go through protobuf: its copies cost less than framing by
#: hand in Python (CartPole-sized segments).
SMALL_BYTES = 64 * 1024


def _data_bytes(packed: PackedSegments) -> int:
    return sum(
        t.numel() * t.element_size()
        for part in (packed.steps, packed.tails, packed.frames)
        for t in part.values()
    )


# -- insert --------------------------------------------------------------------------------
def encode_packed(
    packed: PackedSegments,
    compress_keys: frozenset[Key] | set[Key] = frozenset(),
    *,
    framed: bool | None = None,
) -> bytes:
    """``packed`` as the bytes of a ``pb.PackedSegments`` without its sequences (which
    :func:`insert_request` adds when the segments are sent): one copy of the tensors' data.
    ``compress_keys``: keys sent zstd-compressed. ``framed``: by hand (``True``), by
    protobuf (``False``), or by hand from :data:`SMALL_BYTES` of tensor data on (``None``).
    Either way the fields come in protobuf's order (the priorities, field 8, last), so
    both make the same bytes."""
    msg = pb.PackedSegments(
        episode_ids=packed.episode_ids.tolist(),
        first_steps=packed.first_steps.tolist(),
        lengths=packed.lengths.tolist(),
    )
    if framed is False or (framed is None and _data_bytes(packed) < SMALL_BYTES):
        # protobuf's C encoder beats framing in Python on small messages
        to_tensor_map(packed.steps, [packed.num_steps], compress_keys, out=msg.steps)
        to_tensor_map(packed.tails, [len(packed)], compress_keys, out=msg.tails)
        if packed.frames:
            to_tensor_map(packed.frames, [], compress_keys, out=msg.frames)
        if packed.priorities is not None:
            msg.priorities.extend(packed.priorities.tolist())
        return msg.SerializeToString()
    pieces: list[Piece] = [msg.SerializeToString()]
    pieces += tensor_map(5, packed.steps, [packed.num_steps], compress_keys)
    pieces += tensor_map(6, packed.tails, [len(packed)], compress_keys)
    if packed.frames:  # frame-stacked keys; their rows differ with their k: no batch
        pieces += tensor_map(7, packed.frames, [], compress_keys)
    if packed.priorities is not None:
        pieces += packed_doubles(8, packed.priorities)
    return b"".join(pieces)


def insert_request(
    writer_id: str, table: str, packed: list[tuple[int, int, bytes]], timeout_ms: int = 0
) -> bytes:
    """The bytes of an ``InsertRequest`` carrying ``packed``: ``(first sequence, segment
    count, bytes from encode_packed)`` each, numbered ``first, first + 1, ...``."""
    head = pb.InsertRequest(writer_id=writer_id, table=table, timeout_ms=timeout_ms)
    out = [head.SerializeToString()]
    for first, count, body in packed:
        sequences = packed_ints(1, range(first, first + count))
        out += [tag(5, LEN), varint(len(sequences) + len(body)), sequences, body]
    return b"".join(out)


@dataclass
class PackedView:
    """A ``pb.PackedSegments``: its tensors as views, its other fields parsed by protobuf."""

    fields: pb.PackedSegments
    steps: TensorMapView
    tails: TensorMapView
    frames: TensorMapView = field(default_factory=TensorMapView)

    @property
    def sequences(self):
        return self.fields.sequences

    @property
    def episode_ids(self):
        return self.fields.episode_ids

    @property
    def first_steps(self):
        return self.fields.first_steps

    @property
    def lengths(self):
        return self.fields.lengths

    @property
    def priorities(self):
        return self.fields.priorities


@dataclass
class InsertView:
    """An ``InsertRequest`` with its packed segments as :class:`PackedView`; the rest
    (names, timeout, single segments) parsed by protobuf."""

    fields: pb.InsertRequest
    packed: list[PackedView]

    @property
    def writer_id(self) -> str:
        return self.fields.writer_id

    @property
    def table(self) -> str:
        return self.fields.table

    @property
    def timeout_ms(self) -> int:
        return self.fields.timeout_ms

    @property
    def segments(self):
        return self.fields.segments


def parse_insert_request(buf: bytes) -> InsertView | pb.InsertRequest:
    """Parse the bytes of an ``InsertRequest``: :func:`parse_framed_insert`, or below
    :data:`SMALL_BYTES` protobuf itself (its C parser costs less than walking the framing
    in Python, and the copies of a small message do not matter)."""
    if len(buf) < SMALL_BYTES:
        return parse_rest(pb.InsertRequest, [buf], "InsertRequest")
    return parse_framed_insert(buf)


def parse_framed_insert(buf: bytes) -> InsertView:
    """Parse the bytes of an ``InsertRequest`` by hand, its tensors as views of ``buf``."""
    rest: list[bytes] = []
    packed: list[PackedView] = []
    view = memoryview(buf)
    for number, wire, first, start, stop in fields(buf, 0, len(buf), "InsertRequest"):
        if number == 5 and wire == LEN:
            packed.append(_packed(buf, view, start, stop))
        else:
            rest.append(buf[first:stop])
    return InsertView(parse_rest(pb.InsertRequest, rest, "InsertRequest"), packed)


def parse_packed(buf: bytes) -> PackedView:
    """Parse the bytes of a ``PackedSegments`` (what :func:`encode_packed` made), its
    tensors as views of ``buf``."""
    return _packed(buf, memoryview(buf), 0, len(buf))


def _packed(buf: bytes, view: memoryview, start: int, stop: int) -> PackedView:
    rest: list[bytes] = []
    maps = {5: TensorMapView(), 6: TensorMapView(), 7: TensorMapView()}  # steps, tails, frames
    for number, wire, first, s, e in fields(buf, start, stop, "PackedSegments"):
        if number in maps and wire == LEN:
            read_tensor_map(maps[number], buf, view, s, e)
        else:
            rest.append(buf[first:e])
    return PackedView(
        parse_rest(pb.PackedSegments, rest, "PackedSegments"), maps[5], maps[6], maps[7]
    )


# -- sample --------------------------------------------------------------------------------
def encode_slot_sample(sample: SlotSample, mass: float, compress: bool = False) -> bytes:
    """The bytes of a ``SampleResponse`` in the slot layout (what
    :func:`~millpond.protos.samples.encode_slot_sample` builds with protobuf, with ``mass``):
    the gathered rows are copied once, into the response."""
    ted = sample.ted
    steps = {
        (k,) if isinstance(k, str) else tuple(k): v
        for k, v in ted.items(include_nested=True, leaves_only=True)
    }
    observations = sample.observations
    distinct = int(next(iter(observations.values())).shape[0]) if observations else 0
    slot_part = tensor_map(
        1, observations, [distinct], set(observations) if compress else frozenset()
    )
    slot_part += tensor(2, ("rows",), sample.rows)
    slot_part += tensor(3, ("next_rows",), sample.next_rows)
    pieces = tensor_map(1, steps, list(ted.batch_size))
    pieces += [tag(4, FIXED64) + struct.pack("<d", mass)]
    pieces += message(5, slot_part)
    return b"".join(pieces)


@dataclass
class SlotObservationsView:
    """A ``pb.SlotObservations`` of views."""

    observations: TensorMapView = field(default_factory=TensorMapView)
    rows: TensorView = field(default_factory=TensorView)
    next_rows: TensorView = field(default_factory=TensorView)


class SampleView:
    """A ``pb.SampleResponse`` whose step keys and slot observations are views of the
    received bytes; its other fields (colocated rows, the older form) parsed by protobuf."""

    def __init__(
        self,
        rest: pb.SampleResponse,
        batch: TensorMapView | None,
        slot_observations: SlotObservationsView | None,
    ) -> None:
        self._rest = rest
        self._batch = batch
        self._slots = slot_observations

    @property
    def batch(self) -> TensorMapView | pb.TensorMap:
        return self._rest.batch if self._batch is None else self._batch

    @property
    def slot_observations(self) -> SlotObservationsView | pb.SlotObservations:
        return self._rest.slot_observations if self._slots is None else self._slots

    def HasField(self, name: str) -> bool:  # protobuf's name
        if name == "batch" and self._batch is not None:
            return True
        if name == "slot_observations" and self._slots is not None:
            return True
        return self._rest.HasField(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rest, name)


def parse_sample_response(buf: bytes) -> SampleView:
    """Parse the bytes of a ``SampleResponse``, its tensors as views of ``buf``."""
    rest: list[bytes] = []
    batch: TensorMapView | None = None
    slots: SlotObservationsView | None = None
    view = memoryview(buf)
    for number, wire, first, start, stop in fields(buf, 0, len(buf), "SampleResponse"):
        if number == 1 and wire == LEN:
            batch = read_tensor_map(batch or TensorMapView(), buf, view, start, stop)
        elif number == 5 and wire == LEN:
            slots = _slot_observations(slots or SlotObservationsView(), buf, view, start, stop)
        else:
            rest.append(buf[first:stop])
    return SampleView(parse_rest(pb.SampleResponse, rest, "SampleResponse"), batch, slots)


def _slot_observations(
    out: SlotObservationsView, buf: bytes, view: memoryview, start: int, stop: int
) -> SlotObservationsView:
    for number, wire, _, s, e in fields(buf, start, stop, "SlotObservations"):
        if wire != LEN:
            continue  # not a field of this message's: unknown, skipped
        if number == 1:
            read_tensor_map(out.observations, buf, view, s, e)
        elif number == 2:
            read_tensor(out.rows, buf, view, s, e)
        elif number == 3:
            read_tensor(out.next_rows, buf, view, s, e)
    return out
