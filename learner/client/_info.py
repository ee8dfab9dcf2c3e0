"""Info aggregation: the shards' Info answers combined into what ``ReplayClient.info`` returns.

Each shard answers for itself; :func:`combine_info` turns the answers (or each shard's
error) into one entry per shard and, per table, totals summed over the shards that answered
(:func:`table_totals`). Which errors only mark a shard as giving nothing, and which are
raised, is decided here too, so the client's ``info`` is just the fan-out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from millpond.errors import MillpondError, TableNotFoundError
from millpond.learner.client._errors import ShardUnavailableError
from millpond.learner.client._shards import ShardHandle
from millpond.protos import millpond_pb2 as pb
from millpond.protos.tables import info_from_proto


def combine_info(
    table: str | None,
    shards: Sequence[ShardHandle],
    results: Sequence[pb.InfoResponse | MillpondError],
    learn: Callable[[ShardHandle, dict[str, Any]], None],
) -> dict[str, Any]:
    """The shards' Info answers (one per shard, in order) as ``ReplayClient.info`` returns them.

    ``learn(shard, table_info)`` is called with every table a shard reported. Raises a
    shard's error unless it is about reachability or a missing table, and the first
    error if no shard answered (with ``table``: if none holds it).
    """
    entries: list[dict[str, Any]] = []
    per_table: dict[str, list[dict[str, Any]]] = {}
    errors: list[MillpondError] = []
    weights_version: int | None = None
    # The weights rendezvous: the lowest-numbered shard not lost for good.
    rendezvous = next((s.index for s in shards if not s.gone), None)
    for shard, result in zip(shards, results, strict=True):
        base = {"shard": shard.index, "address": shard.address, "error": None}
        if isinstance(result, MillpondError):
            if not isinstance(result, ShardUnavailableError | TableNotFoundError) and (
                not shard.down
            ):
                raise result
            errors.append(result)
            entries.append({**base, "available": not shard.down, "error": str(result)})
            continue
        version = int(result.weights_version)
        if shard.index == rendezvous:
            weights_version = version
        names = []
        for msg in result.tables:
            t = info_from_proto(msg)
            learn(shard, t)
            names.append(t["name"])
            row = {**base, "available": True, "weights_version": version, **t}
            per_table.setdefault(t["name"], []).append(row)
            if table is not None:
                entries.append(row)
        if table is None:
            entries.append(
                {
                    **base,
                    "available": True,
                    "weights_version": version,
                    "tables": names,
                    "refused_tables": dict(result.refused_tables),
                }
            )
    if table is not None:
        if table not in per_table:
            raise errors[0] if errors else TableNotFoundError(f"no table {table!r}")
        return table_totals(table, entries, weights_version)
    if len(errors) == len(shards):
        raise errors[0]
    return {
        "tables": {
            name: table_totals(name, rows, weights_version) for name, rows in per_table.items()
        },
        "shards": entries,
        "weights_version": weights_version,
    }


def table_totals(
    table: str, entries: list[dict[str, Any]], weights_version: int | None
) -> dict[str, Any]:
    """One table's info: its numbers summed over the ``entries`` that answered, its config
    (one with a spec when any shard knows it), and the per-shard ``entries`` themselves."""
    rows = [e for e in entries if e.get("available") and e.get("error") is None]
    config = next((r["config"] for r in rows if r["config"].spec is not None), None)
    if config is None and rows:
        config = rows[0]["config"]
    return {
        "table": table,
        "config": config,
        "size": sum(r["size"] for r in rows),
        "mass": sum(r["mass"] for r in rows),
        "inserts": sum(r["inserts"] for r in rows),
        "samples": sum(r["samples"] for r in rows),
        "bytes_on_disk": sum(r["bytes_on_disk"] for r in rows),
        "dropped_segments": sum(r["dropped_segments"] for r in rows),
        "weights_version": weights_version,
        "shards": entries,
    }
