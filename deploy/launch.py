"""``millpond launch CONFIG``: replay shards, env actors and a learner on Ray, to a frame budget.

The job, in the order it starts:

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
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import signal
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from millpond.deploy.config_files import read_config_doc
from millpond.deploy.run_report import RunReport, format_summary, progress_line
from millpond.errors import (
    AuthenticationError,
    InvalidConfigError,
    MillpondError,
    PermissionDeniedError,
)

if TYPE_CHECKING:  # the config's module imports torch: the command line must not wait for it
    from millpond.deploy.launch_config import LaunchConfig

__all__ = ["Launch", "build_parser", "run"]

log = logging.getLogger("millpond.launch")


class _Stop(Exception):
    """SIGTERM, turned into an exception in the main thread so that shutdown runs."""


@dataclass(frozen=True)
class _Resumed:
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


def _read_resume_state(run_dir: Path, config: LaunchConfig) -> _Resumed:
    """The state a job left in ``run_dir``, or an error naming what is missing."""
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
    return _Resumed(
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


class Launch:
    """One ``millpond launch`` job (see the module docstring).

    Args:
        config: the checked job config.
        replay: addresses of running shards to use instead of starting them.
        run_dir: where the run writes; ``None``: ``run.dir/NAME-YYYYmmdd-HHMMSS``.
        out: where progress lines go.
        resume: continue the job that stopped in ``run_dir`` (``millpond launch --resume``):
            its learner from ``checkpoint.pt``, its shards from their directories, its
            frames, episodes, learner steps and wall time from ``summary.json``, its
            ``metrics.csv`` appended to; the env actors numbered after the previous runs'
            (fresh episode ids); the weight version going on from the checkpoint's.
        owns_ray: Ray was started for this job (by :func:`run`, while the job's modules
            imported): the job shuts it down when it ends.
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
    ) -> None:
        self.config = config
        self.replay = replay
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if resume and run_dir is None:
            raise InvalidConfigError("resume: name the run directory to continue (run_dir)")
        self.run_dir = Path(run_dir or Path(config.run.dir) / f"{config.name}-{stamp}")
        # Read before anything starts or writes: a job that cannot resume changes nothing.
        self._resumed = _read_resume_state(self.run_dir, config) if resume else None
        self.out = out or sys.stdout
        self._started_ray = owns_ray
        self._ray_info: dict[str, Any] = {}  # the cluster the job ran on
        self.network: str | None = None  # the learner's network family, once chosen
        self._shards: list[Any] = []
        self._shard_names: list[str] = []
        self._shard_watch: _ShardWatch | None = None
        self._fleet: Any = None
        self._fleet_thread: threading.Thread | None = None
        self._fleet_error: BaseException | None = None
        self._halt = threading.Event()
        self._learners: list[Any] = []  # LearnerActor handles, by rank
        self._spaces: tuple[Any, Any] = (None, None)  # the env's, for new learners
        self._runs: dict[Any, int] = {}  # each learner's run call in flight -> its rank
        self._nodes: dict[str, Any] = {}  # where each part of the job ran
        self._node_refs: dict[str, list[Any]] = {}
        self.version: int | None = None  # the last published weight version
        self._learner_reports: list[dict[str, Any]] = []
        self._learner_lost = False  # a learner died: the others may wait in the group forever
        self.learner_restarts = 0
        self._in_loop = False
        self._stop_requested = False  # SIGTERM during the loop
        self._timing = {"sample_s": 0.0, "learn_s": 0.0}
        self._lags: deque[float] = deque(maxlen=50)
        self._losses: deque[float] = deque(maxlen=50)
        r = self._resumed
        self.learner_steps = r.learner_steps if r else 0
        self.stale_steps = r.stale_steps if r else 0  # dropped as acted by too old a policy
        self._time_offset = r.wall_s if r else 0.0  # a resumed run's time goes on
        self._next_actor_index = r.next_actor_index if r else 0
        if r is not None:
            self.version = r.checkpoint_version
        self._started_at = time.monotonic()
        # Seconds from the process's start to the end of each startup phase (summary.json).
        self._startup: dict[str, float] = {}
        self._stopped_at: float | None = None
        self._last: dict[str, float] = {
            "t": self._started_at,
            "frames": 0,
            "inserts": 0,
            "samples": 0,
        }
        self._base: dict[str, int] = {}
        self._counters_seen: dict[str, int] = {}

    # -- the job ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the job to its end; returns the summary (also in ``summary.json``)."""
        from millpond.deploy.launch_config import to_mapping

        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
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
        except (KeyboardInterrupt, _Stop):
            reason = "interrupted"
            self._say("stopping: interrupted; shutting down cleanly")
        finally:
            try:
                summary = self._shutdown(report, reason)
            finally:
                report.close()
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, previous[0])
                    signal.signal(signal.SIGINT, previous[1])
        return summary

    def _mark(self, phase: str) -> None:
        """When ``phase`` of the startup ended: seconds since this process started."""
        self._startup[phase] = round(time.time() - _process_start(), 3)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # In the loop the main thread mostly waits inside Ray's C code, which an exception
        # raised from a handler would corrupt: there the loop checks the flag instead.
        if self._in_loop:
            self._stop_requested = True
        else:
            raise _Stop()

    def _start(self) -> None:
        import ray

        from millpond.actors.envs import make_env
        from millpond.actors.fleet import ActorFleet
        from millpond.deploy.replay_actor import ShardAddresses
        from millpond.learner.client import ReplayClient
        from millpond.learner.networks import network_for

        self._mark("imports")  # the interpreter, the config, Ray, torch, the env packages
        c = self.config
        try:  # before anything starts: a wrong env id is a config error
            # Wrapped as every lane is, so that the learner's networks see the actors' spaces.
            probe = make_env(c.env.id, c.env.kwargs, c.env.wrappers)
        except InvalidConfigError as e:
            raise InvalidConfigError(f"env: {e}") from None
        except Exception as e:
            raise InvalidConfigError(f"env: cannot make {c.env.id!r}: {e}") from None
        obs_space, act_space = probe.observation_space, probe.action_space
        probe.close()
        c.replay.tokens()  # an unreadable token file is a config error, also before anything
        if c.replay.tls is not None and self.replay is None:
            raise InvalidConfigError(
                "replay.tls: applies to a service named with --replay; the shards this job "
                "starts serve plaintext"
            )
        if not ray.is_initialized():
            _init_ray(c.ray.address, c.ray.num_cpus)
            self._started_ray = True
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._on_signal)  # ray.init installs its own
        self._mark("ray")
        self._ray_info = {"gcs_address": ray.get_runtime_context().gcs_address}
        # The learners' processes start (torch, the project) while the shards do.
        self._create_learners(obs_space, act_space)
        from millpond.deploy.learner_actor import where

        self._nodes["driver"] = where()
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        addresses = self.replay or self._start_shards()
        admin_token, writer_token = c.replay.tokens()
        # Clients find a restarted shard at its new port, and a lost one gone, by asking its
        # actor (shards of a --replay service stay where they are).
        resolver = None
        if self._shards:
            namespace = ray.get_runtime_context().namespace
            resolver = ShardAddresses(self._shard_names, namespace)
        self.client = ReplayClient(
            addresses, token=admin_token, tls=c.replay.tls, resolver=resolver
        )
        actor_client = self.client
        if writer_token != admin_token:  # the actors get the least privilege the file offers
            actor_client = ReplayClient(
                addresses, token=writer_token, tls=c.replay.tls, resolver=resolver
            )
        try:
            self.table = self.client.create_table(c.replay.table_config()).name
        except (AuthenticationError, PermissionDeniedError) as e:
            hint = (
                "give replay.token_file an 'admin' token the service accepts"
                if c.replay.token_file is None or isinstance(e, AuthenticationError)
                else "the token file's first 'admin' token lacks the admin role there"
            )
            raise type(e)(f"replay service {addresses}: {e} ({hint})") from None
        self._say(f"replay: {addresses}  table {self.table!r}")
        self._mark("shards")

        try:
            self.network = network_for(obs_space, c.learner.network)
        except InvalidConfigError as e:
            raise InvalidConfigError(f"learner.network: {e}") from None
        self._learner_args = (addresses, admin_token, resolver)

        # The env actors are created first, so that their processes start (imports, envs,
        # writers) while the learners do; they act only from their first run call, made
        # by the fleet thread once the learners have published the weights they start with.
        first_index = self._next_actor_index
        self._next_actor_index = first_index + c.actors.num_actors
        r = self._resumed
        self._fleet = ActorFleet(
            actor_client,
            self._actor_config(),
            num_actors=c.actors.num_actors,
            num_cpus=c.actors.num_cpus,
            resources=dict(c.actors.resources),
            label_selector=dict(c.actors.label_selector) or None,
            max_restarts=c.actors.max_restarts,
            first_index=first_index,
            frames=r.frames if r else 0,
            episodes=r.episodes if r else 0,
        )
        # Submitted before the fleet's first run call, so answered as soon as each actor is up.
        self._node_refs["actors"] = [a.__ray_call__.remote(where) for a in self._fleet.actors]
        if self._resumed is None:
            self._start_learners()
        else:
            self._start_learners(self._resumed.checkpoint, self._resumed_version())
        self._save_checkpoint()  # a learner lost before the first periodic one restarts here
        self._mark("learners")
        self._fleet_thread = threading.Thread(target=self._drive_fleet, daemon=True)
        self._fleet_thread.start()
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

    def _start_shards(self) -> str:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from millpond.deploy.replay_actor import ReplayShardActor
        from millpond.service.server import ServerConfig

        c = self.config
        host = "127.0.0.1" if c.ray.address is None else "0.0.0.0"
        token_file = c.replay.token_file
        nodes = self._shard_nodes()
        prefix = f"millpond-shard-{uuid.uuid4().hex[:8]}"
        self._shard_names = [f"{prefix}-{i}" for i in range(len(nodes))]
        for i, node in enumerate(nodes):
            server = ServerConfig(
                dir=str((self.run_dir / "replay" / f"shard-{i}").resolve()),
                host=host,
                port=0,
                max_message_mb=c.replay.max_message_mb,
                token_file=None if token_file is None else str(Path(token_file).resolve()),
                metrics_port=(
                    None
                    if c.replay.metrics_port is None
                    else c.replay.metrics_port and c.replay.metrics_port + i
                ),
            )
            # Pinned to its node: restarted there, on its directory, or not at all.
            remote = ray.remote(ReplayShardActor).options(
                name=self._shard_names[i],  # clients look it up by name (ShardAddresses)
                num_cpus=c.replay.num_cpus,
                max_restarts=c.replay.max_restarts,
                max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                **_placement(c.replay.resources, {}),
            )
            self._shards.append(remote.remote(server))
        try:
            addresses = ray.get(
                [s.address.remote() for s in self._shards], timeout=c.replay.start_timeout_s
            )
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnschedulableError):
            for shard in self._shards:  # unplaced actors would make shutdown wait for them
                ray.kill(shard)
            self._shards.clear()
            raise self._shards_unplaced() from None
        from millpond.deploy.learner_actor import where

        self._node_refs["replay"] = [s.__ray_call__.remote(where) for s in self._shards]
        self._shard_watch = _ShardWatch(self._shards, addresses, c.replay.max_restarts)
        self._shard_watch.poll(wait_s=5.0)  # where each serves (and its metrics endpoint)
        return ",".join(addresses)

    def _shard_nodes(self) -> list[str]:
        """The node of each shard: where Ray reserves the shards' resources (CPUs, custom
        resources, labels) all at once, as one placement group that is then released."""
        import ray
        from ray.util.placement_group import (
            placement_group,
            placement_group_table,
            remove_placement_group,
        )

        c = self.config
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) == 1 and not c.replay.resources and not c.replay.label_selector:
            return [alive[0]["NodeID"]] * c.replay.shards  # one node: nothing to choose
        bundle = {"CPU": c.replay.num_cpus, **c.replay.resources}
        bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
        labels = dict(c.replay.label_selector)
        group = placement_group(
            [dict(bundle) for _ in range(c.replay.shards)],
            strategy="PACK",
            bundle_label_selector=[dict(labels) for _ in range(c.replay.shards)]
            if labels
            else None,
        )
        try:
            ray.get(group.ready(), timeout=c.replay.start_timeout_s)
            placed = placement_group_table(group)["bundles_to_node_id"]
            return [placed[i] for i in range(c.replay.shards)]
        except ray.exceptions.GetTimeoutError:
            raise self._shards_unplaced() from None
        finally:
            remove_placement_group(group)

    def _shards_unplaced(self) -> MillpondError:
        c = self.config
        needed = c.replay.shards * c.replay.num_cpus
        return MillpondError(
            f"replay shards did not start within replay.start_timeout_s="
            f"{c.replay.start_timeout_s:g} s: they need {needed:g} CPUs free in the Ray "
            f"cluster (replay.shards x replay.num_cpus){_placement_hint(c.replay)}; see "
            "`ray status`"
        )

    def _resumed_version(self) -> int:
        """The weight version a resumed learner goes on from: its checkpoint's.

        A job stopped cleanly wrote its checkpoint after its last publication, so the
        service holds the same version. If the service holds a newer one (the learner was
        lost after the last periodic checkpoint), the steps acted by those newer policies
        may be stored: a queue table (on-policy) is emptied, since its steps would be newer
        than the restored policy, and the numbering goes on after the service's version,
        which a publication must pass."""
        r = self._resumed
        assert r is not None
        held = self.client.info(self.table).get("weights_version")
        held = -1 if held is None else int(held)
        if held <= r.checkpoint_version:
            return r.checkpoint_version
        if self.config.replay.table_config().sampler == "queue":
            self.client.reset(self.table)
            dropped = "; its queue table is emptied (on-policy steps newer than the checkpoint)"
        else:
            dropped = "; its off-policy table is kept"
        self._say(
            f"resume: the service holds weights version {held}, newer than checkpoint.pt's "
            f"{r.checkpoint_version}{dropped}; versions go on from {held}"
        )
        return held

    def _create_learners(self, obs_space: Any, act_space: Any) -> None:
        """Place the learners' actors; their processes start (imports) while the caller
        goes on. :meth:`_start_learners` connects them."""
        import ray

        from millpond.deploy.learner_actor import LearnerActor

        c = self.config
        n = c.learner.num_learners
        remote = ray.remote(LearnerActor).options(
            num_cpus=c.learner.num_cpus,
            num_gpus=c.learner.num_gpus,
            max_restarts=0,  # the driver restarts the whole group (it cannot take a rank back)
            **_placement(c.learner.resources, c.learner.label_selector),
        )
        self._spaces = (obs_space, act_space)
        self._learners = [
            remote.remote(c, obs_space, act_space, rank=rank, world_size=n) for rank in range(n)
        ]

    def _start_learners(self, restore: bytes | None = None, version: int | None = None) -> None:
        """Place the learners (unless :meth:`_create_learners` did), form their group (from
        the checkpoint ``restore``, if given, the weight version going on from ``version``,
        else from the service's), publish their weights."""
        import ray

        c = self.config
        n = c.learner.num_learners
        if not self._learners:
            self._create_learners(*self._spaces)
        addresses, token, resolver = self._learner_args
        connect = {"token": token, "tls": c.replay.tls, "resolver": resolver}
        try:
            described = ray.get(
                [learner.describe.remote() for learner in self._learners],
                timeout=c.learner.start_timeout_s,
            )
            master = ray.get(self._learners[0].rendezvous.remote()) if n > 1 else None
            ray.get(
                [
                    learner.start.remote(addresses, self.table, master, restore, version, **connect)
                    for learner in self._learners
                ],
                timeout=c.learner.start_timeout_s,
            )
        except ray.exceptions.GetTimeoutError:
            raise MillpondError(
                f"the learners did not start within learner.start_timeout_s="
                f"{c.learner.start_timeout_s:g} s: they need {n * c.learner.num_cpus:g} CPUs"
                f" and {n * c.learner.num_gpus:g} GPUs free in the Ray cluster (learner."
                f"num_learners x num_cpus / num_gpus){_placement_hint(c.learner)}; see "
                "`ray status`"
            ) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, MillpondError):
                raise type(cause)(str(cause).splitlines()[-1]) from None
            raise MillpondError(f"a learner failed to start: {e}") from None
        self._nodes["learners"] = described
        # Every rank counts the version; rank 0 sends the weights the actors start with.
        self.version = ray.get([learner.publish.remote() for learner in self._learners])[0]

    def _actor_config(self) -> Any:
        from millpond.actors.policies import EpsilonGreedy
        from millpond.actors.ray_actor import ActorConfig

        c = self.config
        epsilon = None
        if c.actors.epsilon_start is not None:
            epsilon = EpsilonGreedy(
                c.actors.epsilon_start, c.actors.epsilon_end, c.actors.epsilon_decay_frames
            )
        # The actors build the learner's policy network, so that its weights load into theirs.
        head = "policy" if c.learner.algorithm == "ppo" else "q"
        if self._network() == "nature_cnn":
            factory, kwargs = f"nature_cnn_{head}", {}
        else:
            factory, kwargs = f"mlp_{head}", {"hidden": tuple(c.learner.hidden_sizes)}
        return ActorConfig(
            env=c.env.id,
            table=self.table,
            num_envs=c.actors.num_envs,
            chunk_len=c.actors.chunk_len,
            vectorization_mode=c.env.vectorization_mode,
            env_kwargs=dict(c.env.kwargs),
            env_wrappers=tuple(c.env.wrappers),
            policy=f"millpond.learner.networks:{factory}",
            policy_kwargs=kwargs,
            deterministic=c.actors.deterministic,
            epsilon=epsilon,
            weight_sync_every=c.actors.weight_sync_every,
            max_in_flight=c.actors.max_in_flight,
            processors=tuple(c.actors.processors) or None,
            seed=c.run.seed,
        )

    def _network(self) -> str:
        """The learner's network family (``mlp`` / ``nature_cnn``), probing the env if the
        learner was not made yet."""
        if self.network is None:
            from millpond.actors.envs import make_env
            from millpond.learner.networks import network_for

            c = self.config
            probe = make_env(c.env.id, c.env.kwargs, c.env.wrappers)
            try:
                self.network = network_for(probe.observation_space, c.learner.network)
            finally:
                probe.close()
        return self.network

    def _drive_fleet(self) -> None:
        try:
            while not self._halt.is_set():
                self._fleet.poll(timeout_s=0.5)
        except BaseException as e:  # surfaced by the main loop
            self._fleet_error = e
            self._halt.set()

    # -- the main loop ---------------------------------------------------------------------
    def _loop(self, report: RunReport) -> str:
        started = self._started_at = time.monotonic()
        self._last = {"t": started, "frames": 0, "inserts": 0, "samples": 0}
        self._base = self._counters()
        self._base_frames = self._fleet.status.frames
        self._in_loop = True
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
            if self._fleet_error is not None:
                raise MillpondError(f"env actors failed: {self._fleet_error}")
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
            self._poll_learners()
            if self._shard_watch is not None:
                for event in self._shard_watch.poll():
                    self._say(event)
            now = time.monotonic()
            if now >= next_status:
                next_status = now + c.run.status_every_s
                row = self._status_row(now - started)
                report.record(row)
                self._say(progress_line(row, c.run.frames) + self._shards_note())
            if now >= next_checkpoint:  # a crash loses at most this much learning
                next_checkpoint = now + c.learner.checkpoint_every_s
                with _logged("writing the learner checkpoint"):  # a lost rank 0: polled next
                    self._save_checkpoint()

    def _shards_note(self) -> str:
        """What the progress line adds while shards are lost: ``shards LIVE/COUNT``."""
        watch = self._shard_watch
        if watch is None or not watch.lost:
            return ""
        return (
            f"  shards {watch.live}/{len(watch.shards)} (lost: {', '.join(map(str, watch.lost))})"
        )

    def _restart_learners(self, rank: int, error: BaseException) -> None:
        """Replace the whole group by new learners that start from the last checkpoint."""
        import ray

        self.learner_restarts += 1
        path = self.run_dir / "checkpoint.pt"
        self._say(
            f"learner {rank} died ({_first_line(error)}); restarting the learners from "
            f"{path.name} (restart {self.learner_restarts} of "
            f"{self.config.learner.max_restarts})"
        )
        for learner in self._learners:  # the survivors would wait for the lost rank forever
            with contextlib.suppress(Exception):
                ray.kill(learner, no_restart=True)
        self._learners, self._runs = [], {}
        self._start_learners(restore=path.read_bytes())

    def _poll_learners(self, timeout_s: float = 0.2, submit: bool = True) -> None:
        """Collect the learners' finished run calls, and give each its next one."""
        import ray

        if submit:
            busy = set(self._runs.values())
            for rank, learner in enumerate(self._learners):
                if rank not in busy:
                    self._runs[learner.run.remote()] = rank
        if not self._runs:
            return
        ready, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=timeout_s)
        for ref in ready:
            rank = self._runs.pop(ref)
            try:
                report = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if self.learner_restarts < self.config.learner.max_restarts:
                    self._restart_learners(rank, e)
                    return
                self._learner_lost = True
                raise MillpondError(
                    f"learner {rank} died ({_first_line(e)}) and learner.max_restarts="
                    f"{self.config.learner.max_restarts} are spent: the job stops, keeping the "
                    "last checkpoint.pt"
                ) from None
            except ray.exceptions.RayTaskError as e:
                raise MillpondError(f"learner {rank} failed: {e}") from None
            self.stale_steps += report["dropped"]  # every rank drops its own stale steps
            if rank != 0:  # the ranks step together: rank 0 speaks for the group
                continue
            self._timing["sample_s"] += report["sample_s"]
            self._timing["learn_s"] += report["update_s"]
            self.learner_steps += report["steps"]
            self.version = report["version"]
            if report["policy_lag"] is not None:
                self._lags.append(report["policy_lag"])
            if report["loss"] is not None:
                self._losses.append(report["loss"])

    def _counters(self) -> dict[str, int]:
        try:
            info = self.client.info(self.table)
        except MillpondError:  # a shard is down: keep the last numbers
            return self._counters_seen
        self._counters_seen = {
            "inserts": int(info["inserts"]),
            "samples": int(info["samples"]),
            "size": int(info["size"]),
            "shards": len(info["shards"]),
        }
        return self._counters_seen

    def _status_row(self, elapsed: float) -> dict[str, Any]:
        status = self._fleet.status
        counters = self._counters()
        dt = max(1e-9, time.monotonic() - self._last["t"])
        inserts = counters.get("inserts", 0) - self._base.get("inserts", 0)
        samples = counters.get("samples", 0) - self._base.get("samples", 0)
        capacity = self.config.replay.table_config().capacity * counters.get("shards", 1)
        row = {
            "time_s": round(self._time_offset + elapsed, 2),
            "frames": status.frames,
            "frames_per_s": (status.frames - self._last["frames"]) / dt,
            "episodes": status.episodes,
            "mean_return": status.mean_return,
            "buffer_size": counters.get("size"),
            "buffer_fill": counters.get("size", 0) / capacity if capacity else None,
            "inserts_per_s": (inserts - self._last["inserts"]) / dt,
            "samples_per_s": (samples - self._last["samples"]) / dt,
            "samples_per_insert": samples / inserts if inserts else None,
            "policy_lag": sum(self._lags) / len(self._lags) if self._lags else None,
            "stale_steps": self.stale_steps,
            "learner_steps": self.learner_steps,
            "weights_version": self.version,
            "loss": sum(self._losses) / len(self._losses) if self._losses else None,
            "actor_restarts": status.restarts,
        }
        self._last = {
            "t": time.monotonic(),
            "frames": status.frames,
            "inserts": inserts,
            "samples": samples,
        }
        return row

    # -- shutdown --------------------------------------------------------------------------
    def _shutdown(self, report: RunReport, reason: str) -> dict[str, Any]:
        import ray

        self._stopped_at = round(time.time() - _process_start(), 3)

        # Each step is guarded so that one failure does not leave the rest running.
        self._halt.set()
        if self._fleet_thread is not None:
            self._fleet_thread.join(timeout=30)
        final = None
        if self._fleet is not None:
            with _logged("stopping the env actors"):
                final = self._stop_fleet_while_learning()
        with _logged("locating the shards and env actors"):
            for role, refs in self._node_refs.items():
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
                self._nodes[role] = [_value(r) if r in ready else None for r in refs]
        if self._shard_watch is not None:
            with _logged("reading the shards' state"):
                for _ in range(3):
                    for event in self._shard_watch.poll(wait_s=2.0):
                        self._say(event)
        checkpoint = None
        if self._learners and not self._learner_lost:
            with _logged("stopping the learners"):
                deadline = time.monotonic() + 30
                while self._runs and time.monotonic() < deadline:  # their last run calls
                    with contextlib.suppress(MillpondError):  # reported by the loop already
                        self._poll_learners(timeout_s=1.0, submit=False)
            if self.version is not None:  # the learners started
                with _logged("writing the learner checkpoint"):
                    checkpoint = self._save_checkpoint()
                with _logged("reading the learners' totals"):
                    reports = [lr.report.remote() for lr in self._learners]
                    self._learner_reports = ray.get(reports, timeout=30)
            with _logged("closing the learners"):
                ray.wait([lr.close.remote() for lr in self._learners], timeout=30)
        for learner in self._learners:
            with _logged("stopping a learner"):
                ray.kill(learner, no_restart=True)
        if self._learner_lost and (self.run_dir / "checkpoint.pt").exists():
            checkpoint = self.run_dir / "checkpoint.pt"  # the last periodic one
        row = None
        if hasattr(self, "client"):
            with _logged("reading the final counters"):
                row = self._status_row(time.monotonic() - self._started_at)
            with _logged("checkpointing the replay service"):
                if self._shard_watch is not None and self._shard_watch.lost:
                    self._checkpoint_live_shards()
                else:
                    self.client.checkpoint()
        if self._shards:
            with _logged("stopping the replay shards"):
                lost = self._shard_watch.lost if self._shard_watch is not None else {}
                live = [s for i, s in enumerate(self._shards) if i not in lost]
                ray.get([s.stop.remote() for s in live], timeout=60)
        if hasattr(self, "client"):
            with _logged("closing the client"):
                self.client.close(timeout_s=10)
        if self._started_ray:
            ray.shutdown()
        summary = self._summary(reason, final, row, checkpoint)
        if row is not None:
            report.record(row)
        with _logged("drawing the plot"):
            report.plot(f"{self.config.name}: {self.config.env.id}")
        report.write_summary(summary)
        self._say("summary:\n" + format_summary(summary))
        return summary

    def _stop_fleet_while_learning(self) -> Any:
        """Stop the env actors (flushed and closed) while the learners go on sampling; the
        fleet's final status.

        A PPO queue that is full when the job stops holds the actors' last segments back
        until something samples: with the learners idle, the actors' close waited out its
        timeouts (5 s for their runs, 5 s for their flush) and dropped those steps. Short
        waits still bound a table whose rate limiter holds inserts back for another reason.
        """
        outcome: dict[str, Any] = {}

        def stop() -> None:
            try:
                outcome["final"] = self._fleet.stop(timeout_s=5)
            except BaseException as e:  # raised below, in this thread
                outcome["error"] = e

        stopper = threading.Thread(target=stop, name="millpond-fleet-stop", daemon=True)
        stopper.start()
        while stopper.is_alive():
            if self._learners and not self._learner_lost:
                with contextlib.suppress(MillpondError):  # the loop reported it already
                    self._poll_learners(timeout_s=0.2)
            else:
                stopper.join(0.2)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("final")

    def _checkpoint_live_shards(self) -> None:
        """Checkpoint the shards that are still there (the lost ones cannot be)."""
        from millpond.learner.client import ReplayClient

        c = self.config
        lost = self._shard_watch.lost if self._shard_watch is not None else {}
        for i, address in enumerate(self.client.addresses):
            if i in lost:
                continue
            one = ReplayClient(address, token=c.replay.tokens()[0], tls=c.replay.tls)
            try:
                one.checkpoint()
            finally:
                one.close(timeout_s=5)

    def _save_checkpoint(self) -> Path:
        """Rank 0 writes ``checkpoint.pt`` into the run directory on its node; when that is
        another node, the driver writes the bytes it returns here too."""
        import ray

        path = (self.run_dir / "checkpoint.pt").resolve()
        learner = self._nodes.get("learners", [{}])[0]
        elsewhere = learner.get("node_id") != self._nodes.get("driver", {}).get("node_id")
        data = ray.get(self._learners[0].checkpoint.remote(str(path), elsewhere), timeout=120)
        if data is not None:
            tmp = path.with_suffix(".pt.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path

    def _summary(
        self, reason: str, final: Any, row: dict[str, Any] | None, checkpoint: Path | None
    ) -> dict[str, Any]:
        r = self._resumed
        frames = final.frames if final else (r.frames if r else 0)
        episodes = final.episodes if final else (r.episodes if r else 0)
        elapsed = row["time_s"] if row else (self._time_offset or None)
        this_run_s = elapsed - self._time_offset if elapsed is not None else None
        this_run_frames = frames - (r.frames if r else 0)
        resumes = list(r.resumes) if r else []
        if r is not None:
            resumes.append(
                {
                    "frames": r.frames,
                    "episodes": r.episodes,
                    "weights_version": r.checkpoint_version,
                    "learner_steps": r.learner_steps,
                }
            )
        actors = final.actors.values() if final is not None else []
        act_s = sum(a.get("act_s", 0.0) for a in actors)
        write_s = sum(a.get("write_s", 0.0) for a in actors)
        return {
            "name": self.config.name,
            "stopped_by": reason,
            "frames": frames,
            "episodes": episodes,
            "mean_return": final.mean_return if final else None,
            "wall_s": elapsed,
            "frames_per_s": this_run_frames / this_run_s if this_run_s else None,
            "learner_steps": self.learner_steps,
            "stale_steps": self.stale_steps,
            "weights_version": self.version,
            "num_learners": self.config.learner.num_learners,
            "samples_per_insert": row.get("samples_per_insert") if row else None,
            "actor_restarts": final.restarts if final else 0,
            "learner_restarts": self.learner_restarts,
            "shard_restarts": sum(self._shard_watch.restarts) if self._shard_watch else 0,
            "shards": self._shard_watch.summary() if self._shard_watch else None,
            "next_actor_index": self._next_actor_index,
            "startup_s": dict(self._startup),
            # When the job decided to stop (its frames, return or timeout reached, a signal,
            # an error), in seconds since its process started, as startup_s counts.
            "stopped_at_s": self._stopped_at,
            "resumes": resumes,
            "actors_act_s": round(act_s, 2),
            "actors_write_s": round(write_s, 2),
            "learner_sample_s": round(self._timing["sample_s"], 2),
            "learner_update_s": round(self._timing["learn_s"], 2),
            "run_dir": str(self.run_dir),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "ray": self._ray_info,
            "learners": self._learner_reports,
            "nodes": self._nodes,
        }

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def _value(ref: Any) -> Any:
    """A finished Ray call's value, ``None`` if it failed (its actor died)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


@contextlib.contextmanager
def _logged(what: str):
    try:
        yield
    except Exception as e:
        log.error("shutdown: %s failed: %s", what, e)


def _placement(resources: dict[str, float], labels: dict[str, str]) -> dict[str, Any]:
    """Ray ``.options`` for a role's custom resources and node labels (none when unset)."""
    options: dict[str, Any] = {}
    if resources:
        options["resources"] = dict(resources)
    if labels:
        options["label_selector"] = dict(labels)
    return options


def _placement_hint(section: Any) -> str:
    parts = [f"resources {section.resources}" if section.resources else ""]
    parts.append(f"labels {section.label_selector}" if section.label_selector else "")
    wanted = " and ".join(p for p in parts if p)
    return f", on nodes with {wanted}" if wanted else ""


#: Seconds the driver waits for a shard's answer to ``status`` before asking again.
_STATUS_PATIENCE_S = 3.0


def _process_start() -> float:
    """This process's start (wall clock), so that startup times include the imports."""
    try:
        import psutil  # a Ray dependency

        return psutil.Process().create_time()
    except Exception:  # pragma: no cover - without psutil: from this module's import
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class _ShardWatch:
    """The driver's view of the shard actors it started: which restarted (a new process:
    a new pid, perhaps a new port) and which are lost for good, from one ``status`` call
    kept in flight per shard."""

    def __init__(self, shards: list[Any], addresses: list[str], max_restarts: int) -> None:
        self.shards = shards
        self.addresses = list(addresses)
        self.max_restarts = max_restarts
        self.status: list[dict[str, Any] | None] = [None] * len(shards)
        self.restarts = [0] * len(shards)
        self.lost: dict[int, str] = {}
        self._strikes = [0] * len(shards)
        self._inflight: dict[Any, int] = {}
        self._asked_at: dict[Any, float] = {}

    @property
    def live(self) -> int:
        return len(self.shards) - len(self.lost)

    def poll(self, wait_s: float = 0.0) -> list[str]:
        """Collect the answers that came; returns a line for each restart or loss seen."""
        import ray

        now = time.monotonic()
        for ref, asked in list(self._asked_at.items()):
            if now - asked > _STATUS_PATIENCE_S:  # a call Ray holds across a restart: ask anew
                self._inflight.pop(ref, None)
                self._asked_at.pop(ref)
        busy = set(self._inflight.values())
        for i, shard in enumerate(self.shards):
            if i not in self.lost and i not in busy:
                ref = shard.status.remote()
                self._inflight[ref] = i
                self._asked_at[ref] = now
        if not self._inflight:
            return []
        ready, _ = ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=wait_s)
        events = []
        for ref in ready:
            i = self._inflight.pop(ref)
            self._asked_at.pop(ref, None)
            try:
                status = ray.get(ref)
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError) as e:
                # A call under way when the process died fails so even if Ray restarts it:
                # the next call, made after, says whether the actor is gone.
                self._strikes[i] += 1
                if self._strikes[i] >= 2:
                    self.lost[i] = _first_line(e)
                    events.append(
                        f"replay shard {i} ({self.addresses[i]}) is lost for good "
                        f"({self.lost[i]}); going on with {self.live} of {len(self.shards)} "
                        "shards: its stored steps are gone with it, and the env actors write "
                        "new episodes to the others"
                    )
                continue
            except ray.exceptions.RayActorError:  # being restarted: ask again
                continue
            self._strikes[i] = 0
            before = self.status[i]
            self.status[i] = status
            if before is not None and status["pid"] != before["pid"]:
                self.restarts[i] += 1
                moved = (
                    f"now at {status['address']}"
                    if status["address"] != self.addresses[i]
                    else f"at {status['address']}"
                )
                events.append(
                    f"replay shard {i} restarted on its node, on its directory "
                    f"(restart {self.restarts[i]} of replay.max_restarts="
                    f"{self.max_restarts}), {moved}"
                )
            self.addresses[i] = status["address"]
        return events

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``: the shard count, how many are live, the lost ones and why,
        the restarts, and each shard's address, metrics endpoint and node."""
        return {
            "count": len(self.shards),
            "live": self.live,
            "lost": {str(i): why for i, why in sorted(self.lost.items())},
            "restarts": sum(self.restarts),
            "shards": [
                {
                    "shard": i,
                    "address": self.addresses[i],
                    "metrics": (s or {}).get("metrics"),
                    "node_id": (s or {}).get("node_id"),
                    "ip": (s or {}).get("ip"),
                    "restarts": self.restarts[i],
                    "lost": i in self.lost,
                }
                for i, s in enumerate(self.status)
            ],
        }


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond launch", description=__doc__)
    p.add_argument(
        "config",
        nargs="?",
        help="YAML job config, e.g. deploy/configs/cartpole-ppo.yaml (with --resume: "
        "optional, the run's own config.yaml by default)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set run.frames=50000 (repeatable)",
    )
    p.add_argument("--address", help="join a Ray cluster: 'auto' or 'ray://host:port'")
    p.add_argument("--replay", help="use running shards 'host:port,...' instead of starting them")
    p.add_argument("--run-dir", help="write the run here instead of run.dir/NAME-TIMESTAMP")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the stopped job of RUN_DIR: its config (--set changes it, e.g. "
        "run.frames), learner checkpoint, shards and counters",
    )
    return p


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"ray.address={args.address}")
    if args.resume is None and args.config is None:
        raise InvalidConfigError("launch: give a CONFIG file, or --resume RUN_DIR")
    owns_ray = _start_ray_while_importing(args, overrides)
    try:
        launch = _launch(args, overrides, owns_ray)
    except BaseException:
        if owns_ray:
            import ray

            ray.shutdown()
        raise
    summary = launch.run()
    return {"frames": 0, "return": 0, "interrupted": 130}.get(summary["stopped_by"], 1)


