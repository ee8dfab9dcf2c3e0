"""Reverb's rate limiter: a minimum size to sample and a samples-per-insert ratio.

Counts are in steps: inserting a segment of L steps counts L inserts (after experience
processing, i.e. what was really stored), sampling a batch of B steps counts B samples.
With a ratio ``spi`` and an error buffer ``e``, let ``diff = inserts * spi - samples`` and

    min_diff = spi * min_size - e,     max_diff = spi * min_size + e.

An insert may proceed while ``diff <= max_diff`` (learners have kept up), a sample while
``diff >= min_diff`` and the table holds at least ``min_size`` steps. An insert into a table
holding fewer than ``min_size`` steps always proceeds, as in Reverb (whose limiter counts
deletions too): no sample can, so only an insert can move either side. That covers the first
fill, and also a table that once held ``min_size`` steps and holds fewer now (evictions that
free more than an insert adds, e.g. writer regions set aside, or a queue), where blocking
the insert would stop both sides for good. Each check is made *before* the operation, so
one operation may overshoot the bound by its own size; that is what keeps a segment or
batch larger than the error buffer from deadlocking the two sides.
"""

from __future__ import annotations

import math

import numpy as np

from millpond.errors import InvalidConfigError

_INSERTS, _SAMPLES = 0, 1


class RateLimiter:
    """Decides whether an insert or a sample may proceed; holds the insert and sample counts.

    Args:
        min_size: steps the table must hold before any sample.
        samples_per_insert: the target ratio, or ``None`` to limit by ``min_size`` only.
        error_buffer: allowed drift in samples (required with a ratio).
        counters: optional int64 array of 2 (inserts, samples) to keep the counts in, e.g. a
            memory-mapped file so that they survive restarts.
    """

    def __init__(
        self,
        min_size: int = 1,
        samples_per_insert: float | None = None,
        error_buffer: float | None = None,
        counters: np.ndarray | None = None,
    ) -> None:
        if min_size < 0:
            raise InvalidConfigError(f"min_size ({min_size}) must be >= 0")
        if samples_per_insert is not None:
            if samples_per_insert <= 0:
                raise InvalidConfigError(
                    f"samples_per_insert ({samples_per_insert}) must be positive"
                )
            if error_buffer is None or error_buffer < 0:
                raise InvalidConfigError(
                    f"error_buffer ({error_buffer}) must be >= 0 with samples_per_insert"
                )
        self.min_size = min_size
        self.samples_per_insert = samples_per_insert
        self.error_buffer = error_buffer
        self._counters = counters if counters is not None else np.zeros(2, dtype=np.int64)
        if samples_per_insert is not None:
            assert error_buffer is not None
            self.min_diff = samples_per_insert * min_size - error_buffer
            self.max_diff = samples_per_insert * min_size + error_buffer
        else:
            self.min_diff = float("-inf")
            self.max_diff = float("inf")

    @property
    def inserts(self) -> int:
        return int(self._counters[_INSERTS])

    @property
    def samples(self) -> int:
        return int(self._counters[_SAMPLES])

    @property
    def diff(self) -> float:
        """``inserts * samples_per_insert - samples`` (0 without a ratio)."""
        if self.samples_per_insert is None:
            return 0.0
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, size: int) -> bool:
        """Whether an insert may proceed when the table holds ``size`` steps."""
        if self.samples_per_insert is None or size < max(1, self.min_size):
            return True
        return self.diff <= self.max_diff

    def can_sample(self, size: int) -> bool:
        """Whether a sample may proceed when the table holds ``size`` steps."""
        if size < max(1, self.min_size):
            return False
        return self.diff >= self.min_diff

    def why_sample_waits(self, size: int) -> str | None:
        """What a sample waits for when the table holds ``size`` steps (``None``: nothing),
        in the words an operator needs: how many more steps, and why."""
        need = max(1, self.min_size)
        if size < need:
            return f"{need - size:,} more steps needed before sampling (min_size {self.min_size})"
        if self.diff < self.min_diff:
            assert self.samples_per_insert is not None
            more = math.ceil((self.min_diff - self.diff) / self.samples_per_insert)
            return (
                f"{more:,} more inserted steps needed at samples_per_insert "
                f"{self.samples_per_insert:g}"
            )
        return None

    def why_insert_waits(self, size: int) -> str | None:
        """What an insert waits for when the table holds ``size`` steps (``None``: nothing):
        how many more sampled steps."""
        if self.can_insert(size):
            return None
        more = math.ceil(self.diff - self.max_diff)
        return (
            f"{more:,} more sampled steps needed at samples_per_insert {self.samples_per_insert:g}"
        )

    def on_insert(self, n: int) -> None:
        self._counters[_INSERTS] += n

    def on_sample(self, n: int) -> None:
        self._counters[_SAMPLES] += n

    def on_give_back(self, n: int) -> None:
        """Stop counting ``n`` sampled steps that never reached a learner."""
        self._counters[_SAMPLES] -= n

    def describe(self) -> str:
        """The counts and, with a ratio, the bounds: for messages of calls that waited too long."""
        if self.samples_per_insert is None:
            return f"inserts {self.inserts}, samples {self.samples}"
        return (
            f"inserts {self.inserts}, samples {self.samples}, samples_per_insert "
            f"{self.samples_per_insert}, diff {self.diff:g} in [{self.min_diff:g}, {self.max_diff:g}]"
        )

    def state(self) -> dict[str, float | int | None]:
        """The counts and bounds, as reported by ``Table.info()``."""
        return {
            "inserts": self.inserts,
            "samples": self.samples,
            "min_size": self.min_size,
            "samples_per_insert": self.samples_per_insert,
            "error_buffer": self.error_buffer,
            "diff": self.diff,
            "min_diff": self.min_diff if self.samples_per_insert is not None else None,
            "max_diff": self.max_diff if self.samples_per_insert is not None else None,
        }
