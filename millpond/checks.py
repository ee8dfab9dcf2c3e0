"""Argument checks every side makes the same way, with messages that quote the bad value."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from millpond.errors import InvalidConfigError, InvalidDataError

__all__ = ["as_int64", "check_batch_size", "check_int", "check_number"]


def check_int(name: str, value: object, low: int) -> None:
    """Raise :class:`InvalidConfigError` unless ``value`` is an integer >= ``low`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidConfigError(f"{name} ({value!r}) must be an integer >= {low}")


def check_number(name: str, value: object, positive: bool = False) -> None:
    """Raise :class:`InvalidConfigError` unless ``value`` is a number >= 0 (> 0 if ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise InvalidConfigError(f"{name} ({value!r}) must be a number >= 0")
    if positive and value == 0:
        raise InvalidConfigError(f"{name} ({value!r}) must be > 0")


def check_batch_size(batch_size: object) -> None:
    """Raise :class:`InvalidDataError` unless ``batch_size`` is an integer >= 1 (a numpy
    integer passes, a bool does not)."""
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int | np.integer)
        or batch_size < 1
    ):
        raise InvalidDataError(f"batch_size ({batch_size!r}) must be a positive integer")


def as_int64(x: Any, name: str = "indexes") -> np.ndarray:
    """Integers (a tensor, array or sequence) as a flat int64 array; anything else is refused.

    Raises :class:`InvalidDataError` naming ``name`` for floats, bools-as-floats and the like:
    an index is never rounded.
    """
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise InvalidDataError(f"{name} must hold integers, received {a.dtype}")
    return a.astype(np.int64).reshape(-1)
