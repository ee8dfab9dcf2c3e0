"""Frame-stacked observations, each frame stored and sent once.

An observation key declared frame-stacked with ``k`` frames (``TableConfig.frame_stacks``,
e.g. ``uint8[4, 84, 84]`` from gymnasium's ``FrameStackObservation``) holds the ``k`` most
recent frames along dim 0, oldest first, so consecutive observations of an episode share
``k - 1`` frames: ``obs[t][:-1] == obs[t - 1][1:]``. Storing the stacks whole stores each
frame ``k`` times.

Instead, a segment of L steps carries its frame-stacked keys as *frames*: the ``k`` frames of
its first observation, then the newest frame of each of the ``L`` observations that follow
(the tail's included), ``[L + k, *frame]`` rather than ``[L + 1, k, *frame]``. Every segment
(an episode's continuations too) carries its first stack whole, so each one stands alone
and episode starts, whatever the env padded them with, come back exactly.

A table stores the frames as one frame per slot (the newest of the stack there) and the
``k - 1`` older frames of a first stack (the *prefix*) once per *chain*: a segment that
continues its predecessor on that one's tail slot (a writer's region) stores none, its
older frames being the slots before it, back to its chain's first segment, whose prefix row
holds the rest (``millpond.service.chains``). A chain of C steps costs ``C + k`` frames.
:func:`rebuild` turns those back into stacks, given each slot's chain start and prefix row;
it is a pure function over arrays so that anything reading the files (the shard, a reader
on the same host) rebuilds them alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.spec import OBSERVATION, Key, TableSpec, check_key, format_key

if TYPE_CHECKING:  # annotations only: whoever passes packed segments has them imported
    from millpond.segments import PackedSegments

__all__ = [
    "PREFIX_DIR",
    "check_stacks",
    "compact_stacks",
    "expand_stacks",
    "normalize_stacks",
    "rebuild",
    "stack_examples",
    "stacks_to_json",
]

#: The directory (beside ``columns/``) of the prefix files: one per frame-stacked key, named
#: like its column file, ``[segment records, k - 1, *frame]``.
PREFIX_DIR = "prefixes"


def normalize_stacks(stacks: Mapping | None) -> dict[Key, int]:
    """``{key: k}`` from a mapping whose keys are tuples or strings (``"a.b"`` for
    ``("a", "b")``, as in JSON and YAML); refuses (:class:`InvalidConfigError`) a bad key
    or a ``k`` that is not an integer >= 2."""
    if stacks is None:
        return {}
    if not isinstance(stacks, Mapping):
        raise InvalidConfigError(
            f"frame_stacks ({stacks!r}) must map observation keys to frame counts"
        )
    out: dict[Key, int] = {}
    for raw, k in stacks.items():
        parts = tuple(raw.split(".")) if isinstance(raw, str) else raw
        try:
            key = check_key(parts)
        except InvalidDataError as e:
            raise InvalidConfigError(f"frame_stacks: {e}") from None
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 2:
            raise InvalidConfigError(
                f"frame_stacks: key {format_key(key)} stacks {k!r} frames; a stack needs an "
                "integer >= 2"
            )
        out[key] = int(k)
    return out


def stacks_to_json(stacks: Mapping[Key, int]) -> dict[str, int]:
    """``stacks`` with its keys joined by ``.`` (key parts never hold one)."""
    return {".".join(k): int(v) for k, v in stacks.items()}


def check_stacks(stacks: Mapping[Key, int], spec: TableSpec) -> None:
    """Refuse (:class:`InvalidConfigError`) stacks that ``spec`` does not bear out: each key
    must be an observation key whose shape starts with its ``k``."""
    for key, k in stacks.items():
        f = spec.fields.get(key)
        if f is None:
            raise InvalidConfigError(
                f"frame_stacks: key {format_key(key)} is not in the table spec "
                f"(keys {', '.join(format_key(x) for x in spec.fields)})"
            )
        if f.role != OBSERVATION:
            raise InvalidConfigError(
                f"frame_stacks: key {format_key(key)} is a step key; only observations "
                "(stored once per slot, the tail's included) can be frame-stacked"
            )
        if not f.shape or f.shape[0] != k:
            raise InvalidConfigError(
                f"frame_stacks: key {format_key(key)} is {f.describe()}, but a stack of {k} "
                f"frames has shape [{k}, *frame]"
            )


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[N]``: whether rows of ``a`` and ``b`` (``[N, frames, *frame]``) differ in any bit
    (NaNs compared by their bits)."""
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    if a.numel() == 0:
        return torch.zeros(a.shape[0], dtype=torch.bool)
    # Each frame's bytes as the widest integers they divide into (8x fewer comparisons for
    # uint8 images), floats compared by their bits.
    a, b = a.reshape(*a.shape[:2], -1), b.reshape(*b.shape[:2], -1)
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    for bits in (torch.int64, torch.int32, torch.int16):
        try:
            a, b = a.view(bits), b.view(bits)
            break
        except RuntimeError:  # rows or strides that do not divide into this width
            continue
    return (a != b).reshape(a.shape[0], -1).any(-1)


