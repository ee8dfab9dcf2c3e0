"""The tensor codec: tensors and TensorDicts to protos and back.

Tensors travel as raw little-endian bytes in C order with dtype and shape; they are never
pickled. Decoding checks every field before trusting it, so a malformed message raises
:class:`~millpond.errors.InvalidDataError` naming the key instead of crashing a server.
The sampled batches built from these are :mod:`.samples`.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.errors import InvalidDataError, ResourceExhaustedError
from millpond.protos import millpond_pb2 as pb
from millpond.spec import FieldSpec, Key, check_key_size, dtype_name, format_key, parse_dtype

_LITTLE = sys.byteorder == "little"
#: The most bytes a tensor may declare when no budget bounds it (a client decoding a
#: sample): far beyond any real tensor, far below what overflows int64 arithmetic.
MAX_TENSOR_BYTES = 2**62
# zstd contexts are not safe to share between threads (a shard serves many calls at once,
# and concurrent use of one context corrupts data or crashes): one pair per thread.
_zstd = threading.local()


def _compressor():
    c = getattr(_zstd, "compressor", None)
    if c is None:
        import zstandard

        c = _zstd.compressor = zstandard.ZstdCompressor(level=1)
    return c


def _decompressor():
    d = getattr(_zstd, "decompressor", None)
    if d is None:
        import zstandard

        d = _zstd.decompressor = zstandard.ZstdDecompressor()
    return d


def tensor_to_proto(key: Key, t: torch.Tensor, compress: bool = False) -> pb.Tensor:
    """One tensor as a :class:`pb.Tensor` (zstd-compressed if ``compress``)."""
    msg = pb.Tensor()
    fill_tensor(msg, key, t, compress)
    return msg


def fill_tensor(msg: pb.Tensor, key: Key, t: torch.Tensor, compress: bool) -> None:
    """Write one tensor into the empty ``msg`` (in place: a field of the message being built)."""
    dtype, shape, data, compression = tensor_payload(t, compress)
    msg.key.extend(key)
    msg.dtype = dtype
    msg.shape.extend(shape)
    msg.data = data if isinstance(data, bytes) else data.tobytes()
    msg.compression = compression


def tensor_payload(
    t: torch.Tensor, compress: bool = False
) -> tuple[str, tuple[int, ...], np.ndarray | bytes, int]:
    """What a :class:`pb.Tensor` of ``t`` carries: ``(dtype name, shape, data, compression)``.

    ``data`` is the tensor's little-endian bytes in C order: a flat uint8 array that is a
    view of ``t``'s memory where it can be (contiguous, little-endian host), so the caller
    copies it once, where it lands; or the zstd-compressed bytes when ``compress``.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():  # lazy views (e.g. ``x.conj()``): materialise the values
        t = t.resolve_conj().resolve_neg()
    if _LITTLE and t.dtype is not torch.bfloat16:
        # numpy copies only what is not C-contiguous already
        data = np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)
    else:
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8)
        if not _LITTLE and t.element_size() > 1:
            raw = torch.from_numpy(flat.numpy().byteswap()).view(torch.uint8)
        data = raw.numpy()
    compression = pb.COMPRESSION_NONE
    if compress and data.size:
        data = _compressor().compress(data)
        compression = pb.COMPRESSION_ZSTD
    return dtype_name(t.dtype), tuple(t.shape), data, compression


class Budget:
    """The bytes the tensors of one message may still decode to.

    A declared shape is what the decoder allocates (and what zstd may inflate to), so it is
    charged here before anything is allocated: one small message cannot make the receiver
    hold more than ``limit`` bytes of tensors, however much its shapes claim.
    """

    def __init__(self, limit: int, what: str = "the message limit") -> None:
        self.limit = limit
        self.used = 0
        self.what = what

    def take(self, nbytes: int, name: str, described: str) -> None:
        if self.used + nbytes > self.limit:
            raise ResourceExhaustedError(
                f"tensor {name}: {described} takes {nbytes} bytes decoded; with the "
                f"message's other tensors ({self.used} bytes) that is more than {self.what} "
                f"({self.limit} bytes); send fewer steps per message"
            )
        self.used += nbytes


