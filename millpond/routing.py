"""Writer routing: which shard a writer is pinned to, the same answer in every process.

A writer's segments all go to one shard so that an episode's segments stay together; the
shard is ``writer_hash(writer_id) % num_shards``. The hash also seeds a writer's episode
ids and the table's per-writer sequence bookkeeping, so client and shard must agree on it.
"""

from __future__ import annotations

import hashlib

__all__ = ["shard_of", "writer_hash"]


def writer_hash(writer_id: str) -> int:
    """A stable, positive 63-bit hash of a writer id (blake2b; the same in every process)."""
    digest = hashlib.blake2b(writer_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


def shard_of(writer_id: str, num_shards: int) -> int:
    """The index of the shard a writer called ``writer_id`` is pinned to."""
    return writer_hash(writer_id) % num_shards
