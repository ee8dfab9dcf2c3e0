"""Protobuf's wire format by hand, for the few messages that carry megabytes of tensors.

Built and parsed by protobuf, every tensor byte of a message is copied about four times on
each side (the tensor's bytes, the message, the serialization; the parse, ``Tensor.data``,
a writable buffer). For image observations those copies, not the network, bound inserts
and samples. These helpers write a message as *pieces* — small headers, and the tensors'
own memory — that one ``b"".join`` copies once into the bytes gRPC sends; and read a
message's tensors back as :class:`TensorView` s whose data are views of the received bytes.
The bytes are protobuf's encoding of the same messages, so any protobuf peer reads and
writes them. :mod:`.wire` builds the Insert and Sample messages from these.

Only tensors and tensor maps are parsed here; a message's other fields are handed to
protobuf itself (:func:`parse_rest`). Anything malformed raises
:class:`~millpond.errors.InvalidDataError` naming the message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from millpond.errors import InvalidDataError
from millpond.protos.codec import tensor_payload
from millpond.spec import Key

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
_U64 = (1 << 64) - 1
#: What :func:`join` takes: bytes, or a flat uint8 array (a tensor's memory).
Piece = bytes | np.ndarray


# -- writing -------------------------------------------------------------------------------
def varint(value: int) -> bytes:
    value &= _U64  # negative int64: ten bytes of two's complement, as protobuf writes them
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def packed_ints(number: int, values: Sequence[int]) -> bytes:
    """A repeated integer field, packed (nothing when empty, as protobuf writes it)."""
    if not values:
        return b""
    body = b"".join(varint(v) for v in values)
    return tag(number, LEN) + varint(len(body)) + body


def packed_doubles(number: int, values: np.ndarray) -> list[Piece]:
    """A repeated double field, packed (nothing when empty): its header, then the values'
    little-endian float64 bytes."""
    if not len(values):
        return []
    data = np.ascontiguousarray(values, dtype="<f8").view(np.uint8).reshape(-1)
    return [tag(number, LEN) + varint(data.nbytes), data]


def string(number: int, text: str) -> bytes:
    raw = text.encode()
    return tag(number, LEN) + varint(len(raw)) + raw


def size_of(pieces: Sequence[Piece]) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)


def message(number: int, pieces: list[Piece]) -> list[Piece]:
    """Field ``number`` holding the message made of ``pieces``."""
    return [tag(number, LEN) + varint(size_of(pieces)), *pieces]


def tensor(number: int, key: Key, value: torch.Tensor, compress: bool = False) -> list[Piece]:
    """Field ``number`` holding a ``Tensor``: its header, then its data (a view of
    ``value``'s memory where it can be; zstd-compressed bytes when ``compress``)."""
    dtype, shape, data, compression = tensor_payload(value, compress)
    head = b"".join(string(1, part) for part in key) + string(2, dtype) + packed_ints(3, shape)
    n = len(data) if isinstance(data, bytes) else data.nbytes
    if n:
        head += tag(4, LEN) + varint(n)
    trailer = tag(5, VARINT) + varint(compression) if compression else b""
    return message(number, [head, data, trailer])


def tensor_map(
    number: int,
    tensors: Mapping[Key, torch.Tensor],
    batch_size: Sequence[int],
    compress_keys: frozenset[Key] | set[Key] = frozenset(),
) -> list[Piece]:
    """Field ``number`` holding a ``TensorMap`` of ``tensors``."""
    pieces: list[Piece] = [packed_ints(1, batch_size)]
    for key, value in tensors.items():
        pieces += tensor(2, key, value, key in compress_keys)
    return message(number, pieces)


# -- reading -------------------------------------------------------------------------------
@dataclass
class TensorView:
    """A ``pb.Tensor`` whose ``data`` is a view of the received bytes (what
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


def fields(buf: bytes, pos: int, end: int, what: str) -> Iterator[tuple[int, int, int, int, int]]:
    """``(number, wire type, first, start, stop)`` for each field in ``buf[pos:end]``: the
    field's bytes are ``buf[first:stop]`` (tag included), its value's ``buf[start:stop]``
    (a varint's value is ``start`` itself)."""
    while pos < end:
        first = pos
        key, pos = read_varint(buf, pos, end, what)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise InvalidDataError(f"malformed {what}: field number 0")
        if wire == VARINT:
            start, pos = read_varint(buf, pos, end, what)
        elif wire == LEN:
            n, pos = read_varint(buf, pos, end, what)
            if n > end - pos:
                raise InvalidDataError(
                    f"malformed {what}: a field of {n} bytes runs past the message's end"
                )
            start, pos = pos, pos + n
        elif wire in (FIXED64, FIXED32):
            start = pos
            pos += 8 if wire == FIXED64 else 4
            if pos > end:
                raise InvalidDataError(f"malformed {what}: a fixed-width field is cut short")
        else:
            raise InvalidDataError(f"malformed {what}: wire type {wire} (groups) is not taken")
        yield number, wire, first, start, pos


def read_varint(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
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


def read_tensor_map(
    out: TensorMapView, buf: bytes, view: memoryview, start: int, stop: int
) -> TensorMapView:
    """Add the ``TensorMap`` in ``buf[start:stop]`` to ``out`` (a message field given twice
    merges, as protobuf does); returns ``out``."""
    for number, wire, _, s, e in fields(buf, start, stop, "TensorMap"):
        if number == 1:
            out.batch_size += _ints(buf, wire, s, e)
        elif number == 2 and wire == LEN:
            out.tensors.append(read_tensor(TensorView(), buf, view, s, e))
    return out


def read_tensor(t: TensorView, buf: bytes, view: memoryview, start: int, stop: int) -> TensorView:
    """Add the ``Tensor`` in ``buf[start:stop]`` to ``t`` (merging, as protobuf does)."""
    for number, wire, _, s, e in fields(buf, start, stop, "Tensor"):
        if wire == LEN and number in (1, 2):
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
        elif number == 4 and wire == LEN:
            t.data = view[s:e]
        elif number == 5 and wire == VARINT:
            t.compression = _signed(s)
    return t


def _ints(buf: bytes, wire: int, start: int, stop: int) -> list[int]:
    """A repeated int64 field's values: one varint (``start`` holds it) or a packed run."""
    if wire == VARINT:
        return [_signed(start)]
    if wire != LEN:
        return []  # another wire type: an unknown field to protobuf, skipped alike
    values, pos = [], start
    while pos < stop:
        v, pos = read_varint(buf, pos, stop, "packed integers")
        values.append(_signed(v))
    return values


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def parse_rest(message_type: type, pieces: list[bytes], what: str):
    """The fields not parsed here (``pieces``: each field's bytes), parsed by protobuf."""
    try:
        return message_type.FromString(b"".join(pieces))
    except Exception as e:  # protobuf's DecodeError, or an invalid UTF-8 string
        raise InvalidDataError(f"malformed {what}: {e}") from None
