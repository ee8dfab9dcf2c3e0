"""The rows a ``millpond launch`` job records every ``run.status_every_s`` (and once at the
end): the env actors' frames and episodes, the replay table's counters and the learners'
reports, as totals and as rates since the previous row.

A row's counters count from the start of the job's loop (a resumed job's table holds the
earlier runs' inserts and samples); its ``time_s`` goes on from a resumed run's.

Two lags, not to be confused: the *acting lag* (``acting_lag``, ``acting_lag_steps``,
``acting_lag_max``), how far the weights the env actors acted with trailed the newest
published ones when they acted (:mod:`millpond.actors.acting_lag`), and the *sample age*
(``sample_age``, ``sample_age_steps``), how far the acting weights of the steps the
learners sampled are behind the learner's when they train on them: for PPO its policy lag,
for DQN mostly the age of the replayed steps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from millpond.errors import MillpondError

if TYPE_CHECKING:
    from millpond.actors.fleet import FleetStatus
    from millpond.deploy.launch_config import LaunchConfig
    from millpond.deploy.learner_group import LearnerGroup
    from millpond.learner.client import ReplayClient

__all__ = ["StatusRows"]


class StatusRows:
    """Status rows of one job, each with the rates since the one before.

    Args:
        config: the job's config (its table's capacity).
        time_offset: the seconds a resumed run had run before.
        started: when the job started (monotonic), until :meth:`begin` says otherwise.
    """

    def __init__(self, config: LaunchConfig, time_offset: float, started: float) -> None:
        self.config = config
        self.time_offset = time_offset
        self._last: dict[str, float] = {
            "t": started,
            "frames": 0,
            "inserts": 0,
            "samples": 0,
        }
        self._acting = (0, 0)  # the fleet's acting-lag frames and total at the last row
        self._base: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self._driver_down: list[int] = []  # the shards the driver's client found unreachable
        self._down_since: float | None = None  # monotonic, while a shard is unreachable
        self.unavailable_s = 0.0  # seconds of rows with a shard unreachable, over the run

    def begin(self, client: ReplayClient, table: str, started: float) -> None:
        """Count from now (``started``, monotonic): the loop starts."""
        self._last = {"t": started, "frames": 0, "inserts": 0, "samples": 0}
        self._base = self.counters(client, table)

    def counters(self, client: ReplayClient, table: str) -> dict[str, int]:
        """The table's inserts, samples, size and shard count (the last ones read while a
        shard is down)."""
        try:
            info = client.info(table)
        except MillpondError:  # a shard is down: keep the last numbers
            self._driver_down = client.unavailable_shards
            return self._seen
        self._driver_down = client.unavailable_shards
        self._seen = {
            "inserts": int(info["inserts"]),
            "samples": int(info["samples"]),
            "size": int(info["size"]),
            "shards": len(info["shards"]),
        }
        return self._seen

    def row(
        self,
        elapsed: float,
        status: FleetStatus,
        counters: dict[str, int],
        learners: LearnerGroup,
    ) -> dict[str, Any]:
        """The row ``elapsed`` seconds into the loop, from the fleet's ``status``, the
        table's ``counters`` (:meth:`counters`) and the ``learners``' reports."""
        dt = max(1e-9, time.monotonic() - self._last["t"])
        inserts = counters.get("inserts", 0) - self._base.get("inserts", 0)
        samples = counters.get("samples", 0) - self._base.get("samples", 0)
        capacity = self.config.replay.table_config().capacity * counters.get("shards", 1)
        frames = status.acting_lag_frames - self._acting[0]
        acting_lag = (status.acting_lag_total - self._acting[1]) / frames if frames else None
        self._acting = (status.acting_lag_frames, status.acting_lag_total)
        row = {
            "time_s": round(self.time_offset + elapsed, 2),
            "frames": status.frames,
            "frames_per_s": (status.frames - self._last["frames"]) / dt,
            "episodes": status.episodes,
            "mean_return": status.mean_return,
            "buffer_size": counters.get("size"),
            "buffer_fill": counters.get("size", 0) / capacity if capacity else None,
            "inserts_per_s": (inserts - self._last["inserts"]) / dt,
            "samples_per_s": (samples - self._last["samples"]) / dt,
            "samples_per_insert": samples / inserts if inserts else None,
            "acting_lag": acting_lag,
            "acting_lag_steps": self.acting_steps(acting_lag),
            "acting_lag_max": status.acting_lag_max if status.acting_lag_frames else None,
            "sample_age": learners.sample_age,
            "sample_age_steps": learners.sample_age_steps,
            "publish_wait_s": learners.take_publish_wait(),
            "stale_steps": learners.stale_steps,
            "learner_steps": learners.steps,
            "weights_version": learners.version,
            "loss": learners.loss,
            "actor_restarts": status.restarts,
            **self._unavailable(status, learners, dt),
        }
        self._last = {
            "t": time.monotonic(),
            "frames": status.frames,
            "inserts": inserts,
            "samples": samples,
        }
        return row

    def _unavailable(
        self, status: FleetStatus, learners: LearnerGroup, dt: float
    ) -> dict[str, Any]:
        """The shards unreachable now, to the driver's client, the learners' or an env
        actor's writer (as it last reported), and since when the rows say so."""
        down = set(self._driver_down) | set(learners.unavailable_shards)
        down |= {
            a["shard"]
            for a in status.actors.values()
            if a.get("writer_unavailable_s") is not None and a.get("shard") is not None
        }
        now = time.monotonic()
        if not down:
            self._down_since = None
            return {"shards_unavailable": 0, "unavailable_shards": [], "unavailable_for_s": None}
        if self._down_since is None:
            self._down_since = now  # first seen by this row
        else:
            self.unavailable_s += dt
        return {
            "shards_unavailable": len(down),
            "unavailable_shards": sorted(down),
            "unavailable_for_s": now - self._down_since,
        }

    def outages(self, actors: list[dict[str, Any]], learners: LearnerGroup) -> dict[str, Any]:
        """The summary's account of shards found unreachable (docs/service.md, "Across a
        network"): seconds of status rows that said so, the env actors' writers' outages and
        their seconds (``actors``: their final statuses, summed), the learners' seconds; and
        the segments the writers saw stored."""
        return {
            "shard_unavailable_s": round(self.unavailable_s, 2),
            "actors_shard_outages": sum(a.get("writer_outages", 0) for a in actors),
            "actors_shard_unavailable_s": round(
                sum(a.get("writer_unavailable_total_s", 0.0) for a in actors), 2
            ),
            "learner_shard_unavailable_s": round(learners.unavailable_s, 2),
            "actors_segments_acked": sum(a.get("segments_acked", 0) for a in actors),
        }

    def acting_steps(self, versions: float | None) -> float | None:
        """An acting lag in versions as gradient steps: a DQN learner publishes every
        ``publish_every`` steps, so versions apart are that many steps apart, exactly. PPO's
        iterations take as many steps as their batches need: ``None``."""
        learner = self.config.learner
        if versions is None or learner.algorithm != "dqn":
            return None
        return versions * learner.dqn.publish_every