#: Frames at least this large are cut out with one slice copy per segment.
_SLICE_COPY_BYTES = 1024


def _to_frames(
    key: Key,
    steps: torch.Tensor,
    tails: torch.Tensor,
    lengths: np.ndarray,
    episode_ids: np.ndarray,
    first_steps: np.ndarray,
    k: int,
) -> torch.Tensor:
    """One key's stacks (``steps [sum L, k, *frame]``, ``tails [n, k, *frame]``) as frames
    ``[sum (L + k), *frame]``, after checking that consecutive stacks of a segment overlap."""
    n, rows = len(lengths), int(lengths.sum())
    for what, t, count in (("steps", steps, rows), ("tails", tails, n)):
        if t.dim() < 2 or t.shape[0] != count or t.shape[1] != k:
            raise InvalidDataError(
                f"key {format_key(key)} is frame-stacked ({k} frames): expected {what} of "
                f"shape [{count}, {k}, *frame], received {list(t.shape)}"
            )
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # Each observation but a segment's first, with the one before it: rows 1.. of each
    # segment's steps, then its tail.
    later = torch.ones(rows, dtype=torch.bool)
    later[torch.from_numpy(starts)] = False
    bad = torch.zeros(rows, dtype=torch.bool)
    if rows > 1:
        bad[1:] = _differ(steps[1:, :-1], steps[:-1, 1:]) & later[1:]
    bad_tail = _differ(tails[:, :-1], steps[torch.from_numpy(ends - 1), 1:])
    if bool(bad.any()) or bool(bad_tail.any()):
        seg_of_row = np.repeat(np.arange(n), lengths)
        first_row = int(torch.nonzero(bad)[0]) if bool(bad.any()) else None
        i = int(seg_of_row[first_row]) if first_row is not None else n
        t = first_row - int(starts[i]) if first_row is not None else 0
        j = int(torch.nonzero(bad_tail)[0]) if bool(bad_tail.any()) else n
        if j < i:  # the earliest segment's failure is its tail
            i, t = j, int(lengths[j])
        raise InvalidDataError(
            f"key {format_key(key)} is frame-stacked ({k} frames), but the observation at "
            f"step {int(first_steps[i]) + t} of episode {int(episode_ids[i])} does not "
            "continue the one before it: its first frames must be the previous stack's last "
            f"(obs[t][:-1] == obs[t - 1][1:], oldest frame first as FrameStackObservation "
            "stacks them)"
        )
    frame = steps.shape[2:]
    out = torch.empty((rows + n * k, *frame), dtype=steps.dtype)
    if steps[0, 0].numel() * steps.element_size() >= _SLICE_COPY_BYTES:
        # Large frames: slice copies per segment beat index_copy_'s per-row kernel ~20x.
        at = 0
        for s, length, i in zip(starts.tolist(), lengths.tolist(), range(n)):
            out[at : at + k] = steps[s]
            out[at + k : at + k + length - 1] = steps[s + 1 : s + length, -1]
            out[at + k + length - 1] = tails[i, -1]
            at += length + k
        return out
    offsets = torch.from_numpy(starts + np.arange(n) * k)  # each segment's first frame row
    # The first stack whole, then the newest frame of each following observation.
    first = (offsets[:, None] + torch.arange(k)[None]).reshape(-1)
    out.index_copy_(0, first, steps[torch.from_numpy(starts)].reshape(n * k, *frame))
    seg = torch.from_numpy(np.repeat(np.arange(n), lengths))
    row = torch.arange(rows)
    newer = later.nonzero().reshape(-1)
    out.index_copy_(0, row[newer] + (seg[newer] + 1) * k - 1, steps[newer, -1])
    out.index_copy_(0, torch.from_numpy(ends) + (torch.arange(n) + 1) * k - 1, tails[:, -1])
    return out