#: ``expect(key, dtype, shape)``: raises if a declared tensor cannot be what the receiver
#: takes (a table's spec), before its data is decoded.
Expect = Callable[[Key, torch.dtype, tuple[int, ...]], None]


def proto_to_tensor(
    msg: pb.Tensor,
    budget: Budget | None = None,
    expect: Expect | None = None,
    *,
    copy: bool = True,
) -> tuple[Key, torch.Tensor]:
    """Decode one :class:`pb.Tensor`, validating dtype, shape and byte count.

    Everything the message declares is checked before anything is allocated: the key's
    size, the dtype, the shape (against ``budget`` and ``expect`` when given), and a zstd
    frame's declared content size against the shape. With ``copy=False`` the tensor is a
    read-only view of the message's bytes, for a caller that only reads from it.
    """
    key = tuple(msg.key)
    check_key_size(key)
    name = format_key(key) if key else "<no key>"
    if not key or not all(key):
        raise InvalidDataError(f"tensor {name}: empty key")
    try:
        dtype = parse_dtype(msg.dtype)
    except Exception as e:
        raise InvalidDataError(f"tensor {name}: {e}") from None
    shape = tuple(msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidDataError(f"tensor {name}: negative dimension in shape {_brief(shape)}")
    itemsize = dtype.itemsize
    # Zero dimensions count as 1 here, so that an empty tensor cannot carry dimensions whose
    # product overflows (torch computes it).
    span = itemsize
    for s in shape:
        span *= max(s, 1)
    limit = MAX_TENSOR_BYTES if budget is None else budget.limit
    if span > limit:
        raise (InvalidDataError if budget is None else ResourceExhaustedError)(
            f"tensor {name}: shape {_brief(shape)} of {msg.dtype} spans {span} bytes, more "
            f"than {'the largest tensor' if budget is None else budget.what} ({limit} bytes)"
        )
    expected = math.prod(shape) * itemsize
    if expect is not None:
        expect(key, dtype, shape)
    if budget is not None:
        budget.take(expected, name, f"shape {_brief(shape)} of {msg.dtype}")
    data = msg.data
    if msg.compression == pb.COMPRESSION_ZSTD:
        data = _decompress(data, expected, name)
    elif msg.compression != pb.COMPRESSION_NONE:
        raise InvalidDataError(f"tensor {name}: unknown compression {msg.compression}")
    if len(data) != expected:
        raise InvalidDataError(
            f"tensor {name}: {len(data)} bytes for {msg.dtype}{_brief(shape)}, expected {expected}"
        )
    if expected == 0:
        return key, torch.empty(shape, dtype=dtype)
    if not copy and _LITTLE:
        with warnings.catch_warnings():  # read-only: the caller promises not to write
            warnings.simplefilter("ignore", UserWarning)
            return key, torch.frombuffer(data, dtype=dtype).reshape(shape)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if not _LITTLE and itemsize > 1:
        buf = torch.from_numpy(buf.numpy().view(f"<u{itemsize}").byteswap().view(np.uint8))
    return key, buf.view(dtype).reshape(shape)


def _decompress(data: bytes, expected: int, name: str) -> bytes:
    """zstd ``data`` that must inflate to exactly ``expected`` bytes, never more.

    ``max_output_size`` bounds only frames that do not declare their size: a frame that
    declares one is inflated to it whatever the bound, so the declared size is read first.
    """
    if not data:
        return data
    if expected == 0:  # and zstd's max_output_size=0 would mean "no bound"
        raise InvalidDataError(f"tensor {name}: {len(data)} compressed bytes for an empty tensor")
    try:
        import zstandard

        declared = zstandard.frame_content_size(data)
    except Exception as e:
        raise InvalidDataError(f"tensor {name}: corrupt zstd data ({e})") from None
    if declared not in (-1, expected):
        raise InvalidDataError(
            f"tensor {name}: the zstd frame declares {declared} bytes, the shape {expected}"
        )
    try:
        return _decompressor().decompress(data, max_output_size=expected)
    except Exception as e:
        raise InvalidDataError(f"tensor {name}: corrupt zstd data ({e})") from None


def _brief(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else f"{text[:80]}... ({len(shape)} dimensions)"


def to_tensor_map(
    td: TensorDictBase | Mapping[Key, torch.Tensor],
    batch_size: Iterable[int] | None = None,
    compress_keys: frozenset[Key] | set[Key] = frozenset(),
    exclude: frozenset[Key] | set[Key] = frozenset(),
    out: pb.TensorMap | None = None,
) -> pb.TensorMap:
    """A TensorDict (or a ``{key tuple: tensor}`` mapping) as a :class:`pb.TensorMap`.

    With ``out`` (an empty TensorMap field of a message being built, e.g. ``segment.steps``)
    the tensors are written there and ``out`` is returned: passing a built TensorMap to a
    message constructor instead deep-copies every tensor's bytes once more.
    """
    if isinstance(td, TensorDictBase):
        batch = list(td.batch_size)
        items = (
            ((k,) if isinstance(k, str) else tuple(k), v)
            for k, v in td.items(include_nested=True, leaves_only=True)
        )
    else:
        batch = list(batch_size) if batch_size is not None else []
        items = iter(td.items())
    msg = pb.TensorMap() if out is None else out
    msg.batch_size.extend(batch)
    for k, v in items:
        if k not in exclude:
            fill_tensor(msg.tensors.add(), k, v, k in compress_keys)
    return msg


def from_tensor_map_flat(
    msg: pb.TensorMap,
    budget: Budget | None = None,
    spec: Mapping[Key, FieldSpec] | None = None,
    what: str = "steps",
    *,
    copy: bool = True,
) -> tuple[dict[Key, torch.Tensor], list[int]]:
    """Decode a :class:`pb.TensorMap` into ``({key tuple: tensor}, batch_size)``.

    With a ``budget``, the tensors' decoded bytes are charged to it before they are
    allocated. With ``spec`` (a table's fields), a tensor of a key of ``spec`` whose dtype or
    per-step shape (after the batch dimensions) differs is refused before it is decoded;
    ``what`` names the part of the message in that error. ``copy=False``: the tensors are
    read-only views of the message's bytes where they can be (see :func:`proto_to_tensor`).
    """
    batch = list(msg.batch_size)
    if any(b < 0 for b in batch):
        raise InvalidDataError(f"negative batch size {_brief(tuple(batch))}")

    def expect(key: Key, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if list(shape[: len(batch)]) != batch:
            raise InvalidDataError(
                f"tensor {format_key(key)}: shape {_brief(shape)} does not start with the "
                f"batch size {_brief(tuple(batch))}"
            )
        f = spec.get(key) if spec is not None else None
        if f is not None and (dtype != f.dtype or shape[len(batch) :] != f.shape):
            raise InvalidDataError(
                f"key {format_key(key)} in {what}: expected dtype and shape {f.describe()} "
                f"per step, received {dtype_name(dtype)}{_brief(shape[len(batch) :])}"
            )

    out: dict[Key, torch.Tensor] = {}
    for t in msg.tensors:
        key, value = proto_to_tensor(t, budget, expect, copy=copy)
        if key in out:
            raise InvalidDataError(f"tensor {format_key(key)} appears twice")
        out[key] = value
    return out, batch


def from_tensor_map(msg: pb.TensorMap) -> TensorDict:
    """Decode a :class:`pb.TensorMap` into a (nested) TensorDict."""
    flat, batch = from_tensor_map_flat(msg)
    return nest(flat, batch)


def nest(flat: Mapping[Key, torch.Tensor], batch_size: Iterable[int]) -> TensorDict:
    """Build a nested TensorDict from ``{key tuple: tensor}``."""
    root: dict = {}
    for key, value in flat.items():
        d = root
        for part in key[:-1]:
            d = d.setdefault(part, {})
            if not isinstance(d, dict):
                raise InvalidDataError(f"key {format_key(key)} nests under a tensor")
        if key[-1] in d:
            raise InvalidDataError(f"key {format_key(key)} is both a tensor and a group")
        d[key[-1]] = value
    try:
        return TensorDict(root, batch_size=list(batch_size))
    except RuntimeError as e:
        raise InvalidDataError(f"inconsistent batch size: {e}") from None
