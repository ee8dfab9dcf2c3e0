"""ActorFleet: start N env actors on Ray, drive them, report their status, stop them.

The fleet keeps one ``run`` call in flight per actor and collects the reports as they come
back, so status needs no extra round trips and a slow actor never stalls the others. An
actor that dies is restarted by Ray (``max_restarts``); its call in flight fails, and the
fleet simply submits the next one to the restarted actor. While Ray restarts it, every call
submitted fails at once: the fleet counts the death once (not once per failed call) and
resubmits only every :data:`RETRY_DEAD_S` seconds until the new incarnation reports.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from millpond.actors.ray_actor import ActorConfig, EnvActor
from millpond.actors.remote_errors import from_remote
from millpond.errors import InvalidConfigError, MillpondError
from millpond.learner.client import ReplayClient

log = logging.getLogger("millpond.fleet")

#: How long the fleet waits before submitting again to an actor whose call failed because
#: it died: Ray restarts it meanwhile, and calls submitted sooner only fail again.
RETRY_DEAD_S = 0.5


@dataclass
class FleetStatus:
    """What the fleet has collected so far (all incarnations of all actors).

    Attributes:
        frames: real env steps collected (counting on from the fleet's ``frames``).
        episodes: episodes finished (counting on from the fleet's ``episodes``).
        mean_return: mean return of the last ``window`` finished episodes, or ``None``.
        frames_per_s: frames per wall-clock second since the fleet started.
        restarts: actor restarts seen.
        acting_lag_frames: frames whose acting lag was counted
            (:mod:`millpond.actors.acting_lag`).
        acting_lag_total: the sum of their acting lags, in versions.
        acting_lag_max: the largest acting lag of a frame so far, in versions.
        actors: the latest report of each actor (see :meth:`EnvActor.status`); after
            :meth:`ActorFleet.stop`, its status once closed.
    """

    frames: int = 0
    episodes: int = 0
    mean_return: float | None = None
    frames_per_s: float = 0.0
    restarts: int = 0
    acting_lag_frames: int = 0
    acting_lag_total: int = 0
    acting_lag_max: int = 0
    actors: dict[int, dict[str, Any]] = field(default_factory=dict)

    def line(self) -> str:
        ret = "-" if self.mean_return is None else f"{self.mean_return:.1f}"
        return (
            f"frames {self.frames:,}  fps {self.frames_per_s:,.0f}  episodes {self.episodes:,}  "
            f"mean return {ret}  actors {len(self.actors)}  restarts {self.restarts}"
        )


class ActorFleet:
    """N Ray env actors writing to one replay service.

    Args:
        client: the replay service the actors write to and take weights from.
        config: what each actor runs.
        num_actors: how many actors.
        num_cpus: CPUs each actor reserves.
        resources: extra Ray resources each actor reserves (e.g. ``{"env_node": 1}``).
        label_selector: Ray node labels an actor's node must have.
        max_restarts: how often Ray restarts a dead actor.
        chunks_per_call: chunks each ``run`` call collects before reporting.
        seconds_per_call: and more chunks, until a call has run this long: each call
            costs the actor and the driver Ray's round trip, which at one chunk a call
            (tens of milliseconds on CartPole) is a share of the actor's core.
        window: finished episodes averaged in ``mean_return``.
        first_index: the actor index of the first actor (the others follow): an actor's
            index is part of its episode ids, writer id and seed, so a fleet that continues
            a job's earlier fleet (``millpond launch --resume``) numbers its actors after
            that fleet's, and no episode id of theirs can repeat one already stored.
        frames: frames the job collected before this fleet (its status counts on from them).
        episodes: episodes the job finished before this fleet.
    """

    def __init__(
        self,
        client: ReplayClient,
        config: ActorConfig,
        num_actors: int = 2,
        *,
        num_cpus: float = 1.0,
        resources: dict[str, float] | None = None,
        label_selector: dict[str, str] | None = None,
        max_restarts: int = 3,
        chunks_per_call: int = 1,
        seconds_per_call: float = 0.0,
        window: int = 100,
        first_index: int = 0,
        frames: int = 0,
        episodes: int = 0,
    ) -> None:
        if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
            raise InvalidConfigError(f"num_actors ({num_actors!r}) must be a positive integer")
        if chunks_per_call < 1:
            raise InvalidConfigError(f"chunks_per_call ({chunks_per_call}) must be >= 1")
        if not seconds_per_call >= 0:
            raise InvalidConfigError(f"seconds_per_call ({seconds_per_call}) must be >= 0")
        for name, value in (
            ("first_index", first_index),
            ("frames", frames),
            ("episodes", episodes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(f"{name} ({value!r}) must be an integer >= 0")
        if not ray.is_initialized():
            raise MillpondError("ray.init() first (or use millpond launch, which does)")
        self.client = client
        self.config = config
        self.chunks_per_call = chunks_per_call
        self.seconds_per_call = seconds_per_call
        remote = ray.remote(EnvActor).options(
            num_cpus=num_cpus,
            resources=resources or {},
            max_restarts=max_restarts,
            max_task_retries=0,  # a failed run is resubmitted by the fleet, not replayed
            **({"label_selector": label_selector} if label_selector else {}),
        )
        self.first_index = first_index
        self.actors = [remote.remote(first_index + i, client, config) for i in range(num_actors)]
        self._inflight: dict[Any, int] = {}
        self._incarnations: dict[int, int] = {}
        # Actors whose death was seen as a failed call and counted, until a report shows the
        # new incarnation; and when each may be given a call again.
        self._died: set[int] = set()
        self._retry_at: dict[int, float] = {}
        self._status = FleetStatus(frames=frames, episodes=episodes)
        self._frames_before = frames
        self._recent: deque[float] = deque(maxlen=window)
        self._started = time.monotonic()
        self._stopped = False

    def _submit(self, index: int) -> None:
        ref = self.actors[index].run.remote(self.chunks_per_call, self.seconds_per_call)
        self._inflight[ref] = index

    def poll(self, timeout_s: float = 1.0) -> FleetStatus:
        """Wait up to ``timeout_s`` for reports, keep every actor busy, return the status."""
        if self._stopped:
            return self._status
        busy = set(self._inflight.values())
        now = time.monotonic()
        for i in range(len(self.actors)):
            if i not in busy and self._retry_at.get(i, 0.0) <= now:
                self._submit(i)
        if not self._inflight:  # every actor is being restarted: wait for the first one
            time.sleep(max(0.0, min(timeout_s, min(self._retry_at.values()) - now)))
            return self._status
        ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=timeout_s)
        more, _ = ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=0)
        for ref in set(ready) | set(more):
            index = self._inflight.pop(ref)
            try:
                report = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._retry_at[index] = time.monotonic() + RETRY_DEAD_S
                if index not in self._died:  # later failures are of the same death
                    self._status.restarts += 1
                    self._died.add(index)
                    log.warning("env actor %d died (%s); Ray restarts it", index, type(e).__name__)
                continue
            except ray.exceptions.RayTaskError as e:
                raise from_remote(e, f"env actor {index}") from e
            self._account(index, report)
        self._status.frames_per_s = (self._status.frames - self._frames_before) / max(
            1e-9, time.monotonic() - self._started
        )
        return self._status

    def _account(self, index: int, report: dict[str, Any]) -> None:
        s = self._status
        # A kill between two calls fails no call: the restart shows only as a new incarnation.
        incarnation = report.get("incarnation")
        previous = self._incarnations.get(index, 0)  # a first start is incarnation 0
        self._retry_at.pop(index, None)
        if incarnation is not None and incarnation != previous:
            self._incarnations[index] = incarnation
            if index in self._died:
                self._died.discard(index)
            else:
                s.restarts += 1
        s.frames += report.pop("new_frames")
        lag = report.pop("acting_lag", None)
        if lag is not None:
            s.acting_lag_frames += lag["frames"]
            s.acting_lag_total += lag["total"]
            s.acting_lag_max = max(s.acting_lag_max, lag["max"])
        finished = report.pop("finished_episodes")
        s.episodes += len(finished)
        self._recent.extend(r for r, _ in finished)
        s.mean_return = sum(self._recent) / len(self._recent) if self._recent else None
        s.actors[index] = report

    def run(
        self,
        frames: int,
        on_status: Callable[[FleetStatus], None] | None = None,
        timeout_s: float | None = None,
    ) -> FleetStatus:
        """Collect until ``frames`` frames (or ``timeout_s`` seconds); returns the status."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._status.frames < frames:
            if deadline is not None and time.monotonic() > deadline:
                break
            status = self.poll(timeout_s=1.0)
            if on_status is not None:
                on_status(status)
        return self._status

    @property
    def status(self) -> FleetStatus:
        return self._status

    def stop(self, timeout_s: float = 30.0) -> FleetStatus:
        """Let calls in flight finish, flush and close every actor, then kill them.

        ``timeout_s`` bounds each of the two waits; segments still unacknowledged after it
        (e.g. held back by a rate limiter once nothing samples) are dropped.
        """
        if self._stopped:
            return self._status
        self._stopped = True
        if self._inflight:
            done, _ = ray.wait(
                list(self._inflight), num_returns=len(self._inflight), timeout=timeout_s
            )
            for ref in done:
                index = self._inflight.pop(ref)
                with contextlib.suppress(ray.exceptions.RayError):  # died while stopping
                    self._account(index, ray.get(ref))
        closing = [a.close.remote(timeout_s) for a in self.actors]
        done, _ = ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
        for index, ref in enumerate(closing):
            if ref in done:  # the writers' counters after their last flush
                with contextlib.suppress(ray.exceptions.RayError):
                    self._status.actors[index] = {
                        **self._status.actors.get(index, {}),
                        **ray.get(ref),
                    }
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        return self._status
