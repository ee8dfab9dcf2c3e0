"""The layout of a table's ``counters.bin``: its file name and what each int64 entry counts.

The table's files (:mod:`.table_files`) own the file and most of its entries; the queue
sampler (:mod:`.samplers`) maps its own entry, the cursor it delivers from. Both take the
layout from here.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["COUNTERS_FILE", "N_COUNTERS", "Counter"]

COUNTERS_FILE = "counters.bin"
N_COUNTERS = 8  # room for more counters without a new format


class Counter(IntEnum):
    """The entries of ``counters.bin`` (memory-mapped, so the counts survive a killed process)."""

    INSERTS = 0  # the rate limiter's
    SAMPLES = 1  # the rate limiter's
    NEXT_GENERATION = 2
    QUEUE_CURSOR = 3  # the queue sampler's: the last delivered generation
