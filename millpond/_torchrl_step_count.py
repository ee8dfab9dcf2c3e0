"""TorchRL's ``StepCounter`` count rebuilt from millpond's ``step``, for :mod:`millpond.torchrl`.

``StepCounter`` writes ``"step_count"`` (``int64[1]``: the steps since the env's reset) at
the root and, one more, under ``"next"``: the index of the step within its episode, which a
millpond table keeps anyway as each sampled step's ``"step"``. At ``extend``, a root
``"step_count"`` whose ``("next", "step_count")`` is bitwise one more on every real row is
handed to :func:`millpond.ted.compact_ted` as ``("collector", "step_count")``: each episode
the table has not seen starts at its count (so a buffer started beside a running collector,
or one loading a dump whose episode beginnings were evicted, keeps TorchRL's counts), and a
count that is not its step index is refused there, naming the row. The table stores, instead
of the two columns, the zero-byte leaf ``"step_count-from-step-<dtype>-<shape>"``, by whose
name alone every buffer over the table (and ``dumps``) rebuilds both, bit for bit.

The table's first insert decides, as for one-hot actions: counts that are not exact there
(missing, not rising by 1 along a trajectory, not integers of one value per step) are
stored as they are, for good; once a table rebuilds them, counts that are not exact are
refused.
"""

from __future__ import annotations

import re

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from millpond._torchrl_one_hot import real_rows
from millpond.errors import InvalidDataError
from millpond.spec import STEP_COUNT, Key, TableSpec, dtype_name, format_key, parse_dtype
from millpond.ted import leaf_keys

__all__ = ["decode_step_count", "encode_step_count", "holds_step_count"]

_LEAF = "step_count"
_NEXT: Key = ("next", _LEAF)
_ENCODED = re.compile(r"^step_count-from-step-(?P<dtype>[a-z0-9]+)-(?P<shape>scalar|1)$")


def _encoded_leaf(dtype: torch.dtype, per_step: tuple[int, ...]) -> str:
    return f"{_LEAF}-from-step-{dtype_name(dtype)}-{'1' if per_step else 'scalar'}"


def holds_step_count(spec: TableSpec | None) -> bool:
    """Whether a table of ``spec`` rebuilds ``"step_count"`` from ``"step"``."""
    return spec is not None and any(len(k) == 1 and _ENCODED.match(k[0]) for k in spec.fields)


def encode_step_count(data: TensorDictBase, spec: TableSpec | None) -> TensorDictBase:
    """``data`` with its ``"step_count"`` handed over as the steps' indices (see the module's
    notes); ``spec`` is the table's (``None`` before its first insert). ``data`` is not
    changed."""
    if isinstance(data, LazyStackedTensorDict):
        parts = [encode_step_count(td, spec) for td in data.tensordicts]
        return LazyStackedTensorDict(*parts, stack_dim=data.stack_dim)
    leaves = set(leaf_keys(data))
    for key in leaves:
        if _ENCODED.match(key[-1]):
            raise InvalidDataError(
                f"key {format_key(key)}: leaves named 'step_count-from-step-<dtype>-<shape>' "
                "mark a step count millpond.torchrl rebuilds; rename it"
            )
    rebuilds = holds_step_count(spec)
    if spec is not None and not rebuilds:
        return data  # the table stores the counts as they are
    problem = _not_exact(data, leaves)
    if problem is not None:
        if not rebuilds:
            return data
        raise InvalidDataError(
            f"key 'step_count': the table rebuilds it from each step's index in its episode "
            f"(its first insert's counts were exact), but {problem}; store such data in a "
            "table of its own"
        )
    count = data.get(_LEAF)
    stored = _encoded_leaf(count.dtype, tuple(count.shape[data.batch_dims :]))
    if rebuilds and (stored,) not in spec.fields:
        raise InvalidDataError(
            f"key 'step_count' is {dtype_name(count.dtype)}{list(count.shape[data.batch_dims :])}"
            " but the table rebuilds it as "
            + next(k[0] for k in spec.fields if len(k) == 1 and _ENCODED.match(k[0]))
        )
    data = data.clone(recurse=False)  # the caller's TensorDict keeps its counts
    del data[_LEAF]
    del data[_NEXT]
    data.set(STEP_COUNT, count.reshape(data.batch_size).to(torch.int64))
    data.set(stored, torch.empty((*data.batch_size, 0), dtype=torch.uint8))
    return data


def _not_exact(data: TensorDictBase, leaves: set[Key]) -> str | None:
    """Why the counts cannot be rebuilt from the steps' indices (``None``: they can)."""
    if (_LEAF,) not in leaves or _NEXT not in leaves:
        return "the data has no 'step_count' and ('next', 'step_count')"
    if STEP_COUNT in leaves:
        return "the data has ('collector', 'step_count') too"
    count, after = data.get(_LEAF), data.get(_NEXT)
    per_step = tuple(count.shape[data.batch_dims :])
    if count.dtype.is_floating_point or count.dtype.is_complex or count.dtype == torch.bool:
        return f"it is {dtype_name(count.dtype)}, not integers"
    if per_step not in ((), (1,)) or after.shape != count.shape or after.dtype != count.dtype:
        return (
            f"it is {dtype_name(count.dtype)}{list(per_step)} and ('next', 'step_count') "
            f"{dtype_name(after.dtype)}{list(after.shape[data.batch_dims :])}: one count per step "
            "in both is rebuilt"
        )
    rows = count.reshape(-1)
    differs = (after.reshape(-1) != rows + 1) & real_rows(data, rows.reshape(-1, 1))
    bad = torch.nonzero(differs).reshape(-1)
    if len(bad):
        return (
            f"('next', 'step_count') of row {int(bad[0])} (flattened) is "
            f"{int(after.reshape(-1)[bad[0]])}, not 'step_count' + 1"
        )
    return None


def decode_step_count(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` with ``"step_count"`` and ``("next", "step_count")`` rebuilt from
    ``"step"`` where its table stores them so, in place."""
    for key in leaf_keys(batch):
        match = _ENCODED.match(key[-1]) if len(key) == 1 else None
        if match is None:
            continue
        dtype = parse_dtype(match["dtype"])
        step = batch.get("step")
        shape = (*step.shape, 1) if match["shape"] == "1" else step.shape
        del batch[key]
        batch.set(_LEAF, step.to(dtype).reshape(shape))
        batch.set(_NEXT, (step + 1).to(dtype).reshape(shape))
    return batch
