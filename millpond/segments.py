"""Segments as writers hand them in: validation, episode-end flags, and packing into columns.

A writer sends a segment as ``steps`` (a TensorDict of batch ``[L]`` in TED form without
``("next", obs)``: observations, action and other per-step keys at the root, ``reward``,
``terminated``, ``truncated`` (or ``done``) under ``"next"``) and ``tail`` (the observation
keys, batch ``[]``): the observation that follows the last step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.errors import InvalidDataError
from millpond.spec import DONE, TERMINATED, TRUNCATED, Key, format_key, is_reserved

#: The largest step index: a segment's steps, its tail's (``first_step + length``)
#: included, are int64.
MAX_STEP = 2**63 - 1


@dataclass
class Segment:
    """One segment to insert.

    Attributes:
        steps: TensorDict ``[L]``: per-step keys (observations at the root, flags and reward
            under ``"next"``).
        tail: TensorDict ``[]``: the observation keys after the last step.
        episode_id: the episode this segment belongs to (unique per writer and episode).
        first_step: index within the episode of the segment's first step.
        sequence: the writer's number for this segment (>= 1, increasing), which makes a
            re-sent segment idempotent; ``None`` for anonymous inserts.
        priorities: each step's initial priority, ``[L]`` (finite, >= 0), for a
            prioritized table; ``None``: the table's rule for new steps (the largest
            priority so far).
    """

    steps: TensorDictBase
    tail: TensorDictBase
    episode_id: int
    first_step: int = 0
    sequence: int | None = None
    priorities: torch.Tensor | np.ndarray | Sequence[float] | None = None


@dataclass
class PackedSegments:
    """Several segments as columns: ``steps`` rows segment after segment, one ``tails`` row each.

    Frame-stacked observation keys (see :mod:`millpond.frame_stacks`) may travel as
    ``frames`` instead of in ``steps`` and ``tails``: ``L + k`` rows per segment, segment
    after segment, ``k`` being ``stacks[key]``. Frames whose ``k`` is not known yet (just
    decoded, before the table names it) can be concatenated but not cut.

    ``priorities``: float64 ``[num_steps]``, each step's initial priority (checked by
    :func:`check_priorities`), or ``None`` for none given.
    """

    steps: dict[Key, torch.Tensor]
    tails: dict[Key, torch.Tensor]
    lengths: np.ndarray
    episode_ids: np.ndarray
    first_steps: np.ndarray
    sequences: np.ndarray | None = None
    frames: dict[Key, torch.Tensor] = field(default_factory=dict)
    stacks: dict[Key, int] = field(default_factory=dict)
    priorities: np.ndarray | None = None

    def _frame_rows(self, key: Key) -> np.ndarray:
        """Frames per segment of ``key``: ``L + k``."""
        return self.lengths + self.stacks[key]

    @property
    def num_steps(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.lengths)

    def select(self, keep: np.ndarray) -> PackedSegments:
        """The segments where ``keep`` (a bool mask over segments) is true."""
        rows = torch.from_numpy(np.repeat(keep, self.lengths))
        tails = torch.from_numpy(keep)
        return PackedSegments(
            {k: v[rows] for k, v in self.steps.items()},
            {k: v[tails] for k, v in self.tails.items()},
            self.lengths[keep],
            self.episode_ids[keep],
            self.first_steps[keep],
            None if self.sequences is None else self.sequences[keep],
            {
                k: v[torch.from_numpy(np.repeat(keep, self._frame_rows(k)))]
                for k, v in self.frames.items()
            },
            dict(self.stacks),
            None if self.priorities is None else self.priorities[np.repeat(keep, self.lengths)],
        )

    def group(self, i: int, j: int) -> PackedSegments:
        """Segments ``i`` to ``j - 1``, as views of the columns (nothing copied)."""
        start = int(self.lengths[:i].sum())
        stop = start + int(self.lengths[i:j].sum())
        return PackedSegments(
            {k: v[start:stop] for k, v in self.steps.items()},
            {k: v[i:j] for k, v in self.tails.items()},
            self.lengths[i:j],
            self.episode_ids[i:j],
            self.first_steps[i:j],
            None if self.sequences is None else self.sequences[i:j],
            {k: v[_span(self._frame_rows(k), i, j)] for k, v in self.frames.items()},
            dict(self.stacks),
            None if self.priorities is None else self.priorities[start:stop],
        )

    def split(self, max_slots: int) -> list[PackedSegments]:
        """Consecutive groups of segments, each needing at most ``max_slots`` slots."""
        groups: list[PackedSegments] = []
        i, n = 0, len(self)
        while i < n:
            j, slots = i, 0
            while j < n and slots + self.lengths[j] + 1 <= max_slots:
                slots += int(self.lengths[j]) + 1
                j += 1
            if j == i:
                raise InvalidDataError(
                    f"a segment of {int(self.lengths[i])} steps needs {int(self.lengths[i]) + 1} "
                    f"slots, more than the table's capacity ({max_slots})"
                )
            groups.append(self.group(i, j))
            i = j
        return groups


def _span(rows: np.ndarray, i: int, j: int) -> slice:
    """The rows of segments ``i`` to ``j - 1``, each taking ``rows[s]`` of them."""
    start = int(rows[:i].sum())
    return slice(start, start + int(rows[i:j].sum()))


def flatten(td: TensorDictBase | Mapping) -> dict[Key, torch.Tensor]:
    """``{key tuple: tensor}`` for every leaf of a TensorDict (or nested mapping)."""
    if isinstance(td, TensorDictBase):
        return {
            (k,) if isinstance(k, str) else tuple(k): v
            for k, v in td.items(include_nested=True, leaves_only=True)
        }
    out: dict[Key, torch.Tensor] = {}
    for k, v in td.items():
        key = (k,) if isinstance(k, str) else tuple(k)
        if isinstance(v, Mapping | TensorDictBase):
            out.update({(*key, *sub): t for sub, t in flatten(v).items()})
        else:
            out[key] = v
    return out


_FLAG_KEYS = (DONE, TERMINATED, TRUNCATED)


def _flag_shape(t: torch.Tensor, n: int, key: Key) -> torch.Tensor:
    """Per-segment shape check of a flag column, flattened to ``[n]`` for concatenation."""
    if t.shape != (n,):
        if t.shape != (n, 1):
            raise InvalidDataError(
                f"key {format_key(key)}: expected shape [{n}] or [{n}, 1], received {list(t.shape)}"
            )
        t = t.reshape(n)
    return t


def _as_flags(t: torch.Tensor, n: int, key: Key) -> torch.Tensor:
    t = _flag_shape(t, n, key)
    if t.dtype != torch.bool and t.dtype.is_floating_point:
        raise InvalidDataError(f"key {format_key(key)}: expected bool flags, received {t.dtype}")
    return t.to(torch.bool)


def episode_ends(
    flags: Mapping[Key, torch.Tensor], n: int, what: str = "steps"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``terminated`` and ``truncated`` ``[n]`` from whichever of the three flags are there.

    With only ``("next", "done")``, it is taken as ``terminated``; a ``done`` that disagrees
    with ``terminated | truncated`` is refused. ``what`` names the data in messages.
    """
    done, term, trunc = flags.get(DONE), flags.get(TERMINATED), flags.get(TRUNCATED)
    if term is None and done is None:
        raise InvalidDataError(
            f"{what} need ('next', 'terminated') and ('next', 'truncated'), or ('next', 'done')"
        )
    trunc = (
        _as_flags(trunc, n, TRUNCATED) if trunc is not None else torch.zeros(n, dtype=torch.bool)
    )
    if term is None:
        return _as_flags(done, n, DONE) & ~trunc, trunc
    term = _as_flags(term, n, TERMINATED)
    if done is not None and not torch.equal(_as_flags(done, n, DONE), term | trunc):
        raise InvalidDataError(
            "('next', 'done') disagrees with ('next', 'terminated') | ('next', 'truncated')"
        )
    return term, trunc


