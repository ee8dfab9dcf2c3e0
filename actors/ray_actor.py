"""EnvActor: a thin Ray actor around a :class:`~millpond.actors.Collector`.

The actor builds its collector from an :class:`ActorConfig`, writes through a pinned
:class:`millpond.Writer` of the :class:`millpond.ReplayClient` it is given, and pulls new
policy weights from the same client. Started with ``max_restarts``, a killed actor comes
back with a new *incarnation*: fresh episode ids, and a writer that continues its shard's
sequence numbering (the writer handshake), so nothing it sent is stored twice or torn —
what the dead process had not yet sent is lost with it, as with any crash.

When the actor's shard is lost for good (its writer fails with
:class:`~millpond.errors.ShardGoneError`), the actor writes on to another shard
that is still there: the chunk being written is dropped (with what the lost shard had not
acknowledged), and every lane starts a new episode id, so that no episode is split across
shards: the new shard holds whole episodes from their first stored step.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from millpond.actors.action_noise import ActionNoise
from millpond.actors.collector import Collector, PriorityFn
from millpond.actors.envs import WrapperSpec, check_wrappers
from millpond.actors.episode_ids import INCARNATIONS_PER_ACTOR, episode_id_base
from millpond.actors.episode_stats import ReturnTracker
from millpond.actors.policies import EpsilonGreedy
from millpond.actors.processor_specs import ProcessorSpec, build_processors, check_processors
from millpond.actors.processors import ExperienceProcessor, PassThrough
from millpond.allocator import keep_freed_buffers
from millpond.errors import DeadlineExceededError, InvalidConfigError, ShardGoneError
from millpond.learner.client import ReplayClient

log = logging.getLogger("millpond.actors")


@dataclass(frozen=True)
class ActorConfig:
    """What every env actor of a fleet runs.

    Attributes:
        env: gymnasium env id (or a picklable factory returning a vector env).
        table: the replay table the actors write to.
        num_envs: lanes per actor (``P``).
        chunk_len: real steps per lane per chunk (``T``).
        vectorization_mode: ``"sync"``, ``"async"`` or ``"vector_entry_point"``.
        autoreset_mode: ``"same_step"``, ``"next_step"`` or ``None`` (the vector env's own).
        env_kwargs: keyword arguments for the env (e.g. ``max_episode_steps``).
        env_wrappers: gymnasium wrappers applied in order to each lane's env (env ids only):
            :class:`~millpond.actors.envs.WrapperSpec` or ``{"path": ..., "kwargs": ...}``
            mappings, each checked here (imported, its keyword arguments matched against
            its signature) and built anew in every actor.
        policy: ``None`` (random), or ``"package.module:function"`` / a picklable factory.
        policy_kwargs: keyword arguments for the policy factory.
        deterministic: act with the policy's mode instead of sampling.
        epsilon: epsilon-greedy exploration for discrete actions.
        noise: Gaussian or Ornstein-Uhlenbeck exploration noise for Box actions.
        weight_sync_every: env steps between checks for newer published weights.
        processors: the experience processors of one actor, run in order: processor specs
            (:class:`~millpond.actors.processor_specs.ProcessorSpec`, or ``{"path": ...,
            "kwargs": ...}`` mappings), each checked here by building it once and built
            anew in every actor; or a picklable callable returning the processors.
        max_in_flight: unacknowledged segments a writer allows before it blocks.
        priorities: each written step's initial priority from the actor's policy, e.g.
            :class:`~millpond.actors.apex.ApexPriorities` (Ape-X, for a prioritized table);
            ``None``: the table's rule for new steps.
        seed: base seed; actor ``i`` uses ``seed + 1000 * i``.
    """

    env: Any
    table: str
    num_envs: int = 8
    chunk_len: int = 64
    vectorization_mode: str = "sync"
    autoreset_mode: str | None = "same_step"
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    env_wrappers: Sequence[WrapperSpec | Mapping[str, Any]] = ()
    policy: Any = None
    policy_kwargs: Mapping[str, Any] = field(default_factory=dict)
    deterministic: bool = False
    epsilon: EpsilonGreedy | None = None
    noise: ActionNoise | None = None
    weight_sync_every: int = 100
    processors: (
        Sequence[ProcessorSpec | Mapping[str, Any]]
        | Callable[[], Sequence[ExperienceProcessor]]
        | None
    ) = None
    max_in_flight: int = 64
    priorities: PriorityFn | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.table, str) or not self.table:
            raise InvalidConfigError(f"table ({self.table!r}) must be a table name")
        for name in ("num_envs", "chunk_len", "weight_sync_every", "max_in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"{name} ({value!r}) must be a positive integer")
        # A bad wrapper fails here, not in every actor.
        object.__setattr__(self, "env_wrappers", check_wrappers(self.env_wrappers, "env_wrappers"))
        if self.processors is not None and not callable(self.processors):
            # A bad spec fails here, not in every actor.
            object.__setattr__(self, "processors", check_processors(self.processors))

    def make_processors(self) -> ExperienceProcessor | list[ExperienceProcessor] | None:
        """New processors for one actor (``None``: the loop's default, store everything)."""
        if self.processors is None:
            return None
        if callable(self.processors):
            return list(self.processors())
        # PassThrough changes nothing; alone, the loop's default keeps its packed fast path.
        built = [p for p in build_processors(self.processors) if type(p) is not PassThrough]
        return None if not built else built[0] if len(built) == 1 else built


class EnvActor:
    """The body of the Ray actor (``ray.remote(EnvActor)``); plain Python, testable as is.

    Args:
        actor_index: this actor's number in its fleet (part of its episode ids).
        client: the replay service (pickled as its addresses).
        config: what to run.
        incarnation: ``None`` to choose it: 0 on a first start, a random non-zero value after
            Ray restarted the actor (Ray does not count restarts for the actor itself).
    """

    def __init__(
        self,
        actor_index: int,
        client: ReplayClient,
        config: ActorConfig,
        incarnation: int | None = None,
    ) -> None:
        torch.set_num_threads(1)  # tiny forward passes: threads cost more than they give
        keep_freed_buffers()
        if incarnation is None:
            incarnation = _incarnation()
        self.actor_index = actor_index
        self.incarnation = incarnation
        self.client = client
        self._config = config
        self.lost_shards: list[int] = []  # shards this actor found lost for good
        # Actor i writes to shard i % S, so a few actors spread over the shards evenly (and a
        # restarted actor finds its numbering on the same shard).
        self.writer = self._writer(actor_index % client.num_shards)
        seed = None if config.seed is None else config.seed + 1000 * actor_index
        self.collector = Collector(
            config.env,
            self.writer,
            num_envs=config.num_envs,
            chunk_len=config.chunk_len,
            vectorization_mode=config.vectorization_mode,
            autoreset_mode=config.autoreset_mode,
            env_kwargs=dict(config.env_kwargs),
            env_wrappers=config.env_wrappers,
            policy=config.policy,
            policy_kwargs=dict(config.policy_kwargs),
            deterministic=config.deterministic,
            epsilon=config.epsilon,
            noise=config.noise,
            weight_source=client if config.policy is not None else None,
            weight_sync_every=config.weight_sync_every,
            actor_name=f"actor-{actor_index}",
            processors=config.make_processors(),
            episode_id_base=episode_id_base(actor_index, incarnation),
            priorities=config.priorities,
            seed=seed,
        )
        self.returns = ReturnTracker(self.collector.num_envs)
        self._busy_s = 0.0
        self._act_s = 0.0  # stepping the env and the policy
        self._write_s = 0.0  # cutting, processing and handing segments to the writer

    def _writer(self, shard: int) -> Any:
        return self.client.writer(
            self._config.table,
            writer_id=f"actor-{self.actor_index}",
            max_in_flight=self._config.max_in_flight,
            shard=shard,
            # The table's rate limiter paces an actor for as long as the learner needs, and a
            # write given up halfway through a chunk would tear its episodes: the fleet
            # bounds the actor's close instead.
            timeout_s=None,
        )

    def _write_elsewhere(self, error: ShardGoneError) -> None:
        """The writer's shard is lost for good: write on to a shard still there, every lane
        starting a new episode (see the module docstring)."""
        lost = self.writer.shard_index
        self.lost_shards.append(lost)
        gone = set(self.client.lost_shards) | set(self.lost_shards)
        live = [i for i in range(self.client.num_shards) if i not in gone]
        if not live:
            raise error
        target = live[self.actor_index % len(live)]
        with contextlib.suppress(Exception):  # it failed already: close only ends its thread
            self.writer.close(timeout_s=0)
        log.warning(
            "env actor %d: shard %d is lost for good (%s); writing to shard %d, new episodes "
            "on every lane",
            self.actor_index,
            lost,
            error,
            target,
        )
        self.writer = self._writer(target)
        self.collector.sink = self.writer
        self.collector.start_new_episodes()

    def run(self, num_chunks: int = 1, seconds: float = 0.0) -> dict[str, Any]:
        """Collect and write ``num_chunks`` chunks, and more until ``seconds`` have passed;
        returns what happened (see :meth:`status`), with ``new_frames``, ``elapsed_s``,
        ``finished_episodes`` and ``acting_lag`` (the
        :class:`~millpond.actors.acting_lag.ActingLag` counts of this call)."""
        frames_before = self._chunk_frames()
        start = time.perf_counter()
        done = 0
        while done < num_chunks or time.perf_counter() - start < seconds:
            done += 1
            t0 = time.perf_counter()
            batch = self.collector.collect()
            t1 = time.perf_counter()
            try:
                self.collector.write(batch)  # blocks while the window or the table is full
            except ShardGoneError as e:
                self._write_elsewhere(e)
            self._act_s += t1 - t0
            self._write_s += time.perf_counter() - t1
            self.returns.update(batch)
        elapsed = time.perf_counter() - start
        self._busy_s += elapsed
        report = self.status()
        report["new_frames"] = self._chunk_frames() - frames_before
        report["elapsed_s"] = elapsed
        report["finished_episodes"] = self.returns.drain()
        report["acting_lag"] = self.collector.acting_lag.drain()
        return report

    def _chunk_frames(self) -> int:
        # Frames handed out in chunks. With NEXT_STEP autoreset the loop may hold a few real
        # steps of its fastest lanes for the next chunk; those count once that chunk is out.
        c = self.collector
        return c.chunks * c.num_envs * c.chunk_len

    def status(self) -> dict[str, Any]:
        """Counters of this incarnation: frames, episodes, returns, writer and policy state."""
        stats = self.collector.stats()
        stats["frames"] = self._chunk_frames()
        return {
            "actor_index": self.actor_index,
            "incarnation": self.incarnation,
            **stats,
            "mean_return": self.returns.mean_return,
            "frames_per_s": stats["frames"] / self._busy_s if self._busy_s else 0.0,
            "act_s": self._act_s,
            "write_s": self._write_s,
            "segments_acked": self.writer.acked,
            "segments_pending": self.writer.pending,
            "shard": getattr(self.writer, "shard_index", None),
            # The writer's shard unreachable: since when (None while it answers), how often
            # and for how long in all.
            "writer_unavailable_s": getattr(self.writer, "unavailable_s", None),
            "writer_outages": getattr(self.writer, "outages", 0),
            "writer_unavailable_total_s": getattr(self.writer, "unavailable_total_s", 0.0),
            "lost_shards": list(self.lost_shards),
        }

    def close(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Flush processors and the writer, release the env; returns the final status.

        With ``timeout_s``, what is still unacknowledged after it (say, inserts that a
        rate limiter holds back once the learner stopped) is dropped.
        """
        try:
            self.collector.close(timeout_s=timeout_s)
        except (DeadlineExceededError, ShardGoneError):
            pass  # the writer drops what is left just below
        finally:
            with contextlib.suppress(DeadlineExceededError, ShardGoneError):
                self.writer.close(timeout_s=None if timeout_s is None else 0.0)
        return self.status()


def _incarnation() -> int:
    try:
        import ray

        with warnings.catch_warnings():  # Ray deprecates an attribute this property reads
            warnings.simplefilter("ignore", DeprecationWarning)
            reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # not inside a Ray actor
        reconstructed = False
    if not reconstructed:
        return 0
    # A random non-zero incarnation: two restarts of one actor collide with probability
    # 1/4095, which would only make them share episode-id ranges, not data.
    return 1 + secrets.randbelow(INCARNATIONS_PER_ACTOR - 1)
