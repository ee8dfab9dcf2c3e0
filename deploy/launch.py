"""``millpond launch CONFIG``: replay shards, env actors and a learner on Ray, to a frame budget.

The job, in the order it starts:

1. Ray: a local instance by default; ``--address auto`` / ``ray://host:port`` joins a cluster.
2. The replay service: ``replay.shards`` :class:`~millpond.deploy.replay_actor.ReplayShardActor`
   Ray actors, each serving one shard over gRPC (or, with ``--replay host:port,...``, an
   already running ``millpond serve``), and the job's table on every shard.
3. The learner (:class:`~millpond.learner.PPOLearner` or :class:`~millpond.learner.DQNLearner`)
   in this process; it publishes its initial weights before any actor acts.
4. ``actors.num_actors`` env actors (:class:`~millpond.actors.ActorFleet`), driven from a
   background thread, pulling new weights every ``actors.weight_sync_every`` steps.

The main thread runs learner steps and, every ``run.status_every_s``, prints one progress
line and appends a row to ``metrics.csv``. The run stops at ``run.frames`` frames (or
``run.stop_at_return``, ``run.timeout_s``, Ctrl-C, SIGTERM), then shuts down in order:
actors stopped and flushed, learner checkpoint written, shards checkpointed and stopped, Ray
shut down (if this process started it). The run directory then holds ``config.yaml``,
``metrics.csv``, ``return.png``, ``summary.json`` and ``checkpoint.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from millpond.allocator import keep_freed_buffers
from millpond.deploy.launch_config import LaunchConfig, load_config, to_mapping
from millpond.deploy.run_report import RunReport, format_summary, progress_line
from millpond.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidConfigError,
    MillpondError,
    PermissionDeniedError,
)

__all__ = ["Launch", "build_parser", "run"]

log = logging.getLogger("millpond.launch")


class _Stop(Exception):
    """SIGTERM, turned into an exception in the main thread so that shutdown runs."""


class Launch:
    """One ``millpond launch`` job (see the module docstring).

    Args:
        config: the checked job config.
        replay: addresses of running shards to use instead of starting them.
        run_dir: where the run writes; ``None``: ``run.dir/NAME-YYYYmmdd-HHMMSS``.
        out: where progress lines go.
    """

    def __init__(
        self,
        config: LaunchConfig,
        *,
        replay: str | None = None,
        run_dir: str | Path | None = None,
        out: Any = None,
    ) -> None:
        self.config = config
        self.replay = replay
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or Path(config.run.dir) / f"{config.name}-{stamp}")
        self.out = out or sys.stdout
        self._started_ray = False
        self._ray_info: dict[str, Any] = {}  # the cluster the job ran on
        self.network: str | None = None  # the learner's network family, once chosen
        self._shards: list[Any] = []
        self._fleet: Any = None
        self._fleet_thread: threading.Thread | None = None
        self._fleet_error: BaseException | None = None
        self._halt = threading.Event()
        self._timing = {"sample_s": 0.0, "learn_s": 0.0}
        self._lags: deque[float] = deque(maxlen=50)
        self._losses: deque[float] = deque(maxlen=50)
        self.learner_steps = 0
        self.stale_steps = 0  # sampled, then dropped as acted by too old a policy (PPO)
        self._started_at = time.monotonic()
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
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(c), sort_keys=False))
        report = RunReport(self.run_dir)
        reason = "error"  # until the loop says otherwise
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _raise_stop)
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
                    signal.signal(signal.SIGTERM, previous)
        return summary

    def _start(self) -> None:
        import ray

        from millpond.actors.envs import make_env
        from millpond.actors.fleet import ActorFleet
        from millpond.learner.client import ReplayClient

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
        torch.manual_seed(c.run.seed)
        torch.set_num_threads(c.learner.threads)
        if not ray.is_initialized():
            ray.init(
                # "local" and not None: None joins whatever RAY_ADDRESS or the last `ray start`
                # on this machine names, and a job must join a cluster only when told to.
                address=c.ray.address or "local",
                num_cpus=c.ray.num_cpus if c.ray.address is None else None,
                include_dashboard=False,
                logging_level=logging.WARNING,
                configure_logging=True,
            )
            self._started_ray = True
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _raise_stop)  # ray.init installs its own
        self._ray_info = {"gcs_address": ray.get_runtime_context().gcs_address}
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        addresses = self.replay or self._start_shards()
        admin_token, writer_token = c.replay.tokens()
        self.client = ReplayClient(addresses, token=admin_token, tls=c.replay.tls)
        actor_client = self.client
        if writer_token != admin_token:  # the actors get the least privilege the file offers
            actor_client = ReplayClient(addresses, token=writer_token, tls=c.replay.tls)
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

        self.learner = self._make_learner(obs_space, act_space)
        self.learner.publish()  # actors act with the learner's initial weights

        self._fleet = ActorFleet(
            actor_client,
            self._actor_config(),
            num_actors=c.actors.num_actors,
            num_cpus=c.actors.num_cpus,
            max_restarts=c.actors.max_restarts,
        )
        self._fleet_thread = threading.Thread(target=self._drive_fleet, daemon=True)
        self._fleet_thread.start()
        self._say(
            f"started {c.actors.num_actors} env actors x {c.actors.num_envs} {c.env.id} envs, "
            f"{c.learner.algorithm} learner; run dir {self.run_dir}"
        )

    def _start_shards(self) -> str:
        import ray

        from millpond.deploy.replay_actor import ReplayShardActor
        from millpond.service.server import ServerConfig

        c = self.config
        host = "127.0.0.1" if c.ray.address is None else "0.0.0.0"
        token_file = c.replay.token_file
        remote = ray.remote(ReplayShardActor).options(num_cpus=c.replay.num_cpus)
        for i in range(c.replay.shards):
            server = ServerConfig(
                dir=str((self.run_dir / "replay" / f"shard-{i}").resolve()),
                host=host,
                port=0,
                max_message_mb=c.replay.max_message_mb,
                token_file=None if token_file is None else str(Path(token_file).resolve()),
            )
            self._shards.append(remote.remote(server))
        try:
            addresses = ray.get(
                [s.address.remote() for s in self._shards], timeout=c.replay.start_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            for shard in self._shards:  # unplaced actors would make shutdown wait for them
                ray.kill(shard)
            self._shards.clear()
            needed = c.replay.shards * c.replay.num_cpus
            raise MillpondError(
                f"replay shards did not start within replay.start_timeout_s="
                f"{c.replay.start_timeout_s:g} s: they need {needed:g} CPUs free in the Ray "
                f"cluster (replay.shards x replay.num_cpus); see `ray status`"
            ) from None
        return ",".join(addresses)

    def _make_learner(self, obs_space: Any, act_space: Any) -> Any:
        from millpond.learner.dqn import DQNLearner
        from millpond.learner.networks import (
            mlp_critic,
            mlp_policy,
            mlp_q,
            nature_cnn_actor_critic,
            nature_cnn_q,
            network_for,
        )
        from millpond.learner.ppo import PPOLearner

        c = self.config.learner
        hidden = tuple(c.hidden_sizes)
        try:
            self.network = network_for(obs_space, c.network)
        except InvalidConfigError as e:
            raise InvalidConfigError(f"learner.network: {e}") from None
        cnn = self.network == "nature_cnn"
        # Short sample waits keep the loop responsive to the budget and to signals.
        if c.algorithm == "ppo":
            cfg = replace(c.ppo, sample_timeout_s=c.ppo.sample_timeout_s or 2.0)
            if cnn:
                policy, critic = nature_cnn_actor_critic(obs_space, act_space)
            else:
                policy = mlp_policy(obs_space, act_space, hidden)
                critic = mlp_critic(obs_space, hidden)
            return PPOLearner(self.client, self.table, cfg, policy, critic)
        cfg = replace(c.dqn, sample_timeout_s=c.dqn.sample_timeout_s or 2.0)
        q = nature_cnn_q(obs_space, act_space) if cnn else mlp_q(obs_space, act_space, hidden)
        return DQNLearner(self.client, self.table, cfg, q)

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
        c = self.config
        started = self._started_at = time.monotonic()
        next_status = started + c.run.status_every_s
        next_checkpoint = started + c.learner.checkpoint_every_s
        self._last = {"t": started, "frames": 0, "inserts": 0, "samples": 0}
        self._base = self._counters()
        while True:
            if self._fleet_error is not None:
                raise MillpondError(f"env actors failed: {self._fleet_error}")
            status = self._fleet.status
            if status.frames >= c.run.frames:
                return "frames"
            if c.run.timeout_s is not None and time.monotonic() - started > c.run.timeout_s:
                return "timeout"
            if c.run.stop_at_return is not None and (
                status.episodes >= c.run.return_window
                and (status.mean_return or -math.inf) >= c.run.stop_at_return
            ):
                return "return"
            self._learner_step()
            now = time.monotonic()
            if now >= next_status:
                next_status = now + c.run.status_every_s
                row = self._status_row(now - started)
                report.record(row)
                self._say(progress_line(row, c.run.frames))
            if now >= next_checkpoint:  # a crash loses at most this much learning
                next_checkpoint = now + c.learner.checkpoint_every_s
                self._save_checkpoint()

    def _learner_step(self) -> None:
        t0 = time.perf_counter()
        try:
            metrics = self.learner.step()
        except DeadlineExceededError:  # not enough new experience yet: wait for the actors
            self._timing["sample_s"] += time.perf_counter() - t0
            return
        self._timing["sample_s"] += metrics["sample_s"]
        self._timing["learn_s"] += metrics["update_s"]
        self.learner_steps += 1
        self.stale_steps += metrics.get("dropped", 0)
        if "policy_lag_mean" in metrics:
            self._lags.append(metrics["policy_lag_mean"])
        loss = metrics.get("loss", metrics.get("loss_policy"))
        if loss is not None:
            self._losses.append(float(loss))

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
            "time_s": round(elapsed, 2),
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
            "weights_version": self.learner.version,
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

        # Each step is guarded so that one failure does not leave the rest running.
        self._halt.set()
        if self._fleet_thread is not None:
            self._fleet_thread.join(timeout=30)
        final = None
        if self._fleet is not None:
            # Short waits: with a rate-limited table, inserts block once the learner stops
            # sampling, and what is not stored by now is not needed.
            with _logged("stopping the env actors"):
                final = self._fleet.stop(timeout_s=5)
        checkpoint = None
        if hasattr(self, "learner"):
            if hasattr(self.learner, "close"):
                self.learner.close()
            with _logged("writing the learner checkpoint"):
                checkpoint = self._save_checkpoint()
        row = None
        if hasattr(self, "client"):
            with _logged("reading the final counters"):
                row = self._status_row(time.monotonic() - self._started_at)
            with _logged("checkpointing the replay service"):
                self.client.checkpoint()
        if self._shards:
            with _logged("stopping the replay shards"):
                ray.get([s.stop.remote() for s in self._shards], timeout=60)
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

    def _save_checkpoint(self) -> Path:
        learner = self.learner
        state = {
            "algorithm": self.config.learner.algorithm,
            "version": learner.version,
            "optimizer": learner.optimizer.state_dict(),
            "config": to_mapping(self.config),
        }
        for name in ("policy", "critic", "q_network", "target_network"):
            module = getattr(learner, name, None)
            if isinstance(module, torch.nn.Module):
                state[name] = module.state_dict()
        path = self.run_dir / "checkpoint.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        return path

    def _summary(
        self, reason: str, final: Any, row: dict[str, Any] | None, checkpoint: Path | None
    ) -> dict[str, Any]:
        elapsed = row["time_s"] if row else None
        actors = final.actors.values() if final is not None else []
        act_s = sum(a.get("act_s", 0.0) for a in actors)
        write_s = sum(a.get("write_s", 0.0) for a in actors)
        return {
            "name": self.config.name,
            "stopped_by": reason,
            "frames": final.frames if final else 0,
            "episodes": final.episodes if final else 0,
            "mean_return": final.mean_return if final else None,
            "wall_s": elapsed,
            "frames_per_s": (final.frames / elapsed) if final and elapsed else None,
            "learner_steps": self.learner_steps,
            "stale_steps": self.stale_steps,
            "weights_version": getattr(getattr(self, "learner", None), "version", None),
            "samples_per_insert": row.get("samples_per_insert") if row else None,
            "actor_restarts": final.restarts if final else 0,
            "actors_act_s": round(act_s, 2),
            "actors_write_s": round(write_s, 2),
            "learner_sample_s": round(self._timing["sample_s"], 2),
            "learner_update_s": round(self._timing["learn_s"], 2),
            "run_dir": str(self.run_dir),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "ray": self._ray_info,
        }

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


@contextlib.contextmanager
def _logged(what: str):
    try:
        yield
    except Exception as e:
        log.error("shutdown: %s failed: %s", what, e)


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond launch", description=__doc__)
    p.add_argument("config", help="YAML job config, e.g. deploy/configs/cartpole-ppo.yaml")
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
    return p


def run(args: argparse.Namespace) -> int:
    keep_freed_buffers()  # the learner runs here: its batches are message-sized buffers
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"ray.address={args.address}")
    config = load_config(args.config, overrides)
    summary = Launch(config, replay=args.replay, run_dir=args.run_dir).run()
    return {"frames": 0, "return": 0, "interrupted": 130}.get(summary["stopped_by"], 1)
