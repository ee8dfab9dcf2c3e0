"""Episode ids that are unique across actors, restarts and relabelled copies.

The loop numbers episodes ``episode_id_base + counter``, the counter running from 0 in each
:class:`~millpond.actors.Collector`. Give each actor incarnation its own base with
:func:`episode_id_base`:

```
 bit 63..62   61            60 ........ 44   43 ...... 32   31 ........... 0
 0            hindsight     actor index     incarnation    episode counter
```

- the actor index (< :data:`MAX_ACTORS` = 2**17) tells actors apart: a resumed
  ``millpond launch`` job numbers its new actors after those of the runs before it, so
  their ids never repeat one already stored;
- the incarnation (< :data:`INCARNATIONS_PER_ACTOR` = 4096; e.g. the Ray restart count) gives
  a restarted actor fresh ids, so it never continues or overwrites an episode of its
  previous life;
- the counter allows :data:`EPISODES_PER_INCARNATION` = 2**32 episodes per incarnation;
- bit 61 marks relabelled copies (:data:`HINDSIGHT_EPISODE_OFFSET`, added by
  :class:`~millpond.actors.HindsightRelabeler`);
- ids stay below 2**62, where the random ids of anonymous TED inserts start
  (:data:`millpond.ted.FRESH_EPISODE_ID_BASE`).

``("collector", "traj_ids")`` of the loop's batches are these episode ids.
"""

from __future__ import annotations

from millpond.errors import InvalidConfigError

__all__ = [
    "EPISODES_PER_INCARNATION",
    "HINDSIGHT_EPISODE_OFFSET",
    "INCARNATIONS_PER_ACTOR",
    "MAX_ACTORS",
    "episode_id_base",
]

EPISODES_PER_INCARNATION = 1 << 32
INCARNATIONS_PER_ACTOR = 1 << 12
MAX_ACTORS = 1 << 17
#: A relabelled copy of episode ``e`` is stored as episode ``e + HINDSIGHT_EPISODE_OFFSET``.
HINDSIGHT_EPISODE_OFFSET = 1 << 61


def episode_id_base(actor_index: int, incarnation: int = 0) -> int:
    """The first episode id of an actor's incarnation: ``actor_index * 2**44 + incarnation * 2**32``."""
    for name, value, limit in (
        ("actor_index", actor_index, MAX_ACTORS),
        ("incarnation", incarnation, INCARNATIONS_PER_ACTOR),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise InvalidConfigError(f"{name} ({value!r}) must be an integer in [0, {limit})")
    return (actor_index << 44) | (incarnation << 32)