def normalize_steps(
    steps: dict[Key, torch.Tensor], n: int, lengths: np.ndarray | None = None
) -> dict[Key, torch.Tensor]:
    """Replace done/terminated/truncated by bool ``terminated`` and ``truncated`` of shape [n].

    The flags are read by :func:`episode_ends`. Raises if an episode ends anywhere but at
    a segment's last step.
    """
    steps = dict(steps)
    term, trunc = episode_ends(
        {k: steps.pop(k) for k in (DONE, TERMINATED, TRUNCATED) if k in steps}, n
    )
    ended = term | trunc
    if lengths is None:
        lengths = np.array([n], dtype=np.int64)
    last = torch.from_numpy(np.cumsum(lengths) - 1)
    inner = ended.clone()
    inner[last] = False  # an episode may end at each segment's last step, nowhere else
    if bool(inner.any()):
        row = int(torch.nonzero(inner)[0])
        seg = int(np.searchsorted(np.cumsum(lengths), row, side="right"))
        at = row - int(np.cumsum(lengths)[seg] - lengths[seg])
        raise InvalidDataError(
            f"the episode ends at step {at} of a segment of {int(lengths[seg])} steps: an "
            "episode end must be a segment's last step (cut the segment there)"
        )
    steps[TERMINATED] = term
    steps[TRUNCATED] = trunc
    return steps