def _launch(args: argparse.Namespace, overrides: list[str], owns_ray: bool) -> Launch:
    """The job of the command line, its config checked."""
    from millpond.deploy.launch_config import load_config, resume_config

    if args.resume is None:
        config = load_config(args.config, overrides)
        return Launch(config, replay=args.replay, run_dir=args.run_dir, owns_ray=owns_ray)
    if args.run_dir is not None and Path(args.run_dir).resolve() != Path(args.resume).resolve():
        raise InvalidConfigError(
            f"--run-dir {args.run_dir} and --resume {args.resume}: a resumed job writes "
            "into the run directory it continues"
        )
    config, changes = resume_config(args.resume, args.config, overrides)
    for change in changes:
        print(f"resume: {change}", flush=True)
    return Launch(config, replay=args.replay, run_dir=args.resume, resume=True, owns_ray=owns_ray)


def _init_ray(address: str | None, num_cpus: int | None) -> None:
    """``ray.init`` as a job starts it: its own local instance unless ``address`` names a
    cluster."""
    import ray

    ray.init(
        # "local" and not None: None joins whatever RAY_ADDRESS or the last `ray start` on
        # this machine names, and a job must join a cluster only when told to.
        address=address or "local",
        num_cpus=num_cpus if address is None else None,
        include_dashboard=False,
        logging_level=logging.WARNING,
        configure_logging=True,
    )


