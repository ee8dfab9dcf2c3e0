"""The TED form of sampled steps, assembled from gathered columns and slot metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from millpond.spec import TERMINATED, TRUNCATED, Key


def assemble_ted(
    now: dict[Key, torch.Tensor],
    nxt: dict[Key, torch.Tensor],
    slots: np.ndarray,
    *,
    generations: np.ndarray,
    episode_ids: np.ndarray,
    steps: np.ndarray,
    weights: np.ndarray | None = None,
    ends: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> TensorDict:
    """Sampled steps as a TorchRL TED TensorDict of batch ``slots.shape``.

    Args:
        now: every stored key at the sampled slots.
        nxt: the observation keys at the following slots: the next observations.
        slots: the sampled step slots.
        generations: each slot's write generation (with the slot, its ``index``).
        episode_ids: the episode of each sampled step.
        steps: each step's index within its episode.
        weights: importance weights (prioritized tables).
        ends: where the batch's trajectories stop along its last axis (a sampler's
            ``Selection.ends``); ``None`` for stored rows as they are (an export).
        mask: false where a short slice repeats its last step; sent as
            ``("collector", "mask")``, as TorchRL's ``split_trajectories`` names it.

    The arrays have ``slots``' shape.

    Root: the observation and step keys, ``done``/``terminated``/``truncated`` (all false:
    a sampled state is never terminal), ``index`` (``slot``, ``generation``),
    ``episode_id``, ``step`` and ``weight``. Under ``"next"``: the observations,
    ``reward`` and the other next keys, and ``done``/``terminated``/``truncated`` of shape
    ``[..., 1]``, as TorchRL's losses read them.

    Where a trajectory stops in the batch without terminating (``ends``), ``("next",
    "truncated")`` is set, and ``done = terminated | truncated``: TorchRL's value
    estimators (GAE, TD(λ), TD(1)) then stop their recursion there and bootstrap from
    ``("next", obs)``, the real next observation. It is TorchRL's own convention for
    sampled slices (``SliceSampler(truncated_key=("next", "truncated"))``), and it makes
    an estimator's value on a sampled batch equal its value on the collector's own record.
    """
    shape = slots.shape
    root: dict[str, Any] = {}
    for key, value in now.items():
        if key not in (TERMINATED, TRUNCATED):
            _put(root, key, value)
    for key, value in nxt.items():
        _put(root, ("next", *key), value)
    term = now[TERMINATED].unsqueeze(-1)
    trunc = now[TRUNCATED]
    if ends is not None:
        trunc = trunc | (
            torch.from_numpy(np.ascontiguousarray(ends, dtype=bool)) & ~now[TERMINATED]
        )
    trunc = trunc.unsqueeze(-1)
    nxt_dict = root.setdefault("next", {})
    nxt_dict["terminated"] = term
    nxt_dict["truncated"] = trunc
    nxt_dict["done"] = term | trunc
    false = torch.zeros(*shape, 1, dtype=torch.bool)
    root["done"] = false
    root["terminated"] = false.clone()
    root["truncated"] = false.clone()
    root["index"] = {
        "slot": torch.from_numpy(np.ascontiguousarray(slots)),
        "generation": torch.from_numpy(np.ascontiguousarray(generations, dtype=np.int64)),
    }
    root["episode_id"] = torch.from_numpy(np.ascontiguousarray(episode_ids, dtype=np.int64))
    root["step"] = torch.from_numpy(np.ascontiguousarray(steps, dtype=np.int64))
    if weights is not None:
        root["weight"] = torch.from_numpy(weights)
    if mask is not None:
        root["collector"] = {"mask": torch.from_numpy(np.ascontiguousarray(mask, dtype=bool))}
    # Every value was built here with the right leading shape: skip TensorDict's checks.
    return TensorDict._new_unsafe(root, batch_size=torch.Size(shape))


def _put(d: dict[str, Any], key: Key, value: torch.Tensor) -> None:
    for part in key[:-1]:
        d = d.setdefault(part, {})
    d[key[-1]] = value


@dataclass
class SlotSample:
    """A sampled batch as the shard stores it: the TED form without the observations, and
    each distinct observation slot once with the rows that rebuild ``obs`` and
    ``("next", obs)`` (what a sample puts on the wire).

    Attributes:
        ted: :func:`assemble_ted` of the step keys alone (no observation keys).
        observations: ``{key: [U, ...]}``, the distinct observation slots.
        rows: int32, the batch's shape: the row of ``observations`` holding each ``obs``.
        next_rows: int32, the batch's shape: the row holding each ``("next", obs)``.
    """

    ted: TensorDict
    observations: dict[Key, torch.Tensor]
    rows: torch.Tensor
    next_rows: torch.Tensor

    def to_ted(self) -> TensorDict:
        """The full TED batch: the observations indexed into place."""
        return expand_observations(self.ted, self.observations, self.rows, self.next_rows)


def expand_observations(
    ted: TensorDict,
    observations: dict[Key, torch.Tensor],
    rows: torch.Tensor,
    next_rows: torch.Tensor,
) -> TensorDict:
    """Set ``obs`` and ``("next", obs)`` of ``ted`` (in place, and returned) from the
    distinct ``observations`` and their int32 ``rows`` / ``next_rows``."""
    shape = tuple(ted.batch_size)
    flat_rows, flat_next = rows.reshape(-1), next_rows.reshape(-1)
    for key, values in observations.items():
        feature = values.shape[1:]
        ted.set(key, torch.index_select(values, 0, flat_rows).reshape(*shape, *feature))
        ted.set(("next", *key), torch.index_select(values, 0, flat_next).reshape(*shape, *feature))
    return ted


def distinct_rows(slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct observation slots of sampled step ``slots`` (any shape): ``(distinct,
    rows, next_rows)``, ``distinct`` the slots of ``slots`` and ``slots + 1`` once each in
    slot order (int64 ``[U]``), ``rows`` / ``next_rows`` (int32, ``slots``' shape) the index
    into ``distinct`` of each step's observation and next observation."""
    shape = slots.shape
    flat = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64).reshape(-1))
    n = flat.numel()
    distinct, inverse = torch.unique(torch.cat([flat, flat + 1]), return_inverse=True)
    inverse = inverse.to(torch.int32)
    return distinct, inverse[:n].reshape(shape), inverse[n:].reshape(shape)


@dataclass
class ColocatedSample:
    """A sampled batch without its observations, for a reader on the shard's host that reads
    them from the table's files (:mod:`millpond.colocated`).

    Attributes:
        ted: :func:`assemble_ted` of the step keys alone (as :attr:`SlotSample.ted`).
        slots: int64 ``[U]``: the distinct observation slots, in slot order.
        generations: int64 ``[U]``: each one's generation when it was sampled; a reader
            that finds another after reading the rows has read an overwritten slot.
        rows: int32, the batch's shape: the slot of ``slots`` holding each ``obs``.
        next_rows: int32, the batch's shape: the slot holding each ``("next", obs)``.
    """

    ted: TensorDict
    slots: torch.Tensor
    generations: torch.Tensor
    rows: torch.Tensor
    next_rows: torch.Tensor