def pack(segments: Sequence[Segment]) -> PackedSegments:
    """Validate the layout of ``segments`` and concatenate them into columns.

    Checks that keys are not reserved, that no observation key appears under ``"next"``,
    that every segment has the same keys, and normalises the episode-end flags. Dtypes and
    shapes are checked against the table's spec by the table.
    """
    if not segments:
        raise InvalidDataError("no segments to insert")
    steps_list, tails_list, lengths_list = [], [], []
    obs_keys: list[Key] | None = None
    for i, seg in enumerate(segments):
        tail_td = seg.tail
        if isinstance(tail_td, TensorDictBase) and tuple(tail_td.batch_size) == (1,):
            tail_td = tail_td[0]  # a batch of one observation is accepted too
        steps, tail = flatten(seg.steps), flatten(tail_td)
        n = _length(seg.steps, steps, i)
        if n == 0:
            raise InvalidDataError(f"segment {i} has no steps")
        if not tail:
            raise InvalidDataError(f"segment {i}: the tail has no observation keys")
        if obs_keys is None:
            obs_keys = list(tail)
        elif set(tail) != set(obs_keys):
            raise InvalidDataError(f"segment {i}: tail keys differ from segment 0's")
        _check_keys(steps, tail, f"segment {i}")
        for key in _FLAG_KEYS:
            t = steps.get(key)
            if t is not None:
                steps[key] = _flag_shape(t, n, key)
        steps_list.append(steps)
        tails_list.append(tail)
        lengths_list.append(n)
    lengths = np.array(lengths_list, dtype=np.int64)
    flag_sets = {frozenset(k for k in _FLAG_KEYS if k in s) for s in steps_list}
    if len(flag_sets) > 1:  # segments flag their ends differently: normalise each one
        steps_list = [normalize_steps(s, n) for s, n in zip(steps_list, lengths_list)]
    keys = list(steps_list[0])
    for i, s in enumerate(steps_list[1:], 1):
        if s.keys() != steps_list[0].keys():
            raise InvalidDataError(f"segment {i}: step keys differ from segment 0's")
    if len(segments) == 1:
        cat_steps, cat_tails = steps_list[0], {k: v.unsqueeze(0) for k, v in tails_list[0].items()}
    else:
        cat_steps = {k: _cat([s[k] for s in steps_list], k) for k in keys}
        cat_tails = {k: _cat([t[k].unsqueeze(0) for t in tails_list], k) for k in tails_list[0]}
    # One vectorised pass over the episode-end flags of every segment.
    cat_steps = normalize_steps(cat_steps, int(lengths.sum()), lengths)
    sequences = [s.sequence for s in segments]
    if any(q is not None for q in sequences):
        if any(q is None for q in sequences):
            raise InvalidDataError("either every segment of an insert has a sequence or none")
        seq = _check_sequences(np.array(sequences, dtype=np.int64))
    else:
        seq = None
    first_steps = [int(s.first_step) for s in segments]
    episode_ids = [int(s.episode_id) for s in segments]
    check_steps(np.array(episode_ids, dtype=object), np.array(first_steps, dtype=object), lengths)
    given = [s.priorities is not None for s in segments]
    priorities = None
    if any(given):
        if not all(given):
            raise InvalidDataError("either every segment of an insert has priorities or none")
        priorities = np.concatenate(
            [
                check_priorities(s.priorities, n, f"segment {i}")
                for i, (s, n) in enumerate(zip(segments, lengths_list))
            ]
        )
    return PackedSegments(
        cat_steps,
        cat_tails,
        lengths,
        np.array(episode_ids, dtype=np.int64),
        np.array(first_steps, dtype=np.int64),
        seq,
        priorities=priorities,
    )