def compact_stacks(packed: PackedSegments, stacks: Mapping[Key, int]) -> PackedSegments:
    """``packed`` with each key of ``stacks`` carried as frames (see the module docstring).

    A key still held as whole stacks in the steps and the tails is checked (consecutive
    stacks of a segment must overlap; :class:`InvalidDataError` names the key, episode and
    step where they do not) and its repeated frames dropped; a key already carried as frames
    has its row count checked. Other keys are untouched (nothing is copied for them).
    """
    if not stacks:
        return packed
    frames = dict(packed.frames)
    steps, tails = dict(packed.steps), dict(packed.tails)
    n, rows = len(packed), packed.num_steps
    for key, k in stacks.items():
        if key in frames:
            if key in steps or key in tails:
                raise InvalidDataError(
                    f"key {format_key(key)} is sent both as frames and as whole stacks"
                )
            t = frames[key]
            if t.dim() < 1 or t.shape[0] != rows + n * k:
                raise InvalidDataError(
                    f"key {format_key(key)} is frame-stacked ({k} frames): expected "
                    f"{rows + n * k} frames (each segment's L + {k}: its first stack whole, "
                    f"then one per following observation), received shape {list(t.shape)}"
                )
            continue
        if key not in steps and key not in tails:
            continue  # missing: the spec check names it
        if key not in steps or key not in tails:
            where = "tails" if key in steps else "steps"
            raise InvalidDataError(f"the {where} lack observation key {format_key(key)}")
        frames[key] = _to_frames(
            key,
            steps.pop(key),
            tails.pop(key),
            packed.lengths,
            packed.episode_ids,
            packed.first_steps,
            k,
        )
    unknown = [format_key(x) for x in frames if x not in stacks]
    if unknown:
        raise InvalidDataError(
            f"key(s) {', '.join(unknown)} sent as frames, but the table declares no frame "
            "stack for them"
        )
    return dataclasses.replace(
        packed, steps=steps, tails=tails, frames=frames, stacks={key: stacks[key] for key in frames}
    )


def stack_examples(packed: PackedSegments) -> dict[Key, torch.Tensor]:
    """The first stack of each frame-carried key, ``[1, k, *frame]`` (a view): what a spec
    check or inference reads of a stacked observation (its dtype and per-step shape)."""
    return {key: t[: packed.stacks[key]].unsqueeze(0) for key, t in packed.frames.items()}


def expand_stacks(
    packed: PackedSegments,
) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:
    """The whole stacks of ``packed``'s frame-carried keys: ``(steps, tails)``, ``[sum L, k,
    *frame]`` and ``[n, k, *frame]`` per key (new tensors)."""
    steps: dict[Key, torch.Tensor] = {}
    tails: dict[Key, torch.Tensor] = {}
    n = len(packed)
    ends = np.cumsum(packed.lengths)
    for key, frames in packed.frames.items():
        k = packed.stacks[key]
        seg = np.repeat(np.arange(n), packed.lengths)
        row = np.arange(int(ends[-1]) if n else 0)
        # Observation t of segment i is frames [o_i + t, o_i + t + k), o_i = start_i + i k.
        first = np.concatenate([row + seg * k, ends + np.arange(n) * k])
        idx = torch.from_numpy(first[:, None] + np.arange(k)[None]).reshape(-1)
        stacked = frames.index_select(0, idx).reshape(len(first), k, *frames.shape[1:])
        steps[key], tails[key] = stacked[: len(row)], stacked[len(row) :]
    return steps, tails


def rebuild(
    frames: torch.Tensor,
    prefix: torch.Tensor,
    slots: np.ndarray | torch.Tensor,
    starts: np.ndarray | torch.Tensor,
    records: np.ndarray | torch.Tensor,
) -> torch.Tensor:
    """The stacks at ``slots``, ``[N, k, *frame]``, from a table's stored frames.

    Args:
        frames: the key's column, ``[capacity, *frame]``: the newest frame of each slot.
        prefix: the key's prefix column, ``[rows, k - 1, *frame]``: the older frames of
            each chain's first stack.
        slots: ``[N]`` slots of published segments.
        starts: ``[N]`` the first slot of each slot's chain (its segment's, for a segment
            that continues none).
        records: ``[N]`` the prefix row of each slot's chain.

    Frame ``j`` (oldest first) of slot ``s`` is the newest frame of slot ``s - (k - 1 - j)``
    when that slot is in the chain, else frame ``j + (k - 1) - (s - start)`` of its
    prefix. A chain's slots never wrap around the ring.
    """
    k = prefix.shape[1] + 1
    slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    starts = torch.as_tensor(starts, dtype=torch.int64).reshape(-1)
    records = torch.as_tensor(records, dtype=torch.int64).reshape(-1)
    n, frame = len(slots), frames.shape[1:]
    pos = slots[:, None] - torch.arange(k - 1, -1, -1)[None]  # [N, k], oldest first
    # (Slots >= 0 too: a start read while its record was rewritten may be anything.)
    inside = (pos >= starts[:, None]) & (pos >= 0)
    # Outside the segment, read the slot itself (a row that surely has its blocks) and
    # overwrite it from the prefix below.
    src = torch.where(inside, pos, slots[:, None]).reshape(-1)
    out = torch.index_select(frames, 0, src)
    if not bool(inside.all()):
        outside = torch.nonzero(~inside.reshape(-1)).reshape(-1)
        flat_prefix = prefix.reshape(-1, *frame)
        at = (records[:, None] * (k - 1) + pos - starts[:, None] + (k - 1)).reshape(-1)
        # Clamped: a slot overwritten while it was read may pair with another segment's
        # start; its row is then stale (and redrawn by the caller), never out of bounds.
        at = at[outside].clamp(0, max(0, flat_prefix.shape[0] - 1))
        out[outside] = torch.index_select(flat_prefix, 0, at)
    return out.reshape(n, k, *frame)
