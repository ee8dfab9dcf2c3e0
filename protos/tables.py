"""Table configs and table info between :mod:`millpond.config` and the protos."""

from __future__ import annotations

from typing import Any

from millpond.config import TableConfig
from millpond.errors import InvalidConfigError
from millpond.protos import millpond_pb2 as pb
from millpond.spec import FieldSpec, TableSpec, check_key, dtype_name, parse_dtype


def config_to_proto(config: TableConfig) -> pb.TableConfig:
    msg = pb.TableConfig(
        name=config.name,
        capacity=config.capacity,
        sampler=config.sampler,
        min_size=config.min_size,
        alpha=config.alpha,
        beta=config.beta,
        slice_len=config.slice_len or 0,
        compression=config.compression or "",
    )
    if config.samples_per_insert is not None:
        msg.samples_per_insert = float(config.samples_per_insert)
    if config.error_buffer is not None:
        msg.error_buffer = float(config.error_buffer)
    if config.seed is not None:
        msg.seed = config.seed
    if not config.strict_length:
        msg.strict_length = False
    msg.verify_reads = config.verify_reads
    msg.frame_stacks.extend(
        pb.FrameStack(key=list(k), frames=n) for k, n in config.frame_stacks.items()
    )
    if config.spec is not None:
        msg.spec.extend(
            pb.FieldSpec(key=list(k), dtype=dtype_name(f.dtype), shape=list(f.shape), role=f.role)
            for k, f in config.spec.fields.items()
        )
    return msg


def config_from_proto(msg: pb.TableConfig) -> TableConfig:
    """The :class:`TableConfig` of a proto; raises :class:`InvalidConfigError` if it is invalid."""
    spec = None
    if msg.spec:
        try:
            spec = TableSpec(
                {
                    check_key(tuple(f.key)): FieldSpec(
                        parse_dtype(f.dtype), tuple(f.shape), f.role or "step"
                    )
                    for f in msg.spec
                }
            )
        except ValueError as e:  # InvalidDataError from check_key is a ValueError too
            raise InvalidConfigError(f"bad table spec: {e}") from None
    return TableConfig(
        name=msg.name,
        capacity=int(msg.capacity),
        sampler=msg.sampler or "uniform",
        min_size=int(msg.min_size),
        samples_per_insert=msg.samples_per_insert if msg.HasField("samples_per_insert") else None,
        error_buffer=msg.error_buffer if msg.HasField("error_buffer") else None,
        alpha=msg.alpha,
        beta=msg.beta,
        slice_len=int(msg.slice_len) or None,
        compression=msg.compression or None,
        spec=spec,
        seed=int(msg.seed) if msg.HasField("seed") else None,
        strict_length=msg.strict_length if msg.HasField("strict_length") else True,
        verify_reads=msg.verify_reads,
        frame_stacks={tuple(s.key): int(s.frames) for s in msg.frame_stacks},
    )


def info_to_proto(info: dict[str, Any], config: TableConfig) -> pb.TableInfo:
    """A ``Table.info()`` dict as a :class:`pb.TableInfo`."""
    limiter = info["rate_limiter"]
    msg = pb.TableInfo(
        config=config_to_proto(config),
        size=info["size"],
        mass=info["mass"],
        inserts=info["inserts"],
        samples=info["samples"],
        rate_limiter_diff=limiter["diff"],
        bytes_on_disk=info["bytes_on_disk"],
        next_generation=info["next_generation"],
        dropped_segments=info["dropped_segments"],
        blocked_inserts=info["blocked_inserts"],
        blocked_samples=info["blocked_samples"],
    )
    if limiter["min_diff"] is not None:
        msg.rate_limiter_min_diff = limiter["min_diff"]
        msg.rate_limiter_max_diff = limiter["max_diff"]
    return msg


def info_from_proto(msg: pb.TableInfo) -> dict[str, Any]:
    """A :class:`pb.TableInfo` as a plain dict (what ``ReplayClient.info`` reports per shard)."""
    config = config_from_proto(msg.config)
    return {
        "name": config.name,
        "sampler": config.sampler,
        "capacity": config.capacity,
        "config": config,
        "size": msg.size,
        "mass": msg.mass,
        "inserts": msg.inserts,
        "samples": msg.samples,
        "rate_limiter": {
            "diff": msg.rate_limiter_diff,
            "min_diff": msg.rate_limiter_min_diff
            if msg.HasField("rate_limiter_min_diff")
            else None,
            "max_diff": msg.rate_limiter_max_diff
            if msg.HasField("rate_limiter_max_diff")
            else None,
            "samples_per_insert": config.samples_per_insert,
        },
        "bytes_on_disk": msg.bytes_on_disk,
        "next_generation": msg.next_generation,
        "dropped_segments": msg.dropped_segments,
        # Where a learner on the shard's host may read the rows (empty: nowhere).
        "host_id": msg.host_id,
        "storage_dir": msg.storage_dir,
        "storage_token": msg.storage_token,
        # Who waits now: calls the table holds back, and the Insert streams open to it.
        "blocked_inserts": msg.blocked_inserts,
        "blocked_samples": msg.blocked_samples,
        "writers": msg.writers,
    }
