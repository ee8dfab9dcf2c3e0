"""Policy weights exchanged through the weights rendezvous: published by the learner, fetched
by the actors.

The rendezvous is shard 0, or the lowest-numbered shard not lost for good
(:meth:`~millpond.learner.client._shards.ShardSet.rendezvous`). A state dict travels as one
blob (:mod:`millpond.protos.weights`), in chunks both ways: ``PublishWeights`` streams it up
(``PublishWeightsAtOnce``, one message, when it is one chunk or less: a small network's
weights, published every few learner steps, skip a client stream's costs), ``GetWeights``
streams a header (version, size) and the chunks back.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import numpy as np
import torch

from millpond.errors import MillpondError
from millpond.learner.client._errors import from_rpc_error
from millpond.learner.client._shards import ShardSet
from millpond.protos import millpond_pb2 as pb
from millpond.protos.weights import (
    WEIGHTS_CHUNK_BYTES,
    publish_requests,
    state_dict_from_blob,
    state_dict_to_blob,
)


def publish(
    shards: ShardSet,
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    max_lag: int | None = None,
) -> tuple[int, float]:
    """Publish ``state_dict`` as ``version`` on the rendezvous, once the acting actors hold
    ``version - max_lag`` or newer; returns the version stored and the seconds it waited
    for them."""
    blob = state_dict_to_blob(state_dict)
    shard = shards.rendezvous()
    requests = publish_requests(blob, version, max_lag)
    if len(blob) <= WEIGHTS_CHUNK_BYTES:
        response = shards.call(
            shard, "PublishWeightsAtOnce", next(requests), doing="PublishWeights"
        )
    else:
        response = shards.call(shard, "PublishWeights", requests)
    return int(response.version), float(response.waited_s)


def fetch(
    shards: ShardSet,
    min_version: int,
    timeout_s: float,
    call_timeout_s: float | None,
    actor: str = "",
    acting: bool = False,
) -> tuple[dict[str, torch.Tensor] | None, int]:
    """The rendezvous's latest weights, as ``(state_dict, version)``, waiting up to
    ``timeout_s`` for a version ``>= min_version``, else ``(None, latest_version)``; a named
    ``actor`` tells the rendezvous whether it is ``acting`` from now on (bounded staleness).

    The call's deadline is ``timeout_s`` plus ``call_timeout_s`` (the client's; ``None``:
    none)."""
    shard = shards.rendezvous()
    request = pb.GetWeightsRequest(
        min_version=min_version,
        timeout_ms=int(np.ceil(timeout_s * 1000)),
        actor=actor,
        acting=acting,
    )
    deadline = None if call_timeout_s is None else timeout_s + call_timeout_s
    try:
        call = shard.stub.GetWeights(request, timeout=deadline, metadata=shards.metadata)
        messages = list(call)
    except grpc.RpcError as err:
        shards.note_failure(shard, err, "GetWeights")
        raise from_rpc_error(err, shard.address) from err
    shards.note_up(shard)
    if not messages:
        raise MillpondError(f"shard {shard.address}: GetWeights sent no header")
    version = int(messages[0].version)
    if version < 0 or version < min_version:
        return None, version
    blob = b"".join(m.chunk for m in messages)
    if len(blob) != messages[0].total_size:
        raise MillpondError(
            f"shard {shard.address}: weights version {version} has {len(blob)} bytes, "
            f"the header announced {messages[0].total_size}"
        )
    return state_dict_from_blob(blob), version
