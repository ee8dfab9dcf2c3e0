"""Experience processors: what happens to experience between the env and the buffer.

A processor takes the segments the loop cuts (in order within each episode; episodes of
different lanes interleave) and returns what to store: the segment itself, nothing, or more
(ALF's experience post-processing, in three modes):

- **per step, immediate**: :class:`PassThrough` (the default) stores each segment as it
  comes; :class:`StepFilter` and :class:`EpisodeFilter` drop steps or whole episodes by a
  predicate (e.g. a task id) without holding anything back;
- **per episode, delayed**: an :class:`EpisodeProcessor` holds an episode's segments until
  its last step arrives, then releases the whole episode, changed:
  :class:`EpisodeAnnotator` applies a user function to it (e.g. mark ``success`` on every
  step when the final step succeeded) and :class:`HindsightRelabeler` adds a copy whose
  desired goal is the goal the episode achieved (HER's "final" strategy). Released
  episodes are re-cut into the segments they came in, so episode ids, ``first_step`` and
  tails stay exact;
- **selective**: any of these returns fewer steps than it was given.

:class:`ProcessorChain` runs several in order. The loop writes only what the processors
return, so a table's rate limiter counts experience *after* processing, and a learner's
updates follow the experience that really reached the buffer (steps dropped here never
unblock a samples-per-insert limited learner).

Processors can be named by import path with keyword arguments, in a ``millpond launch``
config or from Python (:mod:`millpond.actors.processor_specs`); :func:`key_in`,
:func:`label_episode` and :func:`sparse_goal_reward` are ready-made callables for the
filters, the annotator and the relabeller.

Predicates and annotations see TED rows (:func:`~millpond.segmenting.to_ted`):
root observations, ``action`` and per-step keys, and under ``"next"`` the true next
observations, ``reward``, ``terminated``, ``truncated`` and ``done``. All segments a
processor returns for one table must have the same keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.segmenting import ends_episode, from_ted, join, to_ted
from millpond.segments import Segment
from millpond.spec import Key

from .episode_ids import HINDSIGHT_EPISODE_OFFSET

__all__ = [
    "HINDSIGHT_EPISODE_OFFSET",
    "EpisodeAnnotator",
    "EpisodeFilter",
    "EpisodeProcessor",
    "ExperienceProcessor",
    "HindsightRelabeler",
    "PassThrough",
    "ProcessorChain",
    "StepFilter",
    "key_in",
    "label_episode",
    "sparse_goal_reward",
]


class ExperienceProcessor(ABC):
    """Turns each segment into the segments to store (possibly none, possibly more).

    Implements :class:`millpond.roles.Processor`.
    """

    @abstractmethod
    def process(self, segment: Segment) -> list[Segment]:
        """What to store for ``segment`` now."""

    def flush(self) -> list[Segment]:
        """What to store of whatever is held back, when the loop stops (default: nothing)."""
        return []


class PassThrough(ExperienceProcessor):
    """Stores every segment as it comes (per-step, immediate)."""

    def process(self, segment: Segment) -> list[Segment]:
        return [segment]


class ProcessorChain(ExperienceProcessor):
    """Runs processors in order: each one's output is the next one's input."""

    def __init__(self, *processors: ExperienceProcessor) -> None:
        for p in processors:
            if not isinstance(p, ExperienceProcessor):
                raise InvalidConfigError(f"{p!r} is not an ExperienceProcessor")
        self.processors = tuple(processors)

    def process(self, segment: Segment) -> list[Segment]:
        return self._run([segment], 0)

    def flush(self) -> list[Segment]:
        out: list[Segment] = []
        for i, p in enumerate(self.processors):  # what a stage releases still goes downstream
            out.extend(self._run(p.flush(), i + 1))
        return out

    def _run(self, segments: list[Segment], first: int) -> list[Segment]:
        for p in self.processors[first:]:
            segments = [out for s in segments for out in _checked(p, p.process(s))]
        return segments


def _checked(processor: ExperienceProcessor, out: object) -> list[Segment]:
    if not isinstance(out, list) or not all(isinstance(s, Segment) for s in out):
        raise InvalidDataError(
            f"{type(processor).__name__}.process must return a list of Segments, "
            f"returned {type(out).__name__}"
        )
    return out


class StepFilter(ExperienceProcessor):
    """Stores only the steps where ``keep(ted)`` is true (immediate).

    ``keep`` takes a segment's TED rows ``[L]`` and returns a bool tensor ``[L]`` (or
    ``[L, 1]``). Dropping steps inside a segment cuts it: each run of kept steps becomes a
    segment of its own with the right ``first_step``, and a run that ends before a dropped
    step gets that step's observation as its tail, so every kept step's next observation
    stays its true next observation. The flags of kept steps are untouched: a run that
    stops before a dropped step does not end its episode.

    In a chain, put episode processors *before* a step filter that may drop an episode's
    last step: after it, that episode never appears to end, and an
    :class:`EpisodeProcessor` downstream would hold it until :meth:`flush`.
    """

    def __init__(self, keep: Callable[[TensorDictBase], torch.Tensor]) -> None:
        self.keep = keep

    def process(self, segment: Segment) -> list[Segment]:
        ted = to_ted(segment)
        n = ted.batch_size[0]
        mask = torch.as_tensor(self.keep(ted))
        if mask.dtype != torch.bool or mask.numel() != n or mask.ndim == 0 or mask.shape[0] != n:
            raise InvalidDataError(
                f"StepFilter: keep() must return a bool tensor [{n}] (or [{n}, 1]), "
                f"returned {mask.dtype}{list(mask.shape)}"
            )
        mask = mask.reshape(n)
        if bool(mask.all()):
            return [segment]
        if not bool(mask.any()):
            return []
        # Runs of kept rows: a run starts where a kept row follows a dropped one (or row 0).
        padded = torch.cat([torch.zeros(1, dtype=torch.bool), mask])
        run_starts = torch.nonzero(mask & ~padded[:-1]).reshape(-1)
        run_ends = torch.nonzero(mask & ~torch.cat([mask[1:], torch.zeros(1, dtype=torch.bool)]))
        lengths = (run_ends.reshape(-1) - run_starts + 1).tolist()
        firsts = (run_starts + segment.first_step).tolist()
        return from_ted(ted[mask], lengths, segment.episode_id, firsts)


class EpisodeFilter(ExperienceProcessor):
    """Stores only the episodes where ``keep(ted)`` is true (immediate).

    ``keep`` takes the TED rows of the first segment seen of each episode (its first
    segment, normally) and returns a bool; the decision then holds for the episode's later
    segments, so nothing is held back. Use it for what is known from an episode's start,
    such as a task id; for decisions that need the whole episode, use an
    :class:`EpisodeAnnotator` whose ``annotate`` returns ``None`` to drop the episode.
    """

    def __init__(self, keep: Callable[[TensorDictBase], bool]) -> None:
        self.keep = keep
        self._decisions: dict[int, bool] = {}

    def process(self, segment: Segment) -> list[Segment]:
        keep = self._decisions.get(segment.episode_id)
        if keep is None:
            keep = bool(self.keep(to_ted(segment)))
        if ends_episode(segment):
            self._decisions.pop(segment.episode_id, None)
        else:
            self._decisions[segment.episode_id] = keep
        return [segment] if keep else []

    def flush(self) -> list[Segment]:
        self._decisions.clear()
        return []


class EpisodeProcessor(ExperienceProcessor):
    """Holds each episode's segments until the episode ends, then processes it whole.

    Subclasses implement :meth:`process_episode`. Held episodes cost memory until they
    end: an env whose episodes never end needs a time limit.

    Args:
        incomplete: what :meth:`flush` does with episodes that have not ended when the loop
            stops: ``"drop"`` them (the default: an annotation may need the end), or
            ``"process"`` them as they are.
    """

    def __init__(self, incomplete: Literal["drop", "process"] = "drop") -> None:
        if incomplete not in ("drop", "process"):
            raise InvalidConfigError(f"incomplete ({incomplete!r}) must be 'drop' or 'process'")
        self.incomplete = incomplete
        self._held: dict[int, list[Segment]] = {}

    @property
    def held_steps(self) -> int:
        """Steps held back, waiting for their episodes to end."""
        return sum(s.steps.batch_size[0] for segs in self._held.values() for s in segs)

    def process(self, segment: Segment) -> list[Segment]:
        held = self._held.setdefault(segment.episode_id, [])
        held.append(segment)
        if not ends_episode(segment):
            return []
        return self.process_episode(self._held.pop(segment.episode_id), complete=True)

    def flush(self) -> list[Segment]:
        held, self._held = self._held, {}
        if self.incomplete == "drop":
            return []
        return [s for segs in held.values() for s in self.process_episode(segs, complete=False)]

    @abstractmethod
    def process_episode(self, segments: list[Segment], complete: bool) -> list[Segment]:
        """What to store of an episode, given all its segments in order.

        ``complete`` is false for an episode released by :meth:`flush` before it ended.
        """

    @staticmethod
    def recut(
        ted: TensorDictBase, segments: Sequence[Segment], episode_id: int | None = None
    ) -> list[Segment]:
        """Cut an episode's TED rows back into the segments they came from.

        Lengths and ``first_step`` are the segments' own; the episode id too unless
        ``episode_id`` is given. Tails come from ``("next", obs)``, so a relabelled
        observation is relabelled in the tails as well.
        """
        n = sum(s.steps.batch_size[0] for s in segments)
        if ted.batch_dims != 1 or ted.batch_size[0] != n:
            raise InvalidDataError(
                f"the episode has {n} steps, the processed TED rows have batch size "
                f"{list(ted.batch_size)}"
            )
        return from_ted(
            ted,
            [s.steps.batch_size[0] for s in segments],
            [s.episode_id if episode_id is None else episode_id for s in segments],
            [s.first_step for s in segments],
        )


class EpisodeAnnotator(EpisodeProcessor):
    """Applies ``annotate(ted) -> ted | None`` to each whole episode (delayed).

    ``annotate`` receives the episode's TED rows ``[N]`` (a copy: change it freely) and
    returns rows ``[N]`` to store (new keys are stored too; observations must change
    together with their copies under ``"next"``), or ``None`` to drop the episode. The
    result is stored as the segments the episode came in.
    """

    def __init__(
        self,
        annotate: Callable[[TensorDictBase], TensorDictBase | None],
        incomplete: Literal["drop", "process"] = "drop",
    ) -> None:
        super().__init__(incomplete)
        self.annotate = annotate

    def process_episode(self, segments: list[Segment], complete: bool) -> list[Segment]:
        out = self.annotate(join(segments))
        if out is None:
            return []
        return self.recut(out, segments)


class HindsightRelabeler(EpisodeProcessor):
    """Hindsight experience replay, "final" strategy, for goal-conditioned envs (delayed).

    When an episode ends, stores (with ``keep_original``) the episode as collected, and a
    relabelled copy as episode ``episode_id + HINDSIGHT_EPISODE_OFFSET``: its desired goal,
    at every step and in every tail, is the goal the episode finally achieved (the achieved
    goal of the last step's next observation), and its rewards are recomputed as
    ``compute_reward(next achieved goal, new desired goal)`` (batched over steps, the
    gymnasium-robotics ``compute_reward`` without ``info``). Episode-end flags are kept.

    Args:
        compute_reward: ``(achieved [N, ...], desired [N, ...]) -> reward [N]`` or ``[N, 1]``.
        achieved_key: the observation key of the achieved goal (a nested key as a tuple or
            list, or with dots: ``"goals.achieved"``).
        desired_key: the observation key of the desired goal (likewise).
        keep_original: store the episode as collected too.
        incomplete: see :class:`EpisodeProcessor`.
    """

    def __init__(
        self,
        compute_reward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        achieved_key: str | Key = "achieved_goal",
        desired_key: str | Key = "desired_goal",
        keep_original: bool = True,
        incomplete: Literal["drop", "process"] = "drop",
    ) -> None:
        super().__init__(incomplete)
        self.compute_reward = compute_reward
        self.achieved_key = _key(achieved_key)
        self.desired_key = _key(desired_key)
        self.keep_original = keep_original

    def process_episode(self, segments: list[Segment], complete: bool) -> list[Segment]:
        episode_id = segments[0].episode_id
        if not 0 <= episode_id < HINDSIGHT_EPISODE_OFFSET:
            raise InvalidDataError(
                f"episode id {episode_id} leaves no room for a relabelled copy (ids must be "
                f"below 2**61 = {HINDSIGHT_EPISODE_OFFSET})"
            )
        ted = join(segments)
        achieved = ted[("next", *self.achieved_key)]
        desired = ted[self.desired_key]
        goal = achieved[-1].to(desired.dtype).expand_as(desired).clone()
        ted.set(self.desired_key, goal)
        ted.set(("next", *self.desired_key), goal.clone())
        reward = ted["next", "reward"]
        new_reward = torch.as_tensor(self.compute_reward(achieved, goal))
        if new_reward.numel() != reward.numel():
            raise InvalidDataError(
                f"compute_reward returned shape {list(new_reward.shape)}, expected "
                f"{list(reward.shape)}"
            )
        ted.set(("next", "reward"), new_reward.reshape(reward.shape).to(reward.dtype))
        relabelled = self.recut(ted, segments, episode_id + HINDSIGHT_EPISODE_OFFSET)
        return [*segments, *relabelled] if self.keep_original else relabelled


def _key(key: str | Sequence[str]) -> Key:
    """A TED key from ``"a"``, ``"next.reward"`` (dots nest) or ``["next", "reward"]``."""
    if isinstance(key, str):
        return tuple(key.split("."))
    return tuple(key)


# -- callables for specs ---------------------------------------------------------------------


def key_in(
    ted: TensorDictBase,
    *,
    key: str | Sequence[str],
    values: Sequence[Any],
    index: int | None = None,
    negate: bool = False,
) -> torch.Tensor:
    """Per step: whether ``ted[key]`` (e.g. a task id) is one of ``values``.

    A predicate for :class:`StepFilter` (``[L]`` bool); with ``negate``, whether it is none
    of them. ``key`` nests with dots (``"next.reward"``) or as a list, and holds one value
    per step, or with ``index`` a vector per step of which entry ``index`` is compared (a
    task id inside a flat observation). For example, in a config: ``keep: {path:
    millpond.actors.processors:key_in, kwargs: {key: task, values: [3], negate: true}}``
    drops the steps of task 3.
    """
    k = _key(key)
    column = ted.get(k, None)
    if column is None:
        raise InvalidDataError(f"key_in: the steps have no key {k} (keys: {list(ted.keys())})")
    n = ted.batch_size[0]
    if index is not None:
        column = column.reshape(n, -1)[:, index]
    if column.numel() != n:
        raise InvalidDataError(
            f"key_in: {k} must hold one value per step (or give an index), has shape "
            f"{list(column.shape)}"
        )
    mask = torch.isin(column.reshape(n), torch.as_tensor(list(values), dtype=column.dtype))
    return ~mask if negate else mask


def label_episode(
    ted: TensorDictBase,
    *,
    source: str | Sequence[str] = "next.terminated",
    key: str | Sequence[str] = "success",
) -> TensorDictBase:
    """Labels every step of an episode with the value its last step has at ``source``.

    An annotation for :class:`EpisodeAnnotator` (hindsight success labelling): for example
    ``source="next.truncated"`` marks every step of a CartPole episode that lasted to the
    time limit, ``source="next.terminated"`` every step of a MountainCar episode that
    reached the flag. The label is stored under ``key`` (``[N, 1]``, the source's dtype).
    """
    src = _key(source)
    column = ted.get(src, None)
    if column is None:
        raise InvalidDataError(f"label_episode: the episode has no key {src}")
    last = column[-1].reshape(1, -1)
    ted.set(_key(key), last.expand(ted.batch_size[0], last.shape[1]).clone())
    return ted


def sparse_goal_reward(
    achieved: torch.Tensor, desired: torch.Tensor, *, threshold: float = 0.05
) -> torch.Tensor:
    """``0`` where the achieved goal is within ``threshold`` (L2) of the desired one, else ``-1``.

    The sparse reward of gymnasium-robotics' Fetch and Hand tasks, batched over steps: a
    ``compute_reward`` for :class:`HindsightRelabeler`.
    """
    distance = torch.linalg.vector_norm(
        (achieved.float() - desired.float()).reshape(achieved.shape[0], -1), dim=-1
    )
    return -(distance > threshold).float()
