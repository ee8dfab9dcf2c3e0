"""How a policy-weights blob travels: in chunks, so no message nears the size limit.

PublishWeights (client to shard) and GetWeights (shard to client) both stream a blob as a
header (version, total size) and then chunks of at most :data:`WEIGHTS_CHUNK_BYTES`.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["WEIGHTS_CHUNK_BYTES", "chunks"]

#: Well under the smallest message limit a server or client may set (1 MiB).
WEIGHTS_CHUNK_BYTES = 256 * 1024


def chunks(blob: bytes) -> Iterator[bytes]:
    """``blob`` in consecutive pieces of at most :data:`WEIGHTS_CHUNK_BYTES` (none if empty)."""
    view = memoryview(blob)
    for start in range(0, len(blob), WEIGHTS_CHUNK_BYTES):
        yield bytes(view[start : start + WEIGHTS_CHUNK_BYTES])
