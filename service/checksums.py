"""Per-segment checksums, so that flipped bytes on disk are dropped at recovery, never served.

Each segment's checksum is one uint64 in ``data/checksums.bin``, indexed like its record in
``segments.bin`` (a separate, sparse file: a format-2 table written before checksums has
none, and gets one computed from its data as it is when it is next opened). It covers

* the segment's data: a CRC-32 of its rows in every column, in the spec's order (step and
  tail rows of observations, step rows of the other keys). A segment's rows lie back to
  back in each column file, so that is one ``zlib.crc32`` call per column over the mapped
  pages, with no copy, and it checks what the file holds, not what was meant for it;
* its record: a sum of the eight fields times odd constants, modulo 2**64, so that a
  change of any one field changes it (vectorised over segments, cheap under the lock).

The checksum is ``(data CRC << 32) ^ record sum``. The data CRC is computed by the writer
after its copy, outside the table's lock; the record part when the segment is published.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

CHECKSUMS_FILE = "checksums.bin"

#: Odd multipliers (one per record field): any change of one field changes the sum.
_MIX = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
        0xA0761D6478BD642F,
        0xE7037ED1A0B428DB,
    ],
    dtype=np.uint64,
)

#: Per column: its rows as bytes (``[capacity, row bytes]`` uint8, a view of the mapped
#: file) and how many rows past a segment's steps it holds (1 for observations: the tail).
ColumnBytes = Sequence[tuple[np.ndarray, int]]


def data_crcs(columns: ColumnBytes, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The data CRC of each segment (``starts``, ``lengths``), as uint64."""
    out = np.empty(len(starts), dtype=np.uint64)
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        crc = 0
        for rows, extra in columns:
            crc = zlib.crc32(rows[s : s + n + extra], crc)
        out[i] = crc
    return out


def record_sums(records: np.ndarray) -> np.ndarray:
    """The record part of each checksum: ``records`` is ``[n, 8]`` int64 (generation set)."""
    return (records.view(np.uint64) * _MIX).sum(axis=1, dtype=np.uint64)


def combine(crcs: np.ndarray, records: np.ndarray) -> np.ndarray:
    """Checksums of segments from their data CRCs and their ``[n, 8]`` records."""
    return (crcs.astype(np.uint64) << np.uint64(32)) ^ record_sums(records)
