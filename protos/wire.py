"""Insert messages framed by hand: tensor bytes go from memory into the request, and come
back out as views of it, without protobuf's copies.

An image-shaped insert moves megabytes per message. Built and parsed by protobuf, each
byte is copied about four times on each side (the tensor's bytes, the message, the request,
the serialization; then the parse, ``Tensor.data``, a writable buffer), and those copies,
not the network, bound an insert. Here a writer encodes each ``PackedSegments`` straight
from the tensors' memory (:func:`encode_packed`: one copy) and joins requests from those
bytes (:func:`insert_request`: one more); the shard walks the framing itself
(:func:`parse_insert_request`) and takes each tensor's data as a view of the request, which
the table copies once, into its memory maps.

The bytes are the protobuf encoding of the same messages, so any protobuf client or server
reads them, and requests built either way mix freely on one stream. Only the tensors are
parsed here; every other field goes through protobuf itself, and anything malformed is
refused with :class:`~millpond.errors.InvalidDataError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from millpond.errors import InvalidDataError
from millpond.protos import millpond_pb2 as pb
from millpond.protos.codec import tensor_payload
from millpond.segments import PackedSegments
from millpond.spec import Key

_U64 = (1 << 64) - 1
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


# -- encoding ------------------------------------------------------------------------------
def _varint(value: int) -> bytes:
    value &= _U64  # negative int64: ten bytes of two's complement, as protobuf writes them
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _packed_ints(number: int, values: Sequence[int]) -> bytes:
    if not values:
        return b""
    body = b"".join(_varint(v) for v in values)
    return _tag(number, _LEN) + _varint(len(body)) + body


def _string(number: int, text: str) -> bytes:
    raw = text.encode()
    return _tag(number, _LEN) + _varint(len(raw)) + raw


def _tensor_map(
    number: int,
    tensors: Mapping[Key, torch.Tensor],
    batch_size: Sequence[int],
    compress_keys: frozenset[Key] | set[Key],
) -> list[bytes | np.ndarray]:
    """Field ``number`` holding a ``TensorMap``, as pieces to join: headers and the tensors'
    own bytes (views where they can be)."""
    pieces: list[bytes | np.ndarray] = [_packed_ints(1, batch_size)]
    for key, value in tensors.items():
        dtype, shape, data, compression = tensor_payload(value, key in compress_keys)
        head = b"".join(_string(1, part) for part in key) + _string(2, dtype)
        head += _packed_ints(3, shape)
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n:
            head += _tag(4, _LEN) + _varint(n)
        tail = _tag(5, _VARINT) + _varint(compression) if compression else b""
        size = len(head) + n + len(tail)
        pieces += [_tag(2, _LEN) + _varint(size) + head, data, tail]
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
    return [_tag(number, _LEN) + _varint(size), *pieces]


def encode_packed(
    packed: PackedSegments, compress_keys: frozenset[Key] | set[Key] = frozenset()
) -> bytes:
    """``packed`` as the bytes of a ``pb.PackedSegments`` without its sequences (which
    :func:`insert_request` adds when the segments are sent): one copy of the tensors' data.
    ``compress_keys``: keys sent zstd-compressed."""
    meta = pb.PackedSegments(
        episode_ids=packed.episode_ids.tolist(),
        first_steps=packed.first_steps.tolist(),
        lengths=packed.lengths.tolist(),
    ).SerializeToString()
    pieces = [meta]
    pieces += _tensor_map(5, packed.steps, [packed.num_steps], compress_keys)
    pieces += _tensor_map(6, packed.tails, [len(packed)], compress_keys)
    if packed.frames:  # frame-stacked keys; their rows differ with their k: no batch
        pieces += _tensor_map(7, packed.frames, [], compress_keys)
    return b"".join(pieces)


def insert_request(
    writer_id: str, table: str, packed: Sequence[tuple[int, int, bytes]], timeout_ms: int = 0
) -> bytes:
    """The bytes of an ``InsertRequest`` carrying ``packed``: ``(first sequence, segment
    count, bytes from encode_packed)`` each, numbered ``first, first + 1, ...``."""
    head = pb.InsertRequest(writer_id=writer_id, table=table, timeout_ms=timeout_ms)
    out = [head.SerializeToString()]
    for first, count, body in packed:
        sequences = _packed_ints(1, range(first, first + count))
        out += [_tag(5, _LEN), _varint(len(sequences) + len(body)), sequences, body]
    return b"".join(out)


# -- parsing -------------------------------------------------------------------------------
@dataclass
class TensorView:
    """A ``pb.Tensor`` whose ``data`` is a view of the request (what
    :func:`~millpond.protos.codec.proto_to_tensor` reads)."""

    key: list[str] = field(default_factory=list)
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    data: memoryview | bytes = b""
    compression: int = 0


@dataclass
class TensorMapView:
    """A ``pb.TensorMap`` of :class:`TensorView` tensors."""

    batch_size: list[int] = field(default_factory=list)
    tensors: list[TensorView] = field(default_factory=list)


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


def parse_insert_request(buf: bytes) -> InsertView:
    """Parse the bytes of an ``InsertRequest``, its tensors as views of ``buf``."""
    rest: list[bytes] = []
    packed: list[PackedView] = []
    view = memoryview(buf)
    for number, wire, first, start, stop in _fields(buf, 0, len(buf), "InsertRequest"):
        if number == 5 and wire == _LEN:
            packed.append(_packed(buf, view, start, stop))
        else:
            rest.append(buf[first:stop])
    return InsertView(_protobuf(pb.InsertRequest, rest, "InsertRequest"), packed)


def _packed(buf: bytes, view: memoryview, start: int, stop: int) -> PackedView:
    rest: list[bytes] = []
    maps = {5: TensorMapView(), 6: TensorMapView(), 7: TensorMapView()}  # steps, tails, frames
    for number, wire, first, s, e in _fields(buf, start, stop, "PackedSegments"):
        if number in maps and wire == _LEN:
            # a message field given twice merges, as protobuf does
            _tensor_map_into(maps[number], buf, view, s, e)
        else:
            rest.append(buf[first:e])
    return PackedView(
        _protobuf(pb.PackedSegments, rest, "PackedSegments"), maps[5], maps[6], maps[7]
    )


def _tensor_map_into(out: TensorMapView, buf: bytes, view: memoryview, start: int, stop: int):
    for number, wire, _, s, e in _fields(buf, start, stop, "TensorMap"):
        if number == 1:
            out.batch_size += _ints(buf, wire, s, e)
        elif number == 2 and wire == _LEN:
            out.tensors.append(_tensor(buf, view, s, e))


def _tensor(buf: bytes, view: memoryview, start: int, stop: int) -> TensorView:
    t = TensorView()
    for number, wire, _, s, e in _fields(buf, start, stop, "Tensor"):
        if wire == _LEN and number in (1, 2):
            try:
                text = str(buf[s:e], "utf-8")
            except UnicodeDecodeError:
                raise InvalidDataError(
                    "malformed Tensor: a string field is not valid UTF-8"
                ) from None
            if number == 1:
                t.key.append(text)
            else:
                t.dtype = text
        elif number == 3:
            t.shape += _ints(buf, wire, s, e)
        elif number == 4 and wire == _LEN:
            t.data = view[s:e]
        elif number == 5 and wire == _VARINT:
            t.compression = _signed(s)
    return t


def _ints(buf: bytes, wire: int, start: int, stop: int) -> list[int]:
    """A repeated int64 field's values: one varint (``start`` holds it) or a packed run."""
    if wire == _VARINT:
        return [_signed(start)]
    if wire != _LEN:
        return []  # another wire type: an unknown field to protobuf, skipped alike
    values, pos = [], start
    while pos < stop:
        v, pos = _read_varint(buf, pos, stop, "packed integers")
        values.append(_signed(v))
    return values


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _fields(buf: bytes, pos: int, end: int, what: str):
    """``(number, wire type, first, start, stop)`` for each field in ``buf[pos:end]``: the
    field's bytes are ``buf[first:stop]`` (tag included), its value's ``buf[start:stop]``
    (a varint's value is ``start`` itself)."""
    while pos < end:
        first = pos
        tag, pos = _read_varint(buf, pos, end, what)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise InvalidDataError(f"malformed {what}: field number 0")
        if wire == _VARINT:
            start, pos = _read_varint(buf, pos, end, what)
        elif wire == _LEN:
            n, pos = _read_varint(buf, pos, end, what)
            if n > end - pos:
                raise InvalidDataError(
                    f"malformed {what}: a field of {n} bytes runs past the message's end"
                )
            start, pos = pos, pos + n
        elif wire in (_FIXED64, _FIXED32):
            start = pos
            pos += 8 if wire == _FIXED64 else 4
            if pos > end:
                raise InvalidDataError(f"malformed {what}: a fixed-width field is cut short")
        else:
            raise InvalidDataError(f"malformed {what}: wire type {wire} (groups) is not taken")
        yield number, wire, first, start, pos


def _read_varint(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise InvalidDataError(f"malformed {what}: a varint is cut short")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise InvalidDataError(f"malformed {what}: a varint longer than ten bytes")


def _protobuf(message: type, pieces: list[bytes], what: str):
    try:
        return message.FromString(b"".join(pieces))
    except Exception as e:  # protobuf's DecodeError, or an invalid UTF-8 string
        raise InvalidDataError(f"malformed {what}: {e}") from None
