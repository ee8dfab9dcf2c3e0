"""The exact encodings :mod:`millpond.torchrl`'s buffers store TorchRL data in, in one place.

Each stores a key more compactly under a leaf whose name says how to rebuild it, so every
buffer over the table (and ``dumps``) rebuilds it from the spec alone, bit for bit; each is
decided by the table's first insert (see the modules): a one-hot action as its index
(:mod:`millpond._torchrl_one_hot`), and ``StepCounter``'s ``"step_count"`` as each step's
index in its episode (:mod:`millpond._torchrl_step_count`).
"""

from __future__ import annotations

from collections.abc import Callable

from tensordict import TensorDictBase

from millpond._torchrl_one_hot import decode_one_hot, encode_one_hot, holds_one_hot
from millpond._torchrl_step_count import decode_step_count, encode_step_count, holds_step_count
from millpond.errors import InvalidDataError
from millpond.spec import TableSpec
from millpond.ted import StepCountError

__all__ = ["decode", "extend_encoded", "holds_encoding"]


def holds_encoding(spec: TableSpec | None) -> bool:
    """Whether a table of ``spec`` stores any key encoded (its exports need decoding)."""
    return holds_one_hot(spec) or holds_step_count(spec)


def decode(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` (a sample or an export) with every encoded key rebuilt, in place."""
    return decode_step_count(decode_one_hot(batch))


def extend_encoded(
    extend: Callable[[TensorDictBase], int], data: TensorDictBase, spec: TableSpec | None
) -> int:
    """``extend(data)`` (a client's extend into the table) with ``data``'s keys encoded as a
    table of ``spec`` stores them (``None``: before its first insert, which then decides)."""
    counted = encode_step_count(data, spec)
    try:
        return extend(encode_one_hot(counted, spec))
    except StepCountError as e:
        if counted is data:
            raise  # the data's own ('collector', 'step_count')
        if holds_step_count(spec):
            raise InvalidDataError(
                f"key 'step_count': the table rebuilds it from each step's index in its "
                f"episode (its first insert's counts were exact), but {e.detail}; store such "
                "data in a table of its own"
            ) from None
    # Not exact at the table's first insert: the counts are stored as they are.
    return extend(encode_one_hot(data, spec))
