"""Priority updates of sampled steps, each sent to the shard that sampled it.

A sampled batch's ``"index"`` names each step's shard, slot and generation; the updates are
grouped by shard and sent in parallel, one call per shard. A shard that cannot be reached is
skipped with a warning (its priorities are dropped), any other error is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.checks import as_int64
from millpond.errors import InvalidDataError, MillpondError
from millpond.learner.client._shards import ShardSet
from millpond.protos import millpond_pb2 as pb

logger = logging.getLogger("millpond.client")


def update_priorities(
    shards: ShardSet,
    table: str,
    index: TensorDictBase | Mapping[str, Any],
    priorities: torch.Tensor | np.ndarray | Sequence[float],
) -> int:
    """Set the priorities of sampled steps; returns how many were applied (see
    :meth:`ReplayClient.update_priorities <millpond.learner.client.ReplayClient.update_priorities>`)."""
    try:
        slots = as_int64(index["slot"], "index['slot']")
        gens = as_int64(index["generation"], "index['generation']")
        shard_ids = as_int64(index["shard"], "index['shard']")
    except KeyError as e:
        raise InvalidDataError(
            "update_priorities needs a sampled batch's 'index' (slot, generation, shard); "
            f"missing {e}"
        ) from None
    prios = _float64(priorities)
    if not len(slots) == len(gens) == len(shard_ids) == len(prios):
        raise InvalidDataError(
            f"update_priorities: {len(slots)} slots, {len(gens)} generations, "
            f"{len(shard_ids)} shard ids and {len(prios)} priorities; they must be equal"
        )
    handles = shards.shards
    if len(shard_ids) and (shard_ids.min() < 0 or shard_ids.max() >= len(handles)):
        raise InvalidDataError(f"index['shard'] out of range [0, {len(handles)})")
    targets = [handles[i] for i in np.unique(shard_ids).tolist()]

    def update(shard: Any) -> int:
        mask = shard_ids == shard.index
        request = pb.UpdatePrioritiesRequest(
            table=table,
            slots=slots[mask].tolist(),
            generations=gens[mask].tolist(),
            priorities=prios[mask].tolist(),
        )
        return int(shards.call(shard, "UpdatePriorities", request).applied)

    applied = 0
    for shard, result in zip(targets, shards.each(targets, update), strict=True):
        if isinstance(result, MillpondError) and shard.down:
            logger.warning(
                "update_priorities: shard %s is unavailable; its %d priorities are dropped",
                shard.address,
                int((shard_ids == shard.index).sum()),
            )
        elif isinstance(result, MillpondError):
            raise result
        else:
            applied += result
    return applied


def _float64(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    try:
        return np.asarray(x, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise InvalidDataError(f"priorities must be numbers: {e}") from None