def check_priorities(values: object, n: int, where: str = "segments") -> np.ndarray:
    """``values`` as float64 ``[n]`` initial step priorities, or :class:`InvalidDataError`
    naming what is wrong: not numbers, not one per step, NaN or infinite, negative."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype == torch.bfloat16:  # numpy has no bfloat16
            values = values.float()
        values = values.numpy()
    try:
        p = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise InvalidDataError(f"{where}: priorities must be numbers: {e}") from None
    if p.dtype == np.bool_ or not (
        np.issubdtype(p.dtype, np.floating) or np.issubdtype(p.dtype, np.integer)
    ):
        raise InvalidDataError(f"{where}: priorities must be numbers, received dtype {p.dtype}")
    if p.ndim == 2 and p.shape[1:] == (1,):
        p = p.reshape(-1)  # [L, 1], as a per-step key is often shaped
    if p.shape != (n,):
        raise InvalidDataError(
            f"{where}: expected one priority per step, shape [{n}], received {list(p.shape)}"
        )
    p = p.astype(np.float64)
    bad = ~np.isfinite(p)
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidDataError(
            f"{where}: priority of step {i} is {p[i]}: priorities must be finite (no NaN or inf)"
        )
    if np.any(p < 0):
        i = int(np.argmax(p < 0))
        raise InvalidDataError(f"{where}: priority of step {i} is {p[i]}: priorities must be >= 0")
    return p


def check_steps(episode_ids: np.ndarray, first_steps: np.ndarray, lengths: np.ndarray) -> None:
    """Refuse segments whose steps (the tail's, ``first_step + length``, included) leave
    ``[0, MAX_STEP]``, by name, before anything computes with them."""
    if not len(first_steps):
        return
    bad = (first_steps < 0) | (first_steps > MAX_STEP - lengths)  # no sum: it could wrap
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidDataError(
            f"first_step {int(first_steps[i])} of episode {int(episode_ids[i])} is out of "
            f"range: the steps of its segment of {int(lengths[i])} (first_step + length "
            f"included) must lie in [0, {MAX_STEP}]"
        )


def _check_sequences(seq: np.ndarray) -> np.ndarray:
    if len(seq) and (seq[0] < 1 or np.any(np.diff(seq) <= 0)):
        raise InvalidDataError(f"sequences must be >= 1 and increasing, received {seq.tolist()}")
    return seq


def concat(groups: Sequence[PackedSegments]) -> PackedSegments:
    """Packed groups of segments as one, in order (the group itself when there is one)."""
    if not groups:
        raise InvalidDataError("no segments to insert")
    if len(groups) == 1:
        return groups[0]
    first = groups[0]
    for i, g in enumerate(groups[1:], 1):
        if (
            g.steps.keys() != first.steps.keys()
            or g.tails.keys() != first.tails.keys()
            or g.frames.keys() != first.frames.keys()
        ):
            raise InvalidDataError(f"segment group {i}: keys differ from group 0's")
        if any(g.stacks.get(k, s) != s for k, s in first.stacks.items()):
            raise InvalidDataError(f"segment group {i}: frame stacks differ from group 0's")
    numbered = {g.sequences is not None for g in groups}
    if len(numbered) > 1:
        raise InvalidDataError("either every segment of an insert has a sequence or none")
    sequences = None
    if numbered == {True}:
        sequences = _check_sequences(np.concatenate([g.sequences for g in groups]))
    if len({g.priorities is not None for g in groups}) > 1:
        raise InvalidDataError("either every segment of an insert has priorities or none")
    priorities = None
    if first.priorities is not None:
        priorities = np.concatenate([g.priorities for g in groups])
    return PackedSegments(
        {k: _cat([g.steps[k] for g in groups], k) for k in first.steps},
        {k: _cat([g.tails[k] for g in groups], k) for k in first.tails},
        np.concatenate([g.lengths for g in groups]),
        np.concatenate([g.episode_ids for g in groups]),
        np.concatenate([g.first_steps for g in groups]),
        sequences,
        {k: _cat([g.frames[k] for g in groups], k) for k in first.frames},
        {k: s for g in groups for k, s in g.stacks.items()},
        priorities,
    )


def pack_columns(
    steps: Mapping[Key, torch.Tensor],
    tails: Mapping[Key, torch.Tensor],
    lengths: np.ndarray | Sequence[int],
    episode_ids: np.ndarray | Sequence[int],
    first_steps: np.ndarray | Sequence[int],
    sequences: np.ndarray | Sequence[int] | None = None,
    frames: Mapping[Key, torch.Tensor] | None = None,
    priorities: np.ndarray | torch.Tensor | Sequence[float] | None = None,
) -> PackedSegments:
    """Segments already laid out as columns, checked as :func:`pack` checks segments.

    ``steps`` holds every segment's rows one segment after another (``lengths`` of them),
    ``tails`` one row per segment. For a producer that has its steps in one block already
    (a collector's chunk): no per-segment objects and no concatenation. ``frames``: the
    frame-stacked observation keys sent as frames (:mod:`millpond.frame_stacks`; their
    stack sizes are the table's, checked by :func:`millpond.frame_stacks.compact_stacks`).
    ``priorities``: each step's initial priority, ``[sum of lengths]`` (see
    :func:`check_priorities`), or ``None``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        raise InvalidDataError("no segments to insert")
    if np.any(lengths < 1):
        raise InvalidDataError(f"segments need at least one step, lengths {lengths.tolist()}")
    per_segment = {"episode_ids": episode_ids, "first_steps": first_steps}
    if sequences is not None:
        per_segment["sequences"] = sequences
    for name, values in per_segment.items():
        if len(values) != len(lengths):
            raise InvalidDataError(
                f"{len(lengths)} segments (lengths) but {len(values)} {name}; one each"
            )
    n = int(lengths.sum())
    frames = dict(frames or {})
    if not tails and not frames:
        raise InvalidDataError("the tails have no observation keys")
    _check_keys(steps, tails, "segments")
    for key in frames:
        if key in steps or key in tails or is_reserved(key) or key[0] == "next":
            raise InvalidDataError(
                f"key {format_key(key)} cannot travel as frames: it is in the steps or the "
                "tails too, reserved, or under 'next'"
            )
    for key, t in steps.items():
        if t.dim() == 0 or t.shape[0] != n:
            raise InvalidDataError(
                f"key {format_key(key)}: expected {n} rows (the lengths' sum), "
                f"received shape {list(t.shape)}"
            )
    for key, t in tails.items():
        if t.dim() == 0 or t.shape[0] != len(lengths):
            raise InvalidDataError(
                f"tail key {format_key(key)}: expected one row per segment ({len(lengths)}), "
                f"received shape {list(t.shape)}"
            )
    check_steps(np.asarray(episode_ids), np.asarray(first_steps, dtype=np.int64), lengths)
    return PackedSegments(
        normalize_steps(dict(steps), n, lengths),
        dict(tails),
        lengths,
        np.asarray(episode_ids, dtype=np.int64),
        np.asarray(first_steps, dtype=np.int64),
        None if sequences is None else _check_sequences(np.asarray(sequences, dtype=np.int64)),
        frames,
        priorities=None if priorities is None else check_priorities(priorities, n),
    )


def _check_keys(
    steps: Mapping[Key, torch.Tensor], tail: Mapping[Key, torch.Tensor], where: str
) -> None:
    """Step keys are not reserved, carry no ``("next", obs)``, and hold every tail key."""
    for key in steps:
        if is_reserved(key):
            raise InvalidDataError(f"key {format_key(key)} is reserved for sampled output")
        if key[0] == "next" and key[1:] in tail:
            raise InvalidDataError(
                f"steps carry {format_key(key)}: send each observation once, the tail "
                "holds the one after the last step"
            )
    missing = [format_key(k) for k in tail if k not in steps]
    if missing:
        raise InvalidDataError(f"{where}: steps lack observation key(s) {', '.join(missing)}")


def _length(td: TensorDictBase | Mapping, steps: dict[Key, torch.Tensor], i: int) -> int:
    if isinstance(td, TensorDictBase) and td.batch_dims >= 1:
        return int(td.batch_size[0])
    sizes = {t.shape[0] if t.dim() else None for t in steps.values()}
    if len(sizes) != 1 or None in sizes:
        raise InvalidDataError(f"segment {i}: steps must share one leading (step) dimension")
    return int(next(iter(sizes)))


def _cat(tensors: list[torch.Tensor], key: Key) -> torch.Tensor:
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) > 1:  # torch.cat would promote them silently
        raise InvalidDataError(f"key {format_key(key)}: segments disagree on dtype ({dtypes})")
    try:
        return torch.cat(tensors)
    except (RuntimeError, TypeError) as e:
        raise InvalidDataError(
            f"key {format_key(key)}: segments disagree on dtype or shape: {e}"
        ) from e
