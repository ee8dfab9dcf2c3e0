"""TED data inserted through :meth:`ReplayClient.extend`: compacted, then written by one
writer per table.

An :class:`Extender` keeps, per table, the trajectories that :func:`millpond.ted.compact_ted`
left open (so that a trajectory continued in the next call keeps counting its steps) and the
writer they go through. A writer whose stream was refused is dropped, and the next call makes
a fresh one under a new id.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from tensordict import TensorDictBase

from millpond.errors import MillpondError
from millpond.learner.client.writer import Writer
from millpond.ted import OpenEpisodes, compact_ted


class Extender:
    """What ``extend`` keeps for one table: compact_ted's open trajectories and a writer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.episodes: OpenEpisodes = {}
        self.writer: Writer | None = None
        self.generation = 0

    def forget_episodes(self) -> None:
        """Start every trajectory afresh (the table was reset)."""
        with self.lock:
            self.episodes.clear()

    def extend(
        self,
        td: TensorDictBase,
        episode_base: int,
        new_writer: Callable[[int], Writer],
        flush_timeout: Callable[[], float | None],
    ) -> int:
        """Compact ``td`` and write it; returns its steps once the shard stored them all.

        ``new_writer(generation)`` makes the writer when there is none; ``flush_timeout()``
        says how long to wait for the acknowledgements. The open trajectories change only
        when the segments are queued."""
        with self.lock:
            if self.writer is None:
                self.generation += 1
                self.writer = new_writer(self.generation)
            writer = self.writer
            saved = dict(self.episodes)
            queued = False
            try:
                packed = compact_ted(td, self.episodes, episode_base)
                writer.write_packed(packed, track_episodes=False)
                queued = True  # the segments will be stored: the episode state stands
                writer.flush(flush_timeout())
            except BaseException:
                if not queued:
                    self.episodes.clear()
                    self.episodes.update(saved)
                raise
            finally:
                if writer.error is not None:  # a refused stream: a fresh writer next time
                    self.writer = None
                    with contextlib.suppress(MillpondError):
                        writer.close(timeout_s=0)
        return packed.num_steps
