"""millpond's roles and their contracts: the interfaces its parts meet at, on one page.

Experience flows env actor -> :class:`Processor` -> :class:`SegmentSink` -> table, where a
:class:`SlotSampler` picks the slots a :class:`Learner` trains on; the learner publishes
policy weights, and the actor's :class:`Policy` loads them from a :class:`WeightSource`.

Each role is a structural protocol: an object plays it by having the members listed here,
without subclassing anything (``isinstance(obj, SegmentSink)`` checks the names). The
docstrings state what a player must guarantee beyond the names. The implementers:

========================  ============================================================
role                      implemented by
========================  ============================================================
:class:`SegmentSink`      ``millpond.learner.client.Writer``, ``millpond.service.TableSink``
:class:`Processor`        ``millpond.actors.processors.ExperienceProcessor`` and its kinds
:class:`Policy`           ``millpond.actors.policies.ActorPolicy`` (``RandomPolicy``,
                          ``ModulePolicy``)
:class:`SlotSampler`      ``millpond.service.samplers.Sampler`` (uniform, prioritized,
                          queue) and ``millpond.service.slice_sampler.SliceSampler``
:class:`Learner`          ``millpond.learner.ppo.PPOLearner``, ``millpond.learner.dqn.DQNLearner``
:class:`WeightSource`     ``millpond.ReplayClient`` (its ``get_weights``)
========================  ============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDictBase

    from millpond.segments import Segment

__all__ = ["Learner", "Policy", "Processor", "SegmentSink", "SlotSampler", "WeightSource"]


@runtime_checkable
class SegmentSink(Protocol):
    """The env sink: where an env actor's loop writes segments (the writer side).

    Segments of one episode arrive in step order, each naming its episode and the index of
    its first step within it. The sink stores each segment it accepted exactly once and
    whole (a re-sent segment is not stored twice), or raises; it never merges or splits
    segments. A sink may also offer ``write_segments(segments)`` and
    ``write_packed(packed)`` (segments as columns), which the loop then prefers.
    """

    def write_segment(
        self,
        steps: TensorDictBase,
        tail: TensorDictBase,
        episode_id: int | None = None,
        first_step: int | None = None,
    ) -> Any:
        """Accept one segment: steps ``[L]`` in TED form and the observation after them.

        Returns the sink's receipt (a sequence number, a generation).
        """
        ...

    def flush(self, timeout_s: float | None = None) -> None:
        """Return once everything accepted is stored; raise if it cannot be within
        ``timeout_s`` (``None``: the sink's own default)."""
        ...


@runtime_checkable
class Processor(Protocol):
    """An experience processor: what happens to segments between the env and the sink.

    It receives the segments the loop cuts, in step order within each episode (episodes of
    different lanes interleave), and returns what to store: the segment, nothing, or more.
    What it returns are segments, each of one episode only, with exact episode ids,
    ``first_step`` and tails; it never stitches episodes together. It may hold segments
    back (until an episode ends), and releases what it holds when :meth:`flush` is called.
    All the segments it returns for one table have the same keys.
    """

    def process(self, segment: Segment) -> list[Segment]:
        """What to store for ``segment`` now (possibly none, possibly more)."""
        ...

    def flush(self) -> list[Segment]:
        """What to store of whatever is held back; the loop calls it when it stops."""
        ...


@runtime_checkable
class Policy(Protocol):
    """What an env actor acts with: observations of its ``P`` lanes in, actions out.

    Calling it returns ``"action"`` ``[P, ...]`` in the action space's dtype (exactly what
    the env receives) and optionally ``"sample_log_prob"`` (the behaviour policy's) and
    ``"state_value"``. ``version`` is the weight version that acts (``-1`` before any
    weights were loaded); the loop sets it after :meth:`load_state_dict`, so the steps it
    records carry the version that chose them. ``reads_observations`` false lets the loop
    hand it an empty TensorDict.
    """

    version: int
    reads_observations: bool

    def __call__(self, observation: TensorDictBase, frames: int) -> dict[str, torch.Tensor]:
        """Actions for the lanes' current observations, ``frames`` steps into the run."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Act with these weights from the next call on."""
        ...


@runtime_checkable
class SlotSampler(Protocol):
    """A table's slot sampler: which step slots a sample returns.

    The table calls it under its lock. It sees segments (a ``SegmentBatch``: their slot
    layout) when they are published and when they are evicted, and picks slots only among
    published segments not evicted since; it never reads or writes step data (the table
    gathers what it picks). ``size`` counts the steps it can sample now, ``mass`` their
    total weight (the size, or the priorities' sum). State that must survive a restart
    lives in files of its own under the table's directory, written by :meth:`flush`.
    """

    @property
    def size(self) -> int: ...

    @property
    def mass(self) -> float: ...

    def on_publish(self, segments: Any) -> None:
        """These segments became sampleable."""
        ...

    def on_evict(self, segments: Any) -> None:
        """These segments are gone: never return their slots again."""
        ...

    def recover(self, segments: Any) -> None:
        """Take back the segments found on disk when the table reopens."""
        ...

    def reset(self, next_generation: int) -> None:
        """Forget every segment; those published from now on carry ``next_generation`` on."""
        ...

    def flush(self) -> None:
        """Write this sampler's files (a checkpoint)."""
        ...

    def reserve_space(self, end: int) -> None:
        """Reserve the disk blocks of this sampler's files for slots below ``end``."""
        ...

    def blocks_eviction(self, segments: Any) -> bool:
        """Whether overwriting ``segments`` must wait (a queue never drops unread steps)."""
        ...

    def can_sample(self, batch_size: int) -> bool:
        """Whether :meth:`sample` can answer ``batch_size`` now."""
        ...

    def sample(self, batch_size: int) -> Any:
        """A ``Selection``: published slots ``[B]`` (``[B, K]`` for slices) and their
        weights, segment lengths, trajectory ends and masks where the sampler has them."""
        ...

    def state(self) -> dict[str, Any]:
        """What ``info`` reports of this sampler."""
        ...


@runtime_checkable
class Learner(Protocol):
    """A learner: samples its table, trains, and publishes the policy the actors run.

    :meth:`step` is one training iteration; its metrics include ``sample_s`` and
    ``update_s`` (seconds waiting for data and training). :meth:`publish` sends the
    policy's weights as ``version + 1`` and returns it, so the versions it publishes
    increase; ``version`` is the last one published (the actors' policy lag is counted
    from it). ``optimizer`` is checkpointed beside the modules.
    """

    table: str
    version: int
    optimizer: Any

    def step(self) -> dict[str, Any]:
        """One training iteration; its metrics."""
        ...

    def publish(self) -> int:
        """Publish the current weights as the next version; returns it."""
        ...


@runtime_checkable
class WeightSource(Protocol):
    """Where env actors get versioned policy weights.

    Versions are integers that only increase (a publication not newer than the last is
    refused); ``-1`` means nothing was published. :meth:`get_weights` never returns an
    older version than one it returned before.
    """

    def get_weights(
        self, min_version: int = 0, timeout_s: float = 0
    ) -> tuple[Mapping[str, torch.Tensor] | None, int]:
        """``(state_dict, version)`` once a version ``>= min_version`` is published (waiting
        up to ``timeout_s``), else ``(None, latest version)``."""
        ...
