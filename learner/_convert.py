"""Table configs, specs and table info between :mod:`millpond.service` and the protos.

The one place where a :class:`~millpond.service.config.TableConfig` becomes a
``pb.TableConfig`` and back; the servicer uses the same functions. Proto3 defaults stand
for "unset": an empty spec list is ``None``, ``slice_len`` 0 is ``None``, compression ``""``
is ``None``; ``samples_per_insert``, ``error_buffer`` and ``seed`` are proto ``optional``
fields, read with ``HasField``.
"""

from __future__ import annotations

from typing import Any

from millpond.errors import InvalidConfigError
from millpond.protos import millpond_pb2 as pb
from millpond.service.config import TableConfig
from millpond.service.spec import STEP, FieldSpec, TableSpec, dtype_name, parse_dtype


def spec_to_proto(spec: TableSpec | None) -> list[pb.FieldSpec]:
    """The fields of ``spec`` (``[]`` for ``None``), in the spec's key order."""
    if spec is None:
        return []
    return [
        pb.FieldSpec(key=list(key), dtype=dtype_name(f.dtype), shape=list(f.shape), role=f.role)
        for key, f in spec.fields.items()
    ]


def spec_from_proto(fields: Any) -> TableSpec | None:
    """A :class:`TableSpec` from repeated ``pb.FieldSpec`` (``None`` when there are none).

    Raises :class:`InvalidConfigError` for unknown dtypes or roles, bad keys, duplicate keys
    or negative dimensions.
    """
    if not len(fields):
        return None
    out: dict[tuple[str, ...], FieldSpec] = {}
    for f in fields:
        key = tuple(f.key)
        if key in out:
            raise InvalidConfigError(f"spec: key {key!r} appears twice")
        shape = tuple(int(s) for s in f.shape)
        if any(s < 0 for s in shape):
            raise InvalidConfigError(f"spec: key {key!r} has a negative dimension in {list(shape)}")
        out[key] = FieldSpec(parse_dtype(f.dtype), shape, f.role or STEP)
    try:
        return TableSpec(out)
    except InvalidConfigError:
        raise
    except Exception as e:  # a bad key raises InvalidDataError: here it is a config error
        raise InvalidConfigError(f"spec: {e}") from e


def config_to_proto(config: TableConfig) -> pb.TableConfig:
    """``config`` as a ``pb.TableConfig`` (its spec included when known)."""
    msg = pb.TableConfig(
        name=config.name,
        capacity=config.capacity,
        sampler=config.sampler,
        min_size=config.min_size,
        alpha=float(config.alpha),
        beta=float(config.beta),
        slice_len=config.slice_len or 0,
        compression=config.compression or "",
        spec=spec_to_proto(config.spec),
    )
    if config.samples_per_insert is not None:
        msg.samples_per_insert = float(config.samples_per_insert)
    if config.error_buffer is not None:
        msg.error_buffer = float(config.error_buffer)
    if config.seed is not None:
        msg.seed = int(config.seed)
    return msg


def config_from_proto(msg: pb.TableConfig) -> TableConfig:
    """A validated :class:`TableConfig` from ``msg``; raises :class:`InvalidConfigError`."""
    return TableConfig(
        name=msg.name,
        capacity=int(msg.capacity),
        sampler=msg.sampler,
        min_size=int(msg.min_size),
        samples_per_insert=msg.samples_per_insert if msg.HasField("samples_per_insert") else None,
        error_buffer=msg.error_buffer if msg.HasField("error_buffer") else None,
        alpha=msg.alpha,
        beta=msg.beta,
        slice_len=int(msg.slice_len) or None,
        compression=msg.compression or None,
        spec=spec_from_proto(msg.spec),
        seed=int(msg.seed) if msg.HasField("seed") else None,
    )


def table_info_from_proto(msg: pb.TableInfo) -> dict[str, Any]:
    """One shard's ``pb.TableInfo`` as a plain dict (the config as a :class:`TableConfig`)."""
    return {
        "name": msg.config.name,
        "config": config_from_proto(msg.config),
        "size": int(msg.size),
        "mass": float(msg.mass),
        "inserts": int(msg.inserts),
        "samples": int(msg.samples),
        "rate_limiter_diff": float(msg.rate_limiter_diff),
        "rate_limiter_min_diff": (
            msg.rate_limiter_min_diff if msg.HasField("rate_limiter_min_diff") else None
        ),
        "rate_limiter_max_diff": (
            msg.rate_limiter_max_diff if msg.HasField("rate_limiter_max_diff") else None
        ),
        "bytes_on_disk": int(msg.bytes_on_disk),
        "next_generation": int(msg.next_generation),
    }


__all__ = [
    "config_from_proto",
    "config_to_proto",
    "spec_from_proto",
    "spec_to_proto",
    "table_info_from_proto",
]
