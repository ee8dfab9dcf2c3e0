"""``millpond launch CONFIG``: replay shards, env actors and a learner on Ray, to a frame budget.

The job, in the order it starts:

0. Checks (:meth:`Launch.prepare`): the config, the env made once, the learner's network,
   the token file, a ``--replay`` service; and the run directory claimed for this job
   alone (:mod:`~millpond.deploy.run_dir`). A job that fails them starts nothing.
1. Ray: a local instance by default; ``--address auto`` / ``ray://host:port`` joins a cluster.
2. The replay service: ``replay.shards`` :class:`~millpond.deploy.replay_actor.ReplayShardActor`
   Ray actors, each serving one shard over gRPC (or, with ``--replay host:port,...``, an
   already running ``millpond serve``), and the job's table on every shard. Each shard
   actor is pinned to its node and restarted there by Ray (``replay.max_restarts``); the
   clients find a restarted shard at its new port through
   :class:`~millpond.deploy.replay_actor.ShardAddresses`, and a shard lost for good is
   routed around (the progress line and ``summary.json``'s ``shards`` say so).
3. ``learner.num_learners`` learners (:class:`~millpond.deploy.learner_actor.LearnerActor`
   Ray actors around :class:`~millpond.learner.PPOLearner` or
   :class:`~millpond.learner.DQNLearner`; several form one data-parallel
   ``torch.distributed`` group); rank 0 publishes the initial weights before any actor acts.
4. ``actors.num_actors`` env actors (:class:`~millpond.actors.ActorFleet`), driven from a
   background thread, pulling new weights every ``actors.weight_sync_every`` steps.

This process (the driver) trains nothing: it keeps one ``run`` call in flight per learner,
collects their reports and, every ``run.status_every_s``, prints one progress line and
appends a row to ``metrics.csv``. The run stops at ``run.frames`` frames (or
``run.stop_at_return``, ``run.timeout_s``, Ctrl-C, SIGTERM, a learner that fails), then shuts
down in order: actors stopped and flushed, learners stopped, learner checkpoint written (by
rank 0, on its node; the driver writes the bytes it returns when it runs elsewhere), shards
checkpointed and stopped, Ray shut down (if this process started it). The run directory then
holds ``config.yaml``, ``metrics.csv``, ``return.png``, ``summary.json`` (with the node of
every shard, actor and learner) and ``checkpoint.pt``.

The job's parts live in rooms of their own: :mod:`~millpond.deploy.ray_start` (Ray),
:mod:`~millpond.deploy.shard_supervisor` (the shards), :mod:`~millpond.deploy.learner_group`
(the learners), :mod:`~millpond.deploy.env_fleet` (the env actors),
:mod:`~millpond.deploy.status_rows`, :mod:`~millpond.deploy.resume`, the checks
(:mod:`~millpond.deploy.preflight`, :mod:`~millpond.deploy.run_dir`) and the command line
(:mod:`~millpond.deploy.launch_cli`). Those that import Ray or torch are imported where the
job uses them, not at the top: ``millpond launch`` imports this module first, checks the
job, and imports them on a thread while Ray starts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from millpond.deploy.config_mapping import to_mapping
from millpond.deploy.learner_cores import JobCores
from millpond.deploy.ray_start import init_ray
from millpond.deploy.resume import read_resume_state
from millpond.deploy.run_dir import RunDir, claim_run_dir
from millpond.deploy.run_eval import RunEvaluation
from millpond.deploy.run_report import RunReport, format_summary, progress_line
from millpond.deploy.status_rows import StatusRows
from millpond.errors import InvalidConfigError, MillpondError, ShardUnavailableError

if TYPE_CHECKING:  # they import Ray or torch: see the module docstring
    from millpond.actors.ray_actor import ActorConfig
    from millpond.deploy.env_fleet import EnvFleet
    from millpond.deploy.launch_config import LaunchConfig
    from millpond.deploy.learner_group import LearnerGroup
    from millpond.deploy.preflight import CheckedJob
    from millpond.deploy.shard_supervisor import ShardSupervisor

__all__ = ["Launch"]

log = logging.getLogger("millpond.launch")


class _Stop(Exception):
    """SIGTERM, turned into an exception in the main thread so that shutdown runs."""


class Launch:
    """One ``millpond launch`` job (see the module docstring).

    :meth:`prepare` checks the job and claims its run directory, starting nothing;
    :meth:`run` does it first if it was not done.

    Args:
        config: the checked job config.
        replay: addresses of running shards to use instead of starting them.
        run_dir: where the run writes: a new or empty directory (a directory that holds an
            earlier run is refused, see ``overwrite``); ``None``: a new
            ``run.dir/NAME-YYYYmmdd-HHMMSS-XXXX`` (``XXXX`` random).
        out: where progress lines go.
        resume: continue the job that stopped in ``run_dir`` (``millpond launch --resume``):
            its learner from ``checkpoint.pt``, its shards from their directories, its
            frames, episodes, learner steps and wall time from ``summary.json``, its
            ``metrics.csv`` appended to; the env actors numbered after the previous runs'
            (fresh episode ids); the weight version going on from the checkpoint's.
        owns_ray: Ray was started for this job (by :func:`run`, while the job's modules
            imported): the job shuts it down when it ends.
        on_progress: called with each metrics row (a dict of
            :data:`~millpond.deploy.run_report.COLUMNS`) as it is recorded; returning
            ``False`` stops the job (as :meth:`stop` does).
        overwrite: ``run_dir`` may hold an earlier run, which is replaced (its files
            deleted); without it such a directory is refused.
        started_at: the wall-clock time the startup times in ``summary.json``
            (``startup_s``, ``stopped_at_s``) count from; ``None``: when this object is made
            (the command line passes its own start).
    """

    def __init__(
        self,
        config: LaunchConfig,
        *,
        replay: str | None = None,
        run_dir: str | Path | None = None,
        out: Any = None,
        resume: bool = False,
        owns_ray: bool = False,
        on_progress: Callable[[dict[str, Any]], Any] | None = None,
        overwrite: bool = False,
        started_at: float | None = None,
    ) -> None:
        self._started_wall = time.time() if started_at is None else started_at
        self.config = config
        self.replay = replay
        if resume and run_dir is None:
            raise InvalidConfigError("resume: name the run directory to continue (run_dir)")
        if resume and overwrite:
            raise InvalidConfigError("--resume and --overwrite: a run is continued or replaced")
        self._overwrite = overwrite
        # The directory named, until prepare() claims it (a new one when None).
        self.run_dir: Path | None = Path(run_dir) if run_dir is not None else None
        self._claim: RunDir | None = None
        self._checked: CheckedJob | None = None
        # Read before anything starts or writes: a job that cannot resume changes nothing.
        self._resumed = read_resume_state(Path(run_dir), config) if resume else None
        self.out = out or sys.stdout
        self.owns_ray = owns_ray
        self._ray_info: dict[str, Any] = {}  # the cluster the job ran on
        self.network: str | None = None  # the learner's network family, once chosen
        self._shards: ShardSupervisor | None = None  # None: a --replay service
        self._fleet: EnvFleet | None = None
        self._nodes: dict[str, Any] = {}  # where each part of the job ran
        self._node_refs: dict[str, list[Any]] = {}
        self._cores = JobCores()  # learner.pin_cores
        r = self._resumed
        self._learners: LearnerGroup | None = None  # made by run()
        self._learner_reports: list[dict[str, Any]] = []
        self._in_loop = False
        self._looped = False  # the loop began: there are final counters to read
        self._stop_requested = False  # SIGTERM during the loop
        self._time_offset = r.wall_s if r else 0.0  # a resumed run's time goes on
        self._next_actor_index = r.next_actor_index if r else 0
        self._started_at = time.monotonic()
        # Seconds from the job's start (started_at) to the end of each startup phase.
        self._startup: dict[str, float] = {}
        self._stopped_at: float | None = None
        self._rows = StatusRows(config, self._time_offset, self._started_at)
        self._eval = RunEvaluation(config, self._say, r.frames if r else 0)
        self._on_progress = on_progress
        self._stop_reason = "interrupted"  # what a stop requested during the loop records

    def stop(self) -> None:
        """Stop the job cleanly, from any thread (its summary says ``stopped_by: stopped``);
        a job still starting stops once its loop begins."""
        self._stop_reason = "stopped"
        self._stop_requested = True

    @property
    def version(self) -> int | None:
        """The last published weight version."""
        return self._learners.version if self._learners is not None else None

    # -- the job ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check the job and claim its run directory, starting nothing of it (no Ray).

        The env is made once and closed, the learner's network chosen for its
        observations, the token file read (:func:`~millpond.deploy.preflight.check_job`);
        the run directory claimed for this job alone
        (:func:`~millpond.deploy.run_dir.claim_run_dir`); a ``--replay`` service reached
        and the job's table created there.
        Raises :class:`InvalidConfigError` (or the service's error) and leaves no run
        directory behind. :meth:`run` calls it when it was not called.
        """
        if self._claim is not None:
            return
        from millpond.deploy.preflight import check_job  # deferred: imports torch

        self._checked = check_job(self.config, self.replay)
        self._mark("checked")  # the config read and checked, the env made once
        self.network = self._checked.network
        c = self.config
        self._claim = claim_run_dir(
            self.run_dir,
            parent=c.run.dir,
            name=c.name,
            resume=self._resumed is not None,
            overwrite=self._overwrite,
        )
        self.run_dir = self._claim.path
        if self.replay:  # a service that cannot be reached refuses the job before Ray
            try:
                self._connect(self.replay, None)
            except ShardUnavailableError as e:
                self.abandon()
                raise type(e)(f"--replay {self.replay}: {e}") from None
            except BaseException:
                self.abandon()
                raise

    def abandon(self) -> None:
        """Give up a prepared job that will not run: its client closed, its run directory
        released (and removed, if :meth:`prepare` made it)."""
        self._cores.unpin()
        if hasattr(self, "client"):
            with contextlib.suppress(Exception):
                self.client.close(timeout_s=5)
        if self._claim is not None:
            self._claim.abandon()

    def run(self) -> dict[str, Any]:
        """Run the job to its end; returns the summary (also in ``summary.json``)."""
        from millpond.deploy.learner_group import LearnerGroup  # deferred: imports Ray

        self.prepare()
        assert self._claim is not None and self.run_dir is not None
        try:
            self._learners = LearnerGroup(
                self.config, self.run_dir, self._nodes, self._say, self._resumed
            )
            return self._run()
        finally:
            self._claim.release()

    def _run(self) -> dict[str, Any]:
        c = self.config
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(c), sort_keys=False))
        report = RunReport(
            self.run_dir,
            tensorboard=self.config.run.tensorboard,
            append=self._resumed is not None,
        )
        reason = "error"  # until the loop says otherwise
        previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)  # Ctrl-C: the same clean stop
        try:
            self._start()
            reason = self._loop(report)
        except KeyboardInterrupt:
            reason = "interrupted"
            self._say("stopping: interrupted; shutting down cleanly")
        except _Stop:
            reason = self._stop_reason
            self._say(f"stopping: {reason}; shutting down cleanly")
        finally:
            try:
                summary = self._shutdown(report, reason)
            finally:
                self._cores.unpin()
                report.close()
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, previous[0])
                    signal.signal(signal.SIGINT, previous[1])
        return summary

    def plan_cores(self) -> None:
        """Called by whoever starts the job's local Ray, just before: ``learner.pin_cores``'
        plan, carried out once the job is up."""
        c = self.config.learner
        local = self.config.ray.address is None
        self._cores.plan_own_ray(c.pin_cores, c.num_learners, c.threads, local)

    def _mark(self, phase: str) -> None:
        """When ``phase`` of the startup ended: seconds since the job's start."""
        self._startup[phase] = round(time.time() - self._started_wall, 3)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # In the loop the main thread mostly waits inside Ray's C code, which an exception
        # raised from a handler would corrupt: there the loop checks the flag instead.
        if self._in_loop:
            self._stop_requested = True
        else:
            raise _Stop()

    def _start(self) -> None:
        # Deferred: Ray, torch and the rooms that import them (see the module docstring).
        import ray

        from millpond.deploy.env_fleet import EnvFleet
        from millpond.deploy.learner_actor import where
        from millpond.deploy.shard_supervisor import ShardSupervisor

        self._mark("imports")  # the config, Ray, torch, the env packages
        c = self.config
        assert self._checked is not None and self._learners is not None  # prepare(), run()
        obs_space = self._checked.observation_space
        act_space = self._checked.action_space
        if not ray.is_initialized():
            self.plan_cores()
            init_ray(c.ray.address, c.ray.num_cpus)
            self.owns_ray = True
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._on_signal)  # ray.init installs its own
        elif not self.owns_ray:  # Ray's processes were started by others: none kept apart
            self._cores.share(c.learner.pin_cores, c.learner.num_learners, c.learner.threads)
        plan = self._cores.plan
        self._learners.cores = plan.learners if plan else None
        self._mark("ray")
        self._ray_info = {"gcs_address": ray.get_runtime_context().gcs_address}
        # The learners' processes start (torch, the project) while the shards do.
        self._learners.create(obs_space, act_space)
        self._nodes["driver"] = where()
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        # Clients find a restarted shard at its new port, and a lost one gone, by asking its
        # actor (shards of a --replay service stay where they are).
        resolver = None
        if self.replay:
            addresses = self.replay  # connected by prepare()
        else:
            self._shards = ShardSupervisor(c, self.run_dir)
            addresses = self._shards.start()
            self._node_refs["replay"] = self._shards.node_refs
            resolver = self._shards.resolver()
            self._connect(addresses, resolver)
        self._say(f"replay: {addresses}  table {self.table!r}")
        self._mark("shards")

        self._learners.connect(addresses, self.table, c.replay.tokens()[0], resolver)

        # The env actors are created first, so that their processes start while the
        # learners do (see EnvFleet).
        first_index = self._next_actor_index
        self._next_actor_index = first_index + c.actors.num_actors
        r = self._resumed
        self._fleet = EnvFleet(
            self._actor_client,
            c,
            self._actor_config(),
            first_index=first_index,
            frames=r.frames if r else 0,
            episodes=r.episodes if r else 0,
        )
        if r is None:
            self._learners.start()
        else:
            version = r.go_on_version(self.client, self.table, c, self._say)
            self._learners.start(r.checkpoint, version)
        self._learners.save_checkpoint()  # a learner lost before the first periodic one
        self._mark("learners")
        moved = self._cores.pin_the_rest({n["pid"] for n in self._nodes["learners"]})
        if plan is not None:
            self._say(
                f"cores: learners on {', '.join(map(str, plan.learners))}; the driver and "
                f"{moved} other processes of the job on {plan.rest} (learner.pin_cores)"
            )
            # where they run now: asked again, their cores changed
            self._nodes["driver"] = where()
            if self._shards is not None:
                self._node_refs["replay"] = [
                    s.__ray_call__.remote(where) for s in self._shards.actors
                ]
        # Asked once the rest is pinned (their cores), before the fleet's first run call (so
        # answered as soon as each actor is up).
        self._node_refs["actors"] = [a.__ray_call__.remote(where) for a in self._fleet.actors]
        self._fleet.start()
        self._mark("actors")  # running; up once their first steps come in (first_insert)
        if r is not None:
            self._say(
                f"resumed {self.run_dir} at {r.frames} frames, {r.episodes} episodes, weights "
                f"version {r.checkpoint_version}; env actors {first_index}.."
                f"{self._next_actor_index - 1}"
            )
        self._say(
            f"started {c.actors.num_actors} env actors x {c.actors.num_envs} {c.env.id} envs, "
            f"{c.learner.num_learners} {c.learner.algorithm} learner"
            f"{'s' if c.learner.num_learners > 1 else ''} on {self._nodes['learners'][0]['device']}; "
            f"run dir {self.run_dir}"
        )

    def _connect(self, addresses: str, resolver: Any) -> None:
        """The job's clients of the service at ``addresses``, and its table there."""
        from millpond.deploy.shard_supervisor import connect  # deferred: imports Ray

        tokens = self.config.replay.tokens()
        self.client, self._actor_client, self.table = connect(
            self.config, addresses, resolver, tokens
        )

    def _actor_config(self) -> ActorConfig:
        """What each env actor runs, probing the env for the learner's network family if
        the learner was not made yet."""
        from millpond.deploy.env_fleet import actor_config, network_of  # deferred: imports Ray

        if self.network is None:
            self.network = network_of(self.config)
        return actor_config(self.config, self.table, self.network)

    # -- the main loop ---------------------------------------------------------------------
    def _loop(self, report: RunReport) -> str:
        started = self._started_at = time.monotonic()
        self._rows.begin(self.client, self.table, started)
        self._base_frames = self._fleet.status.frames
        self._in_loop = self._looped = True
        try:
            return self._loop_until_done(report, started)
        finally:
            self._in_loop = False

    def _loop_until_done(self, report: RunReport, started: float) -> str:
        c = self.config
        next_status = started + c.run.status_every_s
        next_checkpoint = started + c.learner.checkpoint_every_s
        while True:
            if self._stop_requested:
                raise _Stop()
            if self._fleet.error is not None:
                raise MillpondError(f"env actors failed: {self._fleet.error}")
            status = self._fleet.status
            if "first_insert" not in self._startup and status.frames > self._base_frames:
                self._mark("first_insert")
            if status.frames >= c.run.frames:
                return "frames"
            if c.run.timeout_s is not None and time.monotonic() - started > c.run.timeout_s:
                return "timeout"
            if c.run.stop_at_return is not None and (
                status.episodes >= c.run.return_window
                and (status.mean_return or -math.inf) >= c.run.stop_at_return
            ):
                return "return"
            self._learners.poll()
            self._eval.poll(status.frames, self.client)
            if self._shards is not None:
                for event in self._shards.poll():
                    self._say(event)
            now = time.monotonic()
            if now >= next_status:
                next_status = now + c.run.status_every_s
                row = self._status_row()
                report.record(row)
                note = self._shards.note() if self._shards is not None else ""
                self._say(progress_line(row, c.run.frames) + note)
                if self._on_progress is not None and self._on_progress(dict(row)) is False:
                    self.stop()
            if now >= next_checkpoint:  # a crash loses at most this much learning
                next_checkpoint = now + c.learner.checkpoint_every_s
                with _logged("writing the learner checkpoint"):  # a lost rank 0: polled next
                    self._learners.save_checkpoint()

    def _status_row(self) -> dict[str, Any]:
        counters = self._rows.counters(self.client, self.table)
        # Timed after the counters: a shard that does not answer holds them for seconds.
        elapsed = time.monotonic() - self._started_at
        status = self._fleet.status
        return self._eval.annotate(self._rows.row(elapsed, status, counters, self._learners))

    # -- shutdown --------------------------------------------------------------------------
    def _shutdown(self, report: RunReport, reason: str) -> dict[str, Any]:
        # Deferred: Ray (see the module docstring).
        import ray

        from millpond.deploy.placement import located

        self._stopped_at = round(time.time() - self._started_wall, 3)
        self._eval.close()  # an evaluation still playing

        # Each step is guarded so that one failure does not leave the rest running.
        learners = self._learners
        final = None
        if self._fleet is not None:
            self._fleet.halt()
            with _logged("stopping the env actors"):
                final = self._fleet.stop(meanwhile=learners.keep_learning)
        with _logged("locating the shards and env actors"):
            for role, refs in self._node_refs.items():
                self._nodes[role] = located(refs, timeout_s=5)
        if self._shards is not None:
            with _logged("reading the shards' state"):
                for _ in range(3):
                    for event in self._shards.poll(wait_s=2.0):
                        self._say(event)
        checkpoint = None
        if learners.actors and not learners.lost:
            with _logged("stopping the learners"):
                learners.finish_runs(timeout_s=30)  # their last run calls
            if self.version is not None:  # the learners started
                with _logged("writing the learner checkpoint"):
                    checkpoint = learners.save_checkpoint()
                with _logged("reading the learners' totals"):
                    self._learner_reports = learners.reports()
            with _logged("closing the learners"):
                learners.close()
        for learner in learners.actors:
            with _logged("stopping a learner"):
                learners.kill(learner)
        if learners.lost and (self.run_dir / "checkpoint.pt").exists():
            checkpoint = self.run_dir / "checkpoint.pt"  # the last periodic one
        row = None
        if self._looped:  # a job that failed to start has no counters of its own
            with _logged("reading the final counters"):
                row = self._status_row()
        if hasattr(self, "client"):
            with _logged("checkpointing the replay service"):
                if self._shards is not None and self._shards.lost:
                    self._shards.checkpoint_live(self.client)
                else:
                    self.client.checkpoint()
        if self._shards is not None and self._shards.actors:
            with _logged("stopping the replay shards"):
                self._shards.stop()
        if hasattr(self, "client"):
            with _logged("closing the client"):
                self.client.close(timeout_s=10)
        if self.owns_ray:
            ray.shutdown()
        self._cores.unpin()
        with _logged("evaluating the policy"):  # after Ray: its CPUs are free again
            self._eval.final(self.run_dir, reason, row["frames"] if row else None)
        if row is not None:
            self._eval.annotate(row)
        summary = self._summary(reason, final, row, checkpoint)
        if row is not None:
            report.record(row)
        with _logged("drawing the plot"):
            report.plot(f"{self.config.name}: {self.config.env.id}")
        report.write_summary(summary)
        shown = [k for k in summary if k != "started_at"]  # a Unix time: for programs
        self._say("summary:\n" + format_summary(summary, shown))
        return summary

    def _summary(
        self, reason: str, final: Any, row: dict[str, Any] | None, checkpoint: Path | None
    ) -> dict[str, Any]:
        r = self._resumed
        frames = final.frames if final else (r.frames if r else 0)
        episodes = final.episodes if final else (r.episodes if r else 0)
        elapsed = row["time_s"] if row else (self._time_offset or None)
        this_run_s = elapsed - self._time_offset if elapsed is not None else None
        this_run_frames = frames - (r.frames if r else 0)
        actors = list(final.actors.values()) if final is not None else []
        act_s = sum(a.get("act_s", 0.0) for a in actors)
        write_s = sum(a.get("write_s", 0.0) for a in actors)
        learners = self._learners
        watch = self._shards.watch if self._shards is not None else None
        lag_frames = final.acting_lag_frames if final is not None else 0
        acting_lag = final.acting_lag_total / lag_frames if lag_frames else None
        return {
            "name": self.config.name,
            "stopped_by": reason,
            "frames": frames,
            "episodes": episodes,
            "mean_return": final.mean_return if final else None,
            **self._eval.summary(),
            "wall_s": elapsed,
            "frames_per_s": this_run_frames / this_run_s if this_run_s else None,
            "learner_steps": learners.steps,
            "stale_steps": learners.stale_steps,
            "weights_version": learners.version,
            "num_learners": self.config.learner.num_learners,
            "samples_per_insert": row.get("samples_per_insert") if row else None,
            "actor_restarts": final.restarts if final else 0,
            "learner_restarts": learners.restarts,
            "shard_restarts": sum(watch.restarts) if watch else 0,
            "shards": watch.summary() if watch else None,
            "next_actor_index": self._next_actor_index,
            "started_at": round(self._started_wall, 3),  # the clock's zero, Unix time
            "startup_s": dict(self._startup),
            # When the job decided to stop (its frames, return or timeout reached, a signal,
            # an error), in seconds since the job's start, as startup_s counts.
            "stopped_at_s": self._stopped_at,
            "resumes": r.history() if r else [],
            "actors_act_s": round(act_s, 2),
            "actors_write_s": round(write_s, 2),
            "learner_sample_s": round(learners.timing["sample_s"], 2),
            "learner_update_s": round(learners.timing["learn_s"], 2),
            # the actors' acting lag over the run (see deploy/status_rows.py)
            "acting_lag": acting_lag,
            "acting_lag_steps": self._rows.acting_steps(acting_lag),
            "acting_lag_max": final.acting_lag_max if acting_lag is not None else None,
            "learner_publish_wait_s": round(learners.timing["publish_wait_s"], 2),
            **self._rows.outages(actors, learners),
            "run_dir": str(self.run_dir),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "ray": self._ray_info,
            "learners": self._learner_reports,
            "nodes": self._nodes,
        }

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


@contextlib.contextmanager
def _logged(what: str):
    try:
        yield
    except Exception as e:
        from millpond.actors.remote_errors import first_line  # deferred: imports torch

        log.error("shutdown: %s failed: %s", what, first_line(e))
