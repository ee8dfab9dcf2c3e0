"""Dataclass configs to and from plain YAML-able data, checking keys and types on the way
in: what every ``millpond launch`` section is read with, so that a wrong key or type is
refused by its dotted name (``learner.dqn.lr: expected a number, got 'x' (str)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from millpond.errors import InvalidConfigError

__all__ = ["from_mapping", "to_mapping", "value_kind"]


def to_mapping(config: Any) -> Any:
    """A config as plain YAML-able data (the inverse of :func:`from_mapping`)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_mapping(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {k: to_mapping(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [to_mapping(v) for v in config]
    return config


def from_mapping(cls: type, data: Any, path: str = "") -> Any:
    """Build the dataclass ``cls`` from ``data``, checking keys and types recursively."""
    if not isinstance(data, Mapping):
        raise InvalidConfigError(f"{path or 'config'}: expected a mapping, got {value_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise InvalidConfigError(f"{where}: unknown key (known: {', '.join(names)})")
    kwargs = {}
    for name in names:
        if name in data:
            where = f"{path}.{name}" if path else name
            kwargs[name] = _convert(hints[name], data[name], where)
    try:
        return cls(**kwargs)
    except InvalidConfigError as e:
        message = str(e)
        if path and not message.startswith(path):
            message = f"{path}.{message}" if _names_a_field(message, names) else f"{path}: {e}"
        raise InvalidConfigError(message) from None


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except InvalidConfigError as e:
                errors.append(e)
        raise errors[0]
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, {} if value is None else value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise InvalidConfigError(f"{path}: expected true or false, got {value_kind(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidConfigError(f"{path}: expected an integer, got {value_kind(value)}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidConfigError(f"{path}: expected a number, got {value_kind(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise InvalidConfigError(f"{path}: expected a string, got {value_kind(value)}")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            raise InvalidConfigError(f"{path}: expected a list, got {value_kind(value)}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, Mapping):
            raise InvalidConfigError(f"{path}: expected a mapping, got {value_kind(value)}")
        return dict(value)
    raise InvalidConfigError(f"{path}: unsupported config type {hint!r}")  # pragma: no cover


def _names_a_field(message: str, names: Sequence[str]) -> bool:
    """Whether a dataclass's own error starts with one of its field names."""
    return any(message.startswith(f"{n} ") or message.startswith(f"{n}:") for n in names)


def value_kind(value: Any) -> str:
    """A value as an error message shows it: its repr and its type."""
    return f"{value!r} ({type(value).__name__})"
