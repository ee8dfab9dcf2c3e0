"""Per-segment checksums, so that flipped bytes on disk are dropped at recovery, never served.

Each segment's checksum is one uint64 in ``data/checksums.bin``, indexed like its record in
``segments.bin`` (a separate, sparse file: a format-2 table written before checksums has
none, and gets one computed from its data as it is when it is next opened). It covers

* the segment's data: its rows in every column, in the spec's order (step and tail rows of
  observations, step rows of the other keys). A segment's rows lie back to back in each
  column file, so each column is one range of bytes of the mapped file, read in place
  (what the file holds, not what was meant for it). A short range gets its ``zlib.crc32``;
  a long one (:data:`WIDE_BYTES` or more) a sum of its 8-byte words times odd position
  weights, modulo 2**64, which numpy computes ~3.5x faster than zlib's CRC (an Atari-sized
  segment: 70 us against 240 us per MiB-sized range). Any change within one word changes
  it, and so do a moved or swapped page and most changes of several words; its blind spot
  is a pair of changes whose weighted differences cancel modulo 2**64, such as bit 63 of
  two words flipped in opposite directions (a CRC-32 has none for two flips). One CRC-32
  runs over the columns in order: over a short range's bytes, over a long range's sum;
* the prefixes of its frame-stacked keys (the older frames of its first stack, one row of
  each prefix file; none for a segment that continues its chain, see :mod:`.chains`),
  after the columns, the same way, then its row of ``chains.bin`` (a table that has one);
* its record: a sum of the eight fields times odd constants, modulo 2**64, so that a
  change of any one field changes it (vectorised over segments, cheap under the lock).

The checksum is that data CRC xor the record sum. The data CRC is computed by the writer
after its copy, outside the table's lock; the record part when the segment is published.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from pathlib import Path

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


#: Byte ranges at least this long are summed with weights rather than CRC'd (numpy's call
#: costs more than zlib's CRC for short ones).
WIDE_BYTES = 4096
_weights = np.zeros(0, dtype=np.uint64)


def _position_weights(n: int) -> np.ndarray:
    """``2 i + 1`` for ``i < n``, as uint64 (cached, grown as needed; threads may race to
    grow it, each then uses the array it made)."""
    global _weights
    weights = _weights
    if len(weights) < n:
        weights = np.arange(1, 2 * max(n, 2 * len(weights)), 2, dtype=np.uint64)
        _weights = weights
    return weights[:n]


def _wide_value(data: np.ndarray) -> bytes:
    """The word-weighted sum of a long byte range, as 8 bytes (leftover bytes xor'd in)."""
    flat = data.reshape(-1)
    n = flat.nbytes // 8
    value = int(np.dot(flat[: n * 8].view(np.uint64), _position_weights(n)))
    if flat.nbytes % 8:
        value ^= zlib.crc32(flat[n * 8 :])
    return value.to_bytes(8, "little")


def range_value(data: np.ndarray, crc: int = 0) -> int:
    """``crc`` (the value so far) continued with one contiguous byte range (uint8 array):
    its bytes if short, its word-weighted sum if long (see the module docstring)."""
    if data.nbytes < WIDE_BYTES:
        return zlib.crc32(data, crc)
    return zlib.crc32(_wide_value(data), crc)


def data_sums(
    columns: ColumnBytes,
    starts: np.ndarray,
    lengths: np.ndarray,
    prefixes: Sequence[np.ndarray] = (),
    records: np.ndarray | None = None,
    chain_rows: np.ndarray | None = None,
) -> np.ndarray:
    """The data CRC of each segment (``starts``, ``lengths``), as uint64.

    ``prefixes``: per frame-stacked key, its prefix column as ``[rows, bytes]`` uint8;
    each segment's row (``records``; 0: none, a segment that continues its chain) is
    covered after its columns' rows. ``chain_rows``: ``[n, bytes]`` uint8, each segment's
    row of ``chains.bin``, covered last.
    """
    out = np.empty(len(starts), dtype=np.uint64)
    rec = records.tolist() if records is not None else [0] * len(starts)
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        crc = 0
        for rows, extra in columns:
            block = rows[s : s + n + extra]
            if block.nbytes < WIDE_BYTES:
                crc = zlib.crc32(block, crc)
            else:
                crc = zlib.crc32(_wide_value(block), crc)
        if rec[i] > 0:
            for prefix in prefixes:
                crc = range_value(prefix[rec[i]], crc)
        if chain_rows is not None:
            crc = zlib.crc32(chain_rows[i], crc)
        out[i] = crc
    return out


def record_sums(records: np.ndarray) -> np.ndarray:
    """The record part of each checksum: ``records`` is ``[n, 8]`` int64 (generation set)."""
    return (records.view(np.uint64) * _MIX).sum(axis=1, dtype=np.uint64)


def combine(values: np.ndarray, records: np.ndarray) -> np.ndarray:
    """Checksums of segments from their data values and their ``[n, 8]`` records."""
    return values.astype(np.uint64) ^ record_sums(records)


def log_dropped(log: logging.Logger, table_dir: Path, dropped: list[tuple[int, int, int]]) -> None:
    """Warn of the segments recovery dropped: ``(episode id, first slot, length)`` each."""
    shown = ", ".join(f"episode {e} in slots {s}-{s + n}" for e, s, n in dropped[:10])
    more = f" and {len(dropped) - 10} more" if len(dropped) > 10 else ""
    log.warning(
        "table dir %s: dropped %d damaged segments, never served (a checksum, record or "
        "slot pointer that does not hold up: the files changed outside millpond, or a "
        "machine crashed without --fsync): %s%s. The rest of the table is served; to get "
        "them back, restore the table directory from a copy.",
        table_dir,
        len(dropped),
        shown,
        more,
    )
