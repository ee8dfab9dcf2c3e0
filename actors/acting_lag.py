"""Acting lag: how far the weights an env actor acts with trail the newest published ones.

An actor checks the weights rendezvous for a newer version at the start of every chunk,
every ``weight_sync_every`` env steps within it, and once more when the chunk's last step is
acted (before the chunk is written, which may wait on the table's rate limiter). Each check
learns the newest published version ``V``; the steps acted since the previous check were
acted by the version ``v`` loaded then, and ``V - v`` counts for each of them: the versions
the learner had published after ``v`` when the interval's acting ended. That is the exact
lag of the interval's last step (unless a version came out during its env step, between the
act and the check) and an upper bound for the earlier ones, which may have been acted before
some of those versions came out. It counts once per real step (frame) acted in the interval;
a check with no step since the previous one (the one opening a chunk) counts nothing, so the
time an actor waits to write is no acting lag.

This is the lag that matters for an off-policy learner: a uniformly sampled step of a
replay ring is on average half a ring old (its *sample age*, the learner's
``sample_age_*`` metrics), whatever the actors' lag when they acted it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ActingLag"]


class ActingLag:
    """Frame-weighted acting lag in versions, since the last :meth:`drain`.

    Attributes:
        frames: real steps counted.
        total: the sum over those steps of their lag (versions).
        max: the largest lag of a counted step (``0`` when none).
    """

    def __init__(self) -> None:
        self.frames = 0
        self.total = 0
        self.max = 0

    def add(self, frames: int, acting: int, newest: int) -> None:
        """``frames`` real steps acted by version ``acting`` while the learner had published
        up to ``newest``."""
        if frames <= 0:
            return
        lag = max(0, newest - acting)  # a newer own version: a rendezvous that lost some
        self.frames += frames
        self.total += frames * lag
        self.max = max(self.max, lag)

    def drain(self) -> dict[str, Any]:
        """``frames``, ``total`` and ``max`` since the last call, counting anew."""
        out = {"frames": self.frames, "total": self.total, "max": self.max}
        self.frames = self.total = self.max = 0
        return out
