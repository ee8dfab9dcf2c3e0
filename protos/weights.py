"""Policy weights on the wire: a state dict as one serialized ``pb.TensorMap``, in chunks.

A learner publishes (PublishWeights) and actors fetch (GetWeights) a versioned blob: the
state dict as one ``TensorMap``, never pickled. Both streams send a header (version, total
size) and then chunks of at most :data:`WEIGHTS_CHUNK_BYTES`; the shard only stores the
blob.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from millpond.errors import InvalidDataError
from millpond.protos import millpond_pb2 as pb
from millpond.protos.codec import from_tensor_map_flat, to_tensor_map
from millpond.spec import check_key

__all__ = [
    "WEIGHTS_CHUNK_BYTES",
    "chunks",
    "publish_requests",
    "state_dict_from_blob",
    "state_dict_to_blob",
]

#: Well under the smallest message limit a server or client may set (1 MiB).
WEIGHTS_CHUNK_BYTES = 256 * 1024


def chunks(blob: bytes) -> Iterator[bytes]:
    """``blob`` in consecutive pieces of at most :data:`WEIGHTS_CHUNK_BYTES` (none if empty)."""
    view = memoryview(blob)
    for start in range(0, len(blob), WEIGHTS_CHUNK_BYTES):
        yield bytes(view[start : start + WEIGHTS_CHUNK_BYTES])


def publish_requests(
    blob: bytes, version: int, max_lag: int | None = None
) -> Iterator[pb.PublishWeightsRequest]:
    """PublishWeights requests: the first with ``version``, ``total_size`` (and ``max_lag``),
    then chunks."""
    pieces = chunks(blob)
    yield pb.PublishWeightsRequest(
        version=version, total_size=len(blob), chunk=next(pieces, b""), max_lag=max_lag
    )
    for piece in pieces:
        yield pb.PublishWeightsRequest(chunk=piece)


def state_dict_to_blob(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """A state dict as one serialized ``pb.TensorMap`` (batch ``[]``).

    Parameter names become key paths by splitting on ``"."`` (``"fc.weight"`` is
    ``("fc", "weight")``), since key parts hold only letters, digits, ``_`` and ``-``.
    """
    if not isinstance(state_dict, Mapping):
        raise InvalidDataError(
            f"weights must be a state dict (name -> tensor), received {type(state_dict).__name__}"
        )
    flat: dict[tuple[str, ...], torch.Tensor] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise InvalidDataError(f"state dict key {name!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise InvalidDataError(
                f"state dict entry {name!r} is a {type(value).__name__}, not a tensor"
            )
        try:
            key = check_key(tuple(name.split(".")))
        except InvalidDataError:
            raise InvalidDataError(
                f"state dict key {name!r}: each dot-separated part must be letters, digits, "
                "'_' or '-'"
            ) from None
        flat[key] = value
    return to_tensor_map(flat, batch_size=[]).SerializeToString()


def state_dict_from_blob(blob: bytes) -> dict[str, torch.Tensor]:
    """The state dict of :func:`state_dict_to_blob` (names joined back with ``"."``)."""
    msg = pb.TensorMap()
    try:
        msg.ParseFromString(blob)
    except Exception as e:
        raise InvalidDataError(f"weights: corrupt TensorMap ({e})") from e
    flat, _ = from_tensor_map_flat(msg)
    return {".".join(key): value for key, value in flat.items()}