#: What the driver imports before its job starts (torch and tensordict among them, ~2 s of
#: CPU): imported in a thread while Ray starts.
_JOB_MODULES = (
    "millpond.deploy.launch_config",
    "millpond.actors.envs",
    "millpond.actors.fleet",
    "millpond.deploy.replay_actor",
    "millpond.deploy.learner_actor",
    "millpond.learner.client",
    "millpond.learner.networks",
)


def _start_ray_while_importing(args: argparse.Namespace, overrides: list[str]) -> bool:
    """Start Ray in this (the main) thread while another imports the job's modules; whether
    Ray was started.

    Ray's start is mostly waiting for its own processes, the imports mostly Python: side by
    side they take ~1.5 s less than one after the other. The ``ray`` section is read from
    the file as it stands (the whole config is checked after, and a bad one stops Ray
    again); where it cannot be read plainly, or Ray runs already, nothing starts here.
    """
    import importlib

    try:
        path = args.config if args.config is not None else Path(args.resume) / "config.yaml"
        section = read_config_doc(path, overrides).get("ray", {})
    except (MillpondError, OSError):
        return False
    section = {} if section is None else section
    address = section.get("address") if isinstance(section, dict) else None
    num_cpus = section.get("num_cpus") if isinstance(section, dict) else None
    plain = (
        isinstance(section, dict)
        and set(section) <= {"address", "num_cpus"}
        and (address is None or (isinstance(address, str) and address.strip() != ""))
        and (num_cpus is None or (type(num_cpus) is int and num_cpus >= 1))
    )
    if not plain:
        return False

    def load() -> None:
        for name in _JOB_MODULES:
            # An import that fails here fails again, with its traceback, where it is used.
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    importer = threading.Thread(target=load, name="millpond-imports", daemon=True)
    importer.start()
    try:
        import ray

        if ray.is_initialized():  # a program's own Ray: Launch joins it
            return False
        _init_ray(address, num_cpus)
    finally:
        importer.join()
    return True
