"""The collection loop: a gymnasium vector env of ``P`` lanes, a policy, segments to a sink.

Nothing here imports Ray: an env actor is a thin Ray wrapper around a :class:`Collector`,
and the loop is tested without a cluster.

**The batch.** :meth:`Collector.collect` returns the next chunk as a TED TensorDict
``[P, T]`` (TorchRL's collector shape): observations at the root (``"observation"``, or
the keys of a ``Dict`` observation space), ``"action"``, ``"policy_version"`` (int64, the
weight version that chose the action; ``-1`` before any weights were loaded), and
``"sample_log_prob"`` / ``"state_value"`` when the policy gives them; under ``"next"``
the true next observations, ``"reward"`` (float32 ``[P, T, 1]``) and ``"terminated"``,
``"truncated"``, ``"done"`` (bool ``[P, T, 1]``); under ``"collector"``, ``"traj_ids"``
(the episode id) and ``"step_count"`` (the step's index within its episode). Lane ``p``'s
row ``t`` is its ``t``-th real step of the chunk, and its row ``0`` follows its row
``T - 1`` of the previous chunk.

**Autoreset.** The loop reads the vector env's ``metadata["autoreset_mode"]`` (gymnasium
1.x; NEXT_STEP when absent, as gymnasium specifies):

- SAME_STEP: a step that ends an episode returns the reset observation, and the real final
  observation in ``info["final_obs"]``; the loop records the final one as the step's next
  observation and acts on the reset one next. Every env step is a real step.
- NEXT_STEP (gymnasium's default): a step that ends an episode returns the final
  observation; the lane's *next* ``step()`` call ignores its action and returns the reset
  observation with reward 0. That call is not a transition and is never recorded. Lanes
  therefore advance unevenly. Choice: :meth:`~Collector.collect` steps the env until every
  lane has ``T`` real steps, keeps the real steps a lane made beyond ``T`` in a per-lane
  carry-over buffer, and opens that lane's next chunk with them. Each lane thus gets exactly
  ``T`` consecutive real steps per chunk, the ``[P, T]`` shape needs no padding or mask,
  and nothing is dropped or recorded twice. (Recording a fixed number of env steps per
  chunk instead would give lanes different lengths; dropping the extra steps would lose
  data.) The cost: the buffer holds the difference in real steps between the fastest and
  slowest lanes (:attr:`Collector.surplus`), a random walk for identically distributed
  lanes, and growing steadily when lanes' episode lengths differ systematically. A
  warning is logged once when it exceeds a chunk.
- DISABLED: rejected (the loop would have to reset lanes itself).

Because SAME_STEP wastes no env step and needs no buffer, envs the loop builds from an id
use it unless ``autoreset_mode`` says otherwise; envs passed in keep their own mode.

**Segments.** :meth:`Collector.write` cuts a batch at episode ends and at the chunk end
(:func:`~millpond.segmenting.cut_batch`), runs the experience processors and sends
what they return through the sink's ``write_segment(steps, tail, episode_id=...,
first_step=...)`` (or ``write_segments`` for several): each observation is sent once. With
no processors and a sink that has ``write_packed`` (a :class:`millpond.Writer`, a
:class:`~millpond.service.TableSink`), the chunk goes out as columns instead
(:func:`~millpond.segmenting.pack_batch`): the same segments, without building one
object per segment.

**Priorities.** With ``priorities`` (an :class:`~millpond.actors.apex.ApexPriorities`, or
any callable ``(policy, packed) -> float64 [num_steps]``), every write goes to the sink's
``write_packed`` with each step's initial priority computed by the actor's current policy
(Ape-X): for a prioritized table.

**Episode ids** are ``episode_id_base + counter``; see :mod:`millpond.actors.episode_ids`
for a base unique to each actor incarnation. A segment's ``first_step`` is the index of its
first step within its episode.

**Weights.** With a ``weight_source`` (anything with ``get_weights(min_version,
timeout_s=0) -> (state_dict | None, version)``, such as a :class:`millpond.ReplayClient`),
the loop asks for a version newer than the one acting (one cheap call when nothing changed)
when a chunk starts, every ``weight_sync_every`` env steps within it, and when its last step
is acted, and loads it into the policy before the next step. Each answer also says how far
the acting weights trailed the newest (:class:`~millpond.actors.acting_lag.ActingLag`,
:attr:`Collector.acting_lag`). With an ``actor_name``, the calls tell a
:class:`millpond.ReplayClient`'s rendezvous which version this actor acts with, and when it
stops acting to write: a learner that publishes with ``max_lag`` waits for it (bounded
staleness, see :mod:`millpond.service.weights`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict

from millpond.checks import check_int
from millpond.errors import InvalidConfigError, MillpondError, ShardUnavailableError
from millpond.roles import SegmentSink, WeightSource
from millpond.segmenting import cut_batch, pack_batch
from millpond.segments import PackedSegments, Segment, pack
from millpond.spec import Key

from .acting_lag import ActingLag
from .action_noise import ActionNoise
from .envs import (
    EnvSpec,
    WrapperSpec,
    autoreset_mode_of,
    check_observation_space,
    make_vector_env,
    observation_leaves,
)
from .episode_ids import EPISODES_PER_INCARNATION
from .lanes import LaneBuffer
from .policies import ActorPolicy, EpsilonGreedy, PolicySpec, make_policy
from .processors import ExperienceProcessor, PassThrough, ProcessorChain

__all__ = ["Collector", "PriorityFn"]

#: ``priorities(policy, packed)``: each step's initial priority, float64 ``[num_steps]``.
PriorityFn = Callable[[ActorPolicy, PackedSegments], np.ndarray]

logger = logging.getLogger("millpond.actors")


class Collector:
    """Steps a vector env with a policy, in chunks of ``[P, T]`` real steps, and writes segments.

    Args:
        env: a gymnasium env id (built with ``gymnasium.make_vec``), a ``VectorEnv``, or a
            callable returning one.
        sink: where segments go (a :class:`millpond.Writer`, a
            :class:`~millpond.service.TableSink`, ...); ``None`` to only :meth:`collect`.
        num_envs: ``P``, the number of lanes (required with an env id; checked otherwise).
        chunk_len: ``T``, the real steps each lane contributes to a chunk.
        vectorization_mode: ``"sync"``, ``"async"`` or ``"vector_entry_point"`` (the vector
            env the id registers, e.g. CartPole-v1's; env ids only).
        autoreset_mode: ``"same_step"`` or ``"next_step"`` for envs built from an id
            (``None``: the vectorizer's default, NEXT_STEP).
        env_kwargs: keyword arguments for the env constructor (e.g. ``max_episode_steps``).
        env_wrappers: gymnasium wrappers applied in order to each lane's env (env ids
            only): :class:`~millpond.actors.envs.WrapperSpec` or ``{"path", "kwargs"}``
            mappings, e.g. Atari's ``AtariPreprocessing`` and ``FrameStackObservation``.
        policy: ``None`` (random actions), an ``nn.Module``, a factory or
            ``"package.module:function"``; see :mod:`millpond.actors.policies`.
        policy_kwargs: keyword arguments for the policy factory.
        deterministic: act with the policy's mode instead of sampling.
        epsilon: epsilon-greedy exploration (``Discrete`` actions).
        noise: Gaussian or Ornstein-Uhlenbeck exploration noise (``Box`` actions; an
            Ornstein-Uhlenbeck lane's state is reset when the lane begins an episode).
        weight_source: where to get new weights from (see the module docstring).
        weight_sync_every: env steps between checks for new weights within a chunk (a
            chunk's start and end are checked too).
        actor_name: this actor's name to the weight source (a :class:`millpond.ReplayClient`),
            for bounded staleness; ``""``: anonymous checks.
        processors: experience processors, run in order (default: store everything).
        episode_id_base: this actor's first episode id (see
            :func:`~millpond.actors.episode_ids.episode_id_base`).
        priorities: computes each written step's initial priority (see the module
            docstring); needs a sink with ``write_packed`` and a policy (not random).
        seed: seeds the env (lane ``i`` gets ``seed + i``) and the policy's sampling.
    """

    def __init__(
        self,
        env: EnvSpec,
        sink: SegmentSink | None = None,
        *,
        num_envs: int | None = None,
        chunk_len: int = 64,
        vectorization_mode: str = "sync",
        autoreset_mode: str | None = "same_step",
        env_kwargs: Mapping[str, Any] | None = None,
        env_wrappers: Sequence[WrapperSpec | Mapping[str, Any]] | None = None,
        policy: PolicySpec = None,
        policy_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        epsilon: EpsilonGreedy | None = None,
        noise: ActionNoise | None = None,
        weight_source: WeightSource | None = None,
        weight_sync_every: int = 100,
        actor_name: str = "",
        processors: ExperienceProcessor | Sequence[ExperienceProcessor] | None = None,
        episode_id_base: int = 0,
        priorities: PriorityFn | None = None,
        seed: int | None = None,
    ) -> None:
        check_int("chunk_len", chunk_len, 1)
        check_int("weight_sync_every", weight_sync_every, 1)
        check_int("episode_id_base", episode_id_base, 0)
        if num_envs is not None:
            check_int("num_envs", num_envs, 1)
        if sink is not None and not (
            callable(getattr(sink, "write_segment", None))
            and callable(getattr(sink, "flush", None))
        ):
            raise InvalidConfigError(f"sink ({sink!r}) needs write_segment() and flush() methods")
        if priorities is not None and (
            policy is None
            or (sink is not None and not callable(getattr(sink, "write_packed", None)))
        ):
            raise InvalidConfigError(
                "priorities need a policy (not random actions) and a sink with write_packed()"
            )
        if weight_source is not None and not callable(getattr(weight_source, "get_weights", None)):
            raise InvalidConfigError(f"weight_source ({weight_source!r}) has no get_weights()")
        if not isinstance(actor_name, str):
            raise InvalidConfigError(f"actor_name ({actor_name!r}) must be a string")
        if processors is None:
            self.processor: ExperienceProcessor = PassThrough()
        elif isinstance(processors, ExperienceProcessor):
            self.processor = processors
        else:
            self.processor = ProcessorChain(*processors)
        self.env, self._owns_env = make_vector_env(
            env, num_envs, vectorization_mode, autoreset_mode, env_kwargs, env_wrappers
        )
        try:
            self.num_envs = int(self.env.num_envs)
            if num_envs is not None and num_envs != self.num_envs:
                raise InvalidConfigError(
                    f"num_envs ({num_envs}) but the env has {self.num_envs} lanes"
                )
            self.autoreset_mode = autoreset_mode_of(self.env)
            check_observation_space(self.env.single_observation_space)
            if weight_source is not None and policy is None:
                raise InvalidConfigError("a weight_source needs a policy with weights, not None")
            self.policy = make_policy(
                policy,
                self.env.single_observation_space,
                self.env.single_action_space,
                self.num_envs,
                policy_kwargs=policy_kwargs,
                deterministic=deterministic,
                epsilon=epsilon,
                noise=noise,
                seed=seed,
            )
        except BaseException:
            if self._owns_env:
                self.env.close()
            raise
        self.chunk_len = chunk_len
        self.sink = sink
        self.weight_source = weight_source
        self.weight_sync_every = weight_sync_every
        self.actor_name = actor_name
        #: the acting lag of the steps acted so far (see :mod:`millpond.actors.acting_lag`)
        self.acting_lag = ActingLag()
        self._steps_since_check = 0
        self._frames_at_check = 0
        self.episode_id_base = episode_id_base
        self.priorities = priorities
        self.seed = seed
        # Loop state, set up by the first collect().
        self._started = False
        self._obs: dict[Key, torch.Tensor] = {}
        self._episode_ids = np.zeros(self.num_envs, dtype=np.int64)
        self._step_counts = np.zeros(self.num_envs, dtype=np.int64)
        self._resetting = np.zeros(self.num_envs, dtype=bool)
        self._buffer = LaneBuffer(self.num_envs, chunk_len)  # real steps, by lane
        self._all_lanes = np.ones(self.num_envs, dtype=bool)  # read-only: SAME_STEP's mask
        self._no_observations = TensorDict(batch_size=[self.num_envs])
        self._version_column = torch.full((self.num_envs,), -1, dtype=torch.int64)
        self._warned_surplus = False
        self._closed = False
        self.episodes = 0  # episodes started (ids handed out)
        self.frames = 0  # real steps recorded
        self.env_steps = 0  # vector env step() calls
        self.chunks = 0
        self.steps_written = 0
        self.segments_written = 0

    # -- public API ----------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The weight version acting now (``-1`` before any weights were loaded)."""
        return self.policy.version

    @property
    def surplus(self) -> np.ndarray:
        """Real steps per lane waiting for the next chunk (non-zero only with NEXT_STEP)."""
        return self._buffer.counts

    def collect(self) -> TensorDict:
        """Step the env until every lane has ``T`` new real steps; return them as ``[P, T]``."""
        self._check_open()
        if not self._started:
            self._start()
        self._check_weights(acting=True)
        while not self._buffer.ready:
            self._buffer.append(*self._step())
        # The chunk's last step is acted: the lag up to here is exact, and until the next
        # chunk this actor writes (perhaps waiting on the learner) instead of acting.
        self._check_weights(acting=False)
        batch = self._buffer.take()
        surplus = int(self._buffer.counts.max())
        if surplus > self.chunk_len and not self._warned_surplus:
            self._warned_surplus = True
            logger.warning(
                "lanes of the NEXT_STEP vector env drift apart: %d real steps wait for the next "
                "chunk in one lane (chunk_len %d); autoreset_mode='same_step' avoids this",
                surplus,
                self.chunk_len,
            )
        self.chunks += 1
        return batch

    def write(self, batch: TensorDict) -> int:
        """Cut ``batch`` into segments, process them and write them; returns the steps written."""
        if self.sink is None:
            raise InvalidConfigError("this Collector has no sink to write to")
        if type(self.processor) is PassThrough and getattr(self.sink, "write_packed", None):
            # Nothing to process: the chunk's rows go out as columns, without segment objects.
            return self._write_packed(pack_batch(batch))
        return self._emit_all(
            [out for segment in cut_batch(batch) for out in self.processor.process(segment)]
        )

    def run_chunk(self) -> TensorDict:
        """Collect one chunk, write it, and return it."""
        batch = self.collect()
        self.write(batch)
        return batch

    def run(self, num_chunks: int) -> int:
        """Collect and write ``num_chunks`` chunks; returns the steps written."""
        before = self.steps_written
        for _ in range(num_chunks):
            self.run_chunk()
        return self.steps_written - before

    def sync_weights(self, timeout_s: float = 0) -> bool:
        """Load a newer version from the weight source if it has one; whether it did (a
        source that cannot be reached now has none)."""
        return self._check_weights(timeout_s, acting=True)

    def _check_weights(self, timeout_s: float = 0, *, acting: bool) -> bool:
        """Ask for a newer version, count the acting lag of the steps since the last check,
        load it if there is one; whether it did."""
        if self.weight_source is None:
            return False
        own = self.policy.version
        try:
            if self.actor_name:
                state_dict, version = self.weight_source.get_weights(
                    own + 1, timeout_s=timeout_s, actor=self.actor_name, acting=acting
                )
            else:
                state_dict, version = self.weight_source.get_weights(own + 1, timeout_s=timeout_s)
        except ShardUnavailableError:  # the rendezvous is restarting: act on, ask again later
            return False  # the steps since the last check count at the next one
        self._steps_since_check = 0
        self.acting_lag.add(self.frames - self._frames_at_check, own, int(version))
        self._frames_at_check = self.frames
        if state_dict is None or version <= own:
            return False
        self.policy.load_state_dict(state_dict)
        self.policy.version = int(version)
        return True

    def start_new_episodes(self) -> None:
        """Give every lane a new episode id, its steps counted from 0 again.

        For a sink that lost the beginnings of the episodes under way (an env actor whose
        shard was lost for good writes on to another one): the steps that follow are
        stored as new episodes, never as the continuation of an episode whose first steps
        are not there."""
        if not self._started:
            return
        self._episode_ids[:] = self._new_episode_ids(self.num_envs)
        self._step_counts[:] = 0

    def flush(self, timeout_s: float | None = None) -> int:
        """Write what the processors hold back, then flush the sink; returns steps written.

        ``timeout_s`` bounds the wait for the sink (a writer whose table's rate limiter holds
        inserts back once no learner samples): :class:`DeadlineExceededError` after it.
        """
        written = 0
        if self.sink is not None:
            written = self._emit_all(self.processor.flush())
            if timeout_s is None:
                self.sink.flush()  # sinks of one's own need not take a timeout
            else:
                self.sink.flush(timeout_s=timeout_s)
        return written

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (see :meth:`flush`) and close the env if this collector built it."""
        if self._closed:
            return
        try:
            self.flush(timeout_s=timeout_s)
        finally:
            self._closed = True
            if self._owns_env:
                self.env.close()

    def stats(self) -> dict[str, int]:
        """Counters: frames, env steps, chunks, episodes, steps/segments written, version."""
        return {
            "frames": self.frames,
            "env_steps": self.env_steps,
            "chunks": self.chunks,
            "episodes": self.episodes,
            "steps_written": self.steps_written,
            "segments_written": self.segments_written,
            "policy_version": self.policy.version,
        }

    def __enter__(self) -> Collector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Collector(P={self.num_envs}, T={self.chunk_len}, "
            f"autoreset={self.autoreset_mode.value}, frames={self.frames})"
        )

    # -- the loop ------------------------------------------------------------------------
    def _start(self) -> None:
        obs, _ = self.env.reset(seed=self.seed)
        self._obs = observation_leaves(obs, self.num_envs)
        self._episode_ids[:] = self._new_episode_ids(self.num_envs)
        self._step_counts[:] = 0
        self._resetting[:] = False
        self.policy.reset_lanes(self._all_lanes)
        self._started = True

    def _step(self) -> tuple[dict[Key, torch.Tensor], np.ndarray]:
        """One ``env.step()``: the record of every lane, and which lanes made a real step."""
        lanes = self.num_envs
        if self._steps_since_check >= self.weight_sync_every:
            self._check_weights(acting=True)
        self._steps_since_check += 1
        if self.policy.reads_observations:
            obs_td = TensorDict(batch_size=[lanes])
            for key, value in self._obs.items():
                obs_td.set(key, value)
        else:
            obs_td = self._no_observations
        out = self.policy(obs_td, self.frames)
        action = out["action"]
        next_raw, reward, terminated, truncated, info = self.env.step(action.numpy())
        terminated = np.asarray(terminated, dtype=bool).reshape(lanes)
        truncated = np.asarray(truncated, dtype=bool).reshape(lanes)
        ended = terminated | truncated
        next_obs = observation_leaves(next_raw, lanes)
        true_next = next_obs
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            valid = self._all_lanes
            if ended.any():
                final = info.get("final_obs")
                if final is None:
                    raise MillpondError("a SAME_STEP vector env ended an episode without final_obs")
                lanes_ended = np.flatnonzero(ended)
                finals = [observation_leaves(final[lane]) for lane in lanes_ended.tolist()]
                index = torch.from_numpy(lanes_ended)
                true_next = {
                    key: value.index_put((index,), torch.stack([f[key] for f in finals]))
                    for key, value in next_obs.items()
                }
            begun = ended  # the next action is the first of a new episode
        else:
            valid = ~self._resetting
            if bool((ended & self._resetting).any()):
                raise MillpondError("a NEXT_STEP vector env ended an episode on its reset step")
            begun = self._resetting  # this call reset them; the next action is their first
            self._resetting = ended
        record: dict[Key, torch.Tensor] = dict(self._obs)
        for name, value in out.items():
            if (name,) in record:
                raise InvalidConfigError(
                    f"the policy's output {name!r} clashes with an observation key"
                )
            record[(name,)] = value
        if int(self._version_column[0]) != self.policy.version:
            self._version_column = torch.full((lanes,), self.policy.version, dtype=torch.int64)
        record[("policy_version",)] = self._version_column  # stacked (copied) per chunk
        for key, value in true_next.items():
            record[("next", *key)] = value
        flags = {
            "reward": torch.from_numpy(np.asarray(reward, dtype=np.float32).reshape(lanes, 1)),
            "terminated": torch.from_numpy(terminated.reshape(lanes, 1)),
            "truncated": torch.from_numpy(truncated.reshape(lanes, 1)),
            "done": torch.from_numpy(ended.reshape(lanes, 1)),
        }
        for name, value in flags.items():
            record[("next", name)] = value
        record[("collector", "traj_ids")] = torch.from_numpy(self._episode_ids.copy())
        record[("collector", "step_count")] = torch.from_numpy(self._step_counts.copy())
        # Episode bookkeeping for the lanes that made a real step.
        self._step_counts += valid
        new = valid & ended
        if new.any():
            self._episode_ids[new] = self._new_episode_ids(int(new.sum()))
            self._step_counts[new] = 0
        if begun.any():
            self.policy.reset_lanes(begun)
        self._obs = next_obs
        self.frames += int(valid.sum())
        self.env_steps += 1
        return record, valid

    def _new_episode_ids(self, n: int) -> np.ndarray:
        if self.episodes + n > EPISODES_PER_INCARNATION:
            raise MillpondError(
                f"episode ids of base {self.episode_id_base} are used up "
                f"({EPISODES_PER_INCARNATION}); restart with a new incarnation"
            )
        ids = self.episode_id_base + np.arange(self.episodes, self.episodes + n, dtype=np.int64)
        self.episodes += n
        return ids

    def _write_packed(self, packed: PackedSegments) -> int:
        """Write ``packed`` through the sink's ``write_packed``; with ``priorities``, each
        step's initial priority under the policy acting now goes with it."""
        assert self.sink is not None
        if self.priorities is not None:
            packed.priorities = self.priorities(self.policy, packed)
        self.sink.write_packed(packed)  # type: ignore[attr-defined]
        self.steps_written += packed.num_steps
        self.segments_written += len(packed)
        return packed.num_steps

    def _emit_all(self, segments: Sequence[Segment]) -> int:
        """Write ``segments`` in order: in one call when the sink has ``write_segments``
        (with priorities: as columns, :meth:`_write_packed`)."""
        if self.priorities is not None:
            return self._write_packed(pack(segments)) if segments else 0
        write_many = getattr(self.sink, "write_segments", None)
        if write_many is None or len(segments) < 2:
            return sum(self._emit(s) for s in segments)
        write_many(segments)
        n = sum(int(s.steps.batch_size[0]) for s in segments)
        self.steps_written += n
        self.segments_written += len(segments)
        return n

    def _emit(self, segment: Segment) -> int:
        assert self.sink is not None
        self.sink.write_segment(
            segment.steps,
            segment.tail,
            episode_id=segment.episode_id,
            first_step=segment.first_step,
        )
        n = int(segment.steps.batch_size[0])
        self.steps_written += n
        self.segments_written += 1
        return n

    def _check_open(self) -> None:
        if self._closed:
            raise MillpondError("this Collector is closed")
