"""One-hot actions stored as their index, for :mod:`millpond.torchrl`'s buffers.

TorchRL's ``OneHot`` action spec writes a discrete action as ``n`` values (``int64[2]``,
16 bytes, for CartPole's two actions); its index takes one byte. At ``extend``, an
``"action"`` leaf (at the root or nested, e.g. ``("agents", "action")``) whose every real row
is bitwise ``one_hot(i, n)`` in its dtype is stored as ``i`` under the leaf
``"action-one-hot-<dtype>-<n>"``, in the smallest integer dtype that holds ``n - 1``. At
sample time the leaf is rebuilt by its name alone, so every buffer over the table (and
``dumps``) gives the action back bit for bit; ``ReplayClient.sample`` shows the index under
that name, never a changed action under the old one.

The table's first insert decides: an action that is not exactly one-hot there is stored as
it is, for good; once a table holds the index, an action that is not exactly one-hot is
refused, naming its key and row.
"""

from __future__ import annotations

import re

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from millpond.errors import InvalidDataError
from millpond.spec import MASK, TableSpec, dtype_name, format_key, parse_dtype
from millpond.ted import leaf_keys

__all__ = ["decode_one_hot", "encode_one_hot", "holds_one_hot", "real_rows"]

_ACTION = "action"
_ENCODED = re.compile(r"^(?P<leaf>.+)-one-hot-(?P<dtype>[a-z0-9]+)-(?P<n>[0-9]+)$")


def _encoded_leaf(leaf: str, dtype: torch.dtype, n: int) -> str:
    """The stored name of one-hot leaf ``leaf`` of ``n`` values of ``dtype``."""
    return f"{leaf}-one-hot-{dtype_name(dtype)}-{n}"


def _index_dtype(n: int) -> torch.dtype:
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if n - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def encode_one_hot(data: TensorDictBase, spec: TableSpec | None) -> TensorDictBase:
    """``data`` with its one-hot ``"action"`` leaves as indices (see the module's notes);
    ``spec`` is the table's (``None`` before its first insert). ``data`` is not changed."""
    if isinstance(data, LazyStackedTensorDict):
        parts = [encode_one_hot(td, spec) for td in data.tensordicts]
        return LazyStackedTensorDict(*parts, stack_dim=data.stack_dim)
    leaves = leaf_keys(data)
    present = set(leaves)
    for key in leaves:
        if _ENCODED.match(key[-1]):
            raise InvalidDataError(
                f"key {format_key(key)}: leaves named '<leaf>-one-hot-<dtype>-<n>' are where "
                "millpond.torchrl stores one-hot actions; rename it"
            )
    for key in leaves:
        if key[-1] != _ACTION or key[0] in ("next", "collector") or ("next", *key) in present:
            continue
        value = data.get(key)
        if value.dim() != data.batch_dims + 1 or value.shape[-1] < 2 or value.dtype.is_complex:
            continue
        n = value.shape[-1]
        stored = (*key[:-1], _encoded_leaf(key[-1], value.dtype, n))
        if spec is not None and stored not in spec.fields:
            continue  # the table stores this action as it is
        index, bad_row = _index_of(value, real_rows(data, value))
        if bad_row is not None:
            if spec is None:
                continue  # not one-hot: stored as it is
            raise InvalidDataError(
                f"key {format_key(key)}: the table stores it as the index of a one-hot "
                f"{dtype_name(value.dtype)}[{n}] (its first insert was one), but row "
                f"{bad_row} is not exactly one-hot: {value.reshape(-1, n)[bad_row].tolist()}; "
                "store such actions in a table of their own"
            )
        data = data.clone(recurse=False)  # the caller's TensorDict keeps its action
        del data[key]
        data.set(stored, index.to(_index_dtype(n)))
    return data


def real_rows(data: TensorDictBase, value: torch.Tensor) -> torch.Tensor:
    """Which rows are steps, not ``split_trajs`` padding (never stored, never checked)."""
    mask = data.get(MASK, None)
    if mask is None:
        return torch.ones(value.shape[:-1], dtype=torch.bool)
    return mask.reshape(value.shape[:-1]).bool()


def _index_of(value: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The index of each row, and the first real row (flat) that is not bitwise one-hot."""
    index = value.argmax(-1) if value.dtype != torch.bool else value.to(torch.uint8).argmax(-1)
    rebuilt = torch.nn.functional.one_hot(index, value.shape[-1]).to(value.dtype)
    differs = _bits(rebuilt) != _bits(value)
    bad = (differs.any(-1) & real).reshape(-1)
    where = torch.nonzero(bad)
    return index, (int(where[0]) if len(where) else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width: ``-0.0`` is not ``0.0``, a NaN no match."""
    if t.dtype.is_floating_point:
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(width)
    return t


def holds_one_hot(spec: TableSpec | None) -> bool:
    """Whether a table of ``spec`` stores a one-hot action as its index."""
    return spec is not None and any(_ENCODED.match(k[-1]) for k in spec.fields)


def decode_one_hot(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` with every stored index leaf rebuilt as its one-hot action, in place."""
    for key in leaf_keys(batch):
        match = _ENCODED.match(key[-1])
        if match is None:
            continue
        n, dtype = int(match["n"]), parse_dtype(match["dtype"])
        index = batch.get(key).long()
        del batch[key]
        batch.set((*key[:-1], match["leaf"]), torch.nn.functional.one_hot(index, n).to(dtype))
    return batch
