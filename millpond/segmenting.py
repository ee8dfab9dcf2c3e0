"""Cutting collected experience into segments, and back and forth between segments and TED.

A :class:`~millpond.segments.Segment` is a run of consecutive steps of one episode
plus its tail (the observation after its last step); its steps carry every per-step key but
``("next", obs)``, so each observation travels once. :func:`cut_batch` cuts a collector
batch ``[P, T]`` into segments at episode ends and at the chunk end, in one vectorised pass
(the approach of :func:`millpond.ted.compact_ted`, without its bitwise search for
discontinuities: the loop knows where its episodes end). Experience processors work on the
TED form of segments: :func:`to_ted` rebuilds ``("next", obs)`` and ``("next", "done")``,
:func:`join` does so for consecutive segments of one episode, and :func:`from_ted` cuts TED
rows back into segments, each tail taken from ``("next", obs)`` at its last row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.errors import InvalidDataError
from millpond.segments import PackedSegments, Segment, flatten, pack_columns
from millpond.spec import STEP_COUNT, Key, format_key
from millpond.ted import observation_keys, rows_differ

__all__ = [
    "cut_batch",
    "ends_episode",
    "from_ted",
    "join",
    "pack_batch",
    "to_ted",
]

_TRAJ_IDS: Key = ("collector", "traj_ids")


def _done(steps: TensorDictBase) -> torch.Tensor:
    """``terminated | truncated`` (or ``done``) of each step, in the flags' own shape."""
    nxt = steps["next"]
    flags = [nxt[f] for f in ("terminated", "truncated", "done") if f in nxt]
    if not flags:
        raise InvalidDataError("steps need ('next', 'terminated'/'truncated') or ('next', 'done')")
    done = flags[0].to(torch.bool)
    for flag in flags[1:]:
        done = done | flag.to(torch.bool)
    return done


def ends_episode(segment: Segment) -> bool:
    """Whether the segment's last step terminates or truncates its episode."""
    return bool(_done(segment.steps)[-1].any())


def cut_batch(batch: TensorDictBase) -> list[Segment]:
    """Cut a collector batch ``[P, T]`` into segments, lane after lane, in time order.

    The batch holds TED keys (observations at the root and under ``"next"``, ``action``,
    ``("next", "reward" | "terminated" | "truncated" | "done")``) and
    ``("collector", "traj_ids" | "step_count")``. A lane is cut after each step that ends
    its episode (or where the trajectory id changes) and at the chunk end. A segment's
    episode id is its trajectory id, its ``first_step`` the step count of its first row, and
    its tail ``("next", obs)`` of its last row. ``"collector"`` keys and ``("next", obs)``
    and ``("next", "done")`` are left out of the steps.
    """
    cut = _Cut(batch)
    return [
        Segment(piece, tail, ep, first)
        for piece, tail, ep, first in zip(
            cut.steps.split(cut.lengths.tolist(), 0),
            cut.tails.unbind(0),
            cut.episode_ids.tolist(),
            cut.first_steps.tolist(),
            strict=True,
        )
    ]


def pack_batch(batch: TensorDictBase) -> PackedSegments:
    """The segments :func:`cut_batch` cuts, as columns: the batch's rows are already in order.

    Lane-major, a lane's segments are consecutive rows of the flattened batch, so the
    columns are the batch's own tensors (no per-segment objects, no concatenation).
    """
    cut = _Cut(batch)
    return pack_columns(
        flatten(cut.steps), flatten(cut.tails), cut.lengths, cut.episode_ids, cut.first_steps
    )


