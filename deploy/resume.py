"""``millpond launch --resume``: where a job that stopped in its run directory goes on.

:func:`read_resume_state` reads the run's ``summary.json`` (its frames, episodes, learner
steps and wall time, the index its next env actor takes) and its learner ``checkpoint.pt``
into a :class:`Resumed`, or says what is missing; :meth:`Resumed.go_on_version` squares the
checkpoint's weight version with the one the replay service holds.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from millpond.errors import InvalidConfigError

if TYPE_CHECKING:
    from millpond.deploy.launch_config import LaunchConfig
    from millpond.learner.client import ReplayClient

__all__ = ["Resumed", "read_resume_state"]


@dataclass(frozen=True)
class Resumed:
    """Where a resumed job starts: the counters of the run's ``summary.json`` and its
    learner checkpoint."""

    frames: int
    episodes: int
    learner_steps: int
    stale_steps: int
    wall_s: float
    next_actor_index: int
    checkpoint: bytes
    checkpoint_version: int
    resumes: list[dict[str, Any]]

    def history(self) -> list[dict[str, Any]]:
        """``summary.json``'s ``resumes``: the earlier resumes, and this one (the counters
        the job went on from)."""
        return [
            *self.resumes,
            {
                "frames": self.frames,
                "episodes": self.episodes,
                "weights_version": self.checkpoint_version,
                "learner_steps": self.learner_steps,
            },
        ]

    def go_on_version(
        self, client: ReplayClient, table: str, config: LaunchConfig, say: Callable[[str], None]
    ) -> int:
        """The weight version a resumed learner goes on from: its checkpoint's.

        A job stopped cleanly wrote its checkpoint after its last publication, so the
        service holds the same version. If the service holds a newer one (the learner was
        lost after the last periodic checkpoint), the steps acted by those newer policies
        may be stored: a queue table (on-policy) is emptied, since its steps would be newer
        than the restored policy, and the numbering goes on after the service's version,
        which a publication must pass."""
        held = client.info(table).get("weights_version")
        held = -1 if held is None else int(held)
        if held <= self.checkpoint_version:
            return self.checkpoint_version
        if config.replay.table_config().sampler == "queue":
            client.reset(table)
            dropped = "; its queue table is emptied (on-policy steps newer than the checkpoint)"
        else:
            dropped = "; its off-policy table is kept"
        say(
            f"resume: the service holds weights version {held}, newer than checkpoint.pt's "
            f"{self.checkpoint_version}{dropped}; versions go on from {held}"
        )
        return held


def read_resume_state(run_dir: Path, config: LaunchConfig) -> Resumed:
    """The state a job left in ``run_dir``, or an error naming what is missing."""
    # torch, and the config module that imports it: `millpond launch` imports this module
    # before Ray starts, and imports them while it does (see millpond.deploy.ray_start).
    import torch

    from millpond.deploy.launch_config import load_config

    summary_path, checkpoint_path = run_dir / "summary.json", run_dir / "checkpoint.pt"
    for path, what in ((summary_path, "its counters"), (checkpoint_path, "its learner")):
        if not path.is_file():
            raise InvalidConfigError(
                f"--resume {run_dir}: no {path.name} there, so {what} cannot be restored (the "
                "job did not stop cleanly, or this is not a millpond launch run directory)"
            )
    try:
        summary = json.loads(summary_path.read_text())
        data = checkpoint_path.read_bytes()
        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        version = int(checkpoint["version"])
        algorithm = checkpoint["algorithm"]
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise InvalidConfigError(
            f"--resume {run_dir}: summary.json or checkpoint.pt cannot be read ({e})"
        ) from None
    if algorithm != config.learner.algorithm:
        raise InvalidConfigError(
            f"--resume {run_dir}: checkpoint.pt holds a {algorithm} learner, the config "
            f"trains {config.learner.algorithm}"
        )
    recorded = load_config(run_dir / "config.yaml")
    return Resumed(
        frames=int(summary.get("frames") or 0),
        episodes=int(summary.get("episodes") or 0),
        learner_steps=int(summary.get("learner_steps") or 0),
        stale_steps=int(summary.get("stale_steps") or 0),
        wall_s=float(summary.get("wall_s") or 0.0),
        # Runs written before the field existed numbered their actors from 0.
        next_actor_index=int(summary.get("next_actor_index", recorded.actors.num_actors)),
        checkpoint=data,
        checkpoint_version=version,
        resumes=list(summary.get("resumes") or []),
    )