class _Cut:
    """Where a batch ``[P, T]`` is cut into segments, and its rows without ``("next", obs)``."""

    def __init__(self, batch: TensorDictBase) -> None:
        if batch.batch_dims != 2:
            raise InvalidDataError(f"expected a batch [P, T], received {list(batch.batch_size)}")
        lanes, time_len = batch.batch_size
        n = lanes * time_len
        flat = batch.reshape(n)
        ended = flat["next", "terminated"].reshape(n) | flat["next", "truncated"].reshape(n)
        traj = flat[_TRAJ_IDS].reshape(lanes, time_len)
        cut = ended.reshape(lanes, time_len).clone()
        cut[:, -1] = True
        cut[:, :-1] |= traj[:, :-1] != traj[:, 1:]
        ends = torch.nonzero(cut.reshape(n)).reshape(-1)
        starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
        obs_keys = observation_keys(flat)
        self.lengths = (ends - starts + 1).numpy()
        self.steps = flat.exclude(*[("next", *k) for k in obs_keys], ("next", "done"), "collector")
        self.tails = flat.select(*[("next", *k) for k in obs_keys])[ends]["next"]
        self.episode_ids = traj.reshape(n)[starts].numpy()
        self.first_steps = flat[STEP_COUNT].reshape(n)[starts].numpy()


def to_ted(segment: Segment) -> TensorDict:
    """The segment's steps in TED form ``[L]``: ``("next", obs)`` and ``("next", "done")`` added.

    Root keys are the segment's own tensors (not copies); the ``"next"`` observations are
    new tensors.
    """
    steps, tail = segment.steps, segment.tail
    ted = steps.clone(False)
    for key in tail.keys(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else key
        ted.set(("next", *key), torch.cat([steps[key][1:], tail[key].unsqueeze(0)]))
    ted.set(("next", "done"), _done(steps).clone())
    return ted


def join(segments: Sequence[Segment]) -> TensorDict:
    """The TED rows ``[sum of lengths]`` of several segments (copied: safe to modify)."""
    if not segments:
        raise InvalidDataError("no segments to join")
    return torch.cat([to_ted(s) for s in segments], 0)


def from_ted(
    ted: TensorDictBase,
    lengths: Sequence[int],
    episode_ids: Sequence[int] | int,
    first_steps: Sequence[int],
) -> list[Segment]:
    """Cut TED rows ``[N]`` into consecutive segments of ``lengths`` (summing to ``N``).

    Each segment's tail is ``("next", obs)`` of its last row; its steps drop
    ``("next", obs)``, and ``("next", "done")`` when ``("next", "terminated")`` is there.
    Within a segment, ``("next", obs)`` of a row must be bitwise the following row's
    observation (the segment layout stores it once); raises :class:`InvalidDataError`
    otherwise, e.g. when a relabelling changed one but not the other.
    """
    n = ted.batch_size[0] if ted.batch_dims == 1 else -1
    lengths = [int(x) for x in lengths]
    if n != sum(lengths) or any(x < 1 for x in lengths):
        raise InvalidDataError(
            f"cannot cut TED rows of batch size {list(ted.batch_size)} into segments of "
            f"lengths {lengths}"
        )
    if isinstance(episode_ids, int):
        episode_ids = [episode_ids] * len(lengths)
    if len(episode_ids) != len(lengths) or len(first_steps) != len(lengths):
        raise InvalidDataError("lengths, episode_ids and first_steps must have one entry each")
    obs_keys = observation_keys(ted)
    if not obs_keys:
        raise InvalidDataError("the TED rows have no observation keys (k and ('next', k))")
    ends = np.cumsum(lengths) - 1
    inner = torch.ones(n, dtype=torch.bool)
    inner[torch.from_numpy(ends)] = False  # rows whose next row starts the same segment
    for key in obs_keys:
        now, nxt = ted[key], ted[("next", *key)]
        if bool(rows_differ(nxt[:-1], now[1:])[inner[:-1]].any()):
            raise InvalidDataError(
                f"{format_key(('next', *key))} is not the next row's {format_key(key)} inside a "
                "segment: relabel an observation and its copy under 'next' together"
            )
    drop = [("next", *k) for k in obs_keys]
    if ("next", "terminated") in ted.keys(include_nested=True):
        drop.append(("next", "done"))  # derived from terminated | truncated
    steps = ted.exclude(*drop)
    tails = ted.select(*[("next", *k) for k in obs_keys])[torch.from_numpy(ends)]["next"]
    return [
        Segment(piece, tail, int(ep), int(first))
        for piece, tail, ep, first in zip(
            steps.split(lengths, 0), tails.unbind(0), episode_ids, first_steps, strict=True
        )
    ]
