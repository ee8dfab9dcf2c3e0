"""Conversion between TorchRL's TED format and millpond's compact segment tables.

TED (TorchRL Episode Data) stores every observation twice: at the root for step ``t`` and
under ``"next"`` for step ``t``'s successor. :func:`compact_ted` cuts TED data into
segments whose ``("next", obs)`` is the following row's ``obs``, so each observation is
stored once (see the *compact segment layout* in the design notes). The shard's exporters
(``millpond.service.export``) write stored steps back out in TED form.

Import is lossless for any input: a segment is cut wherever the next observation is not
bitwise the following row's observation, so nothing is ever inferred.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.errors import InvalidDataError
from millpond.routing import writer_hash
from millpond.segments import PackedSegments, episode_ends, flatten
from millpond.spec import (
    DONE,
    MASK,
    RESERVED_KEYS,
    STEP_COUNT,
    TERMINATED,
    TRUNCATED,
    Key,
    dtype_name,
    format_key,
)

__all__ = [
    "FRESH_EPISODE_ID_BASE",
    "TRAJ_ID_LIMIT",
    "OpenEpisodes",
    "StepCountError",
    "compact_ted",
    "episode_base",
    "leaf_keys",
    "observation_digest",
    "observation_keys",
    "rows_differ",
]

#: Episode ids of trajectories without ``("collector", "traj_ids")`` lie in
#: ``[FRESH_EPISODE_ID_BASE, 2**63)``: random, so they need no counter to persist.
FRESH_EPISODE_ID_BASE = 1 << 62

_TRAJ_IDS: Key = ("collector", "traj_ids")
#: Leaves under ``"next"`` that are not observations.
_NEXT_NON_OBSERVATIONS = frozenset(
    {("next", "reward"), ("next", "done"), ("next", "terminated"), ("next", "truncated")}
)


def leaf_keys(data: TensorDictBase) -> list[Key]:
    """``data``'s leaf keys, each a tuple (a root key too), in key order."""
    return [_as_key(k) for k in data.keys(include_nested=True, leaves_only=True)]


def _as_key(k: str | tuple[str, ...]) -> Key:
    return (k,) if isinstance(k, str) else tuple(k)


def observation_keys(keys: TensorDictBase | Iterable[Key]) -> list[Key]:
    """The observation keys of TED data (a TensorDict, or its leaf keys), in key order.

    A root leaf ``k`` is an observation when ``("next", *k)`` is a leaf too, ``k`` is not
    under ``"collector"``, and it is none of the keys sampling produces itself
    (``done``/``terminated``/``truncated``, ``index``, ...) nor reward.
    """
    leaves = leaf_keys(keys) if isinstance(keys, TensorDictBase) else [_as_key(k) for k in keys]
    present = set(leaves)
    return [
        k
        for k in leaves
        if k[0] not in ("next", "collector")
        and k[:1] not in RESERVED_KEYS
        and ("next", *k) in present
        and ("next", *k) not in _NEXT_NON_OBSERVATIONS
    ]


def rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[N]``: whether rows of ``a`` and ``b`` (``[N, ...]``) differ in any bit.

    Floating-point and complex values are compared as integers of their width, so NaNs with
    the same bits are equal and ``-0.0`` differs from ``0.0``.
    """
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype.is_floating_point:
        bits = _SAME_WIDTH_INT[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    if a.numel() == 0:
        return torch.zeros(a.shape[0], dtype=torch.bool)
    return (a != b).reshape(a.shape[0], -1).any(-1)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: Episode ids of a named extend source start here: ``episode_base(source)`` is a multiple of
#: ``2**32`` in ``[2**32, 2**62)``, and its trajectories' ids are added to it.
TRAJ_ID_LIMIT = 1 << 32


class StepCountError(InvalidDataError):
    """``("collector", "step_count")`` disagrees with the steps' indices in their episodes;
    ``detail`` says where, without naming the key."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"('collector', 'step_count'): {detail}")
        self.detail = detail


#: Open episodes of an extend source: episode id -> (its next step, a digest of its last
#: next observation, or ``None`` where it is not known).
OpenEpisodes = dict[int, tuple[int, "bytes | None"]]


def episode_base(source: str) -> int:
    """Where the episode ids of the extend source called ``source`` start (see
    :func:`compact_ted`): the same in every process, different for different sources."""
    return (writer_hash(f"extend:{source}") % ((1 << 30) - 1) + 1) * TRAJ_ID_LIMIT


def observation_digest(observation: dict[Key, torch.Tensor]) -> bytes:
    """A digest of one observation's bytes (every key), to tell whether two are the same."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(observation):
        value = observation[key].contiguous()
        h.update(repr((key, str(value.dtype), tuple(value.shape))).encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


# -- import ---------------------------------------------------------------------------------
def compact_ted(
    td: TensorDictBase, open_episodes: OpenEpisodes, episode_base: int = 0
) -> PackedSegments:
    """Cut TED data into segments, each observation kept once.

    Forms: ``[T]``, ``[P, T]`` (lanes, time: a collector's batch), ``[B, P, T]`` (a
    stacking multi-collector's), and ``split_trajs=True`` output (``[trajectories,
    max_len]`` padded at the end, ``("collector", "mask")`` false on the padding, which is
    never stored). Anything else is refused, and so is ``compact_obs=True`` output: it
    lacks ``("next", obs)``, and at episode ends that observation is lost for good.

    Observation keys are the leaves ``k`` (possibly nested, never under ``"next"``) for
    which ``("next", *k)`` exists too, flags and reward excepted. A lane's time axis is
    cut after step ``t`` when ``("next", "done" | "terminated" | "truncated")[t]`` is set,
    when ``("collector", "traj_ids")`` changes between ``t`` and ``t + 1``, or when any
    ``("next", k)[t]`` differs bitwise from ``k[t + 1]``. A segment's tail is
    ``("next", obs)`` at its last step, so the stored data gives back every input row
    exactly, terminal and truncated steps included.

    Root ``done``/``terminated``/``truncated`` and the other keys a table generates when
    sampling (``episode_id``, ``step``, ``index``, ``weight``) are dropped, as is everything
    under ``"collector"``, so sampled or exported data can be extended again.
    ``("next", "done")`` is checked against ``terminated | truncated`` and then dropped
    (with ``done`` alone, it is taken as ``terminated``).

    Episode ids: with ``("collector", "traj_ids")``, a trajectory's episode id is
    ``episode_base + traj_id``: each extend source has its own ``episode_base``
    (:func:`episode_base`; 0 for a table's default source), so trajectories of different
    sources are never joined, whatever their ids. ``open_episodes`` (see
    :data:`OpenEpisodes`) carries the trajectories that have not ended from one call to
    the next, so their step indexes continue; a trajectory continues only if its first
    observation is bitwise the last next observation it stopped on, and data that claims
    to continue one but does not (two producers sharing trajectory ids in one source, or
    skipped steps) is refused. ``open_episodes`` is updated in place only if the call
    succeeds. Without trajectory ids, lanes cannot be matched across calls: each lane's
    first trajectory starts a new episode, and so does every step that follows an episode
    end. Those episodes get random ids in ``[FRESH_EPISODE_ID_BASE, 2**63)``, unique across
    calls, processes and restarts with no state to persist (a collision among ``n`` such
    ids has probability below ``n**2 / 2**63``).

    Returns the segments packed lane after lane, in time order within a lane.
    Raises :class:`InvalidDataError` for data that is not TED, naming what is wrong.
    """
    if not isinstance(td, TensorDictBase):
        raise InvalidDataError(f"expected a TED TensorDict, received {type(td).__name__}")
    if td.batch_dims not in (1, 2, 3):
        raise InvalidDataError(
            f"TED data must have batch size [T], [P, T] (lanes, time) or [B, P, T] (a stacking "
            f"multi-collector's); received {list(td.batch_size)} ({td.batch_dims} batch "
            "dimensions)"
        )
    if td.device is not None and td.device.type != "cpu":
        td = td.to("cpu")
    time_len = td.batch_size[-1]
    lanes = td.batch_size[:-1].numel()
    n = lanes * time_len
    if n == 0:
        raise InvalidDataError(f"TED data of batch size {list(td.batch_size)} holds no steps")

    leaves = flatten(td)
    for key, value in leaves.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidDataError(f"key {format_key(key)} is not a tensor; it cannot be stored")
    # Every leaf as [P, T, ...] (a [T] batch is one lane, [B, P, T] is B * P lanes).
    grid = {k: v.reshape(lanes, time_len, *v.shape[td.batch_dims :]) for k, v in leaves.items()}
    obs_keys = observation_keys(grid)
    if not obs_keys:
        raise InvalidDataError(_no_observation_message(grid))
    for k in obs_keys:
        now, nxt = grid[k], grid[("next", *k)]
        if now.dtype != nxt.dtype or now.shape != nxt.shape:
            raise InvalidDataError(
                f"observation {format_key(k)} is {dtype_name(now.dtype)}{list(now.shape[2:])} "
                f"but {format_key(('next', *k))} is {dtype_name(nxt.dtype)}{list(nxt.shape[2:])}"
            )
    keep = _padding_mask(grid.get(MASK), lanes, time_len)  # [P, T], False on padding
    terminated, truncated = episode_ends(
        {
            k: grid[k].reshape(n, *grid[k].shape[2:])
            for k in (DONE, TERMINATED, TRUNCATED)
            if k in grid
        },
        n,
        "TED data",
    )
    ended = (terminated | truncated).reshape(lanes, time_len)
    traj_ids = _traj_ids(grid.get(_TRAJ_IDS), lanes, time_len, episode_base)
    counts = _step_counts(grid.get(STEP_COUNT), n)

    # Cut after step t of a lane where the episode ends, the trajectory changes, an
    # observation's next value is not (bitwise) the following row's value, or the lane's
    # real steps end (the batch's end, or padding).
    cut = ended.clone()
    cut[:, -1] = True
    cut[:, :-1] |= ~keep[:, 1:]
    if traj_ids is not None:
        cut[:, :-1] |= traj_ids[:, :-1] != traj_ids[:, 1:]
    for k in obs_keys:
        differs = rows_differ(
            grid[("next", *k)][:, :-1].flatten(0, 1), grid[k][:, 1:].flatten(0, 1)
        )
        cut[:, :-1] |= differs.reshape(lanes, time_len - 1)
    rows = torch.nonzero(keep.reshape(n)).reshape(-1)  # the real rows, lane after lane
    if len(rows) == 0:
        raise InvalidDataError("the TED data's ('collector', 'mask') marks no step as real")
    ends_at = torch.nonzero(cut.reshape(n)[rows]).reshape(-1)  # positions among real rows
    starts_at = torch.cat([ends_at.new_zeros(1), ends_at[:-1] + 1])
    lengths = (ends_at - starts_at + 1).numpy()
    starts, ends = rows[starts_at], rows[ends_at]  # rows of the flat [P * T] batch
    seg_ended = ended.reshape(n)[ends]

    def real(flat: torch.Tensor) -> torch.Tensor:
        """The real rows of a flat ``[P * T, ...]`` column (all of them without padding)."""
        return flat if len(rows) == n else flat[rows]

    tails = {k: grid[("next", *k)].reshape(n, *grid[k].shape[2:])[ends] for k in obs_keys}
    staged = dict(open_episodes)  # kept only if the step counts check out
    if traj_ids is not None:
        episode_ids = traj_ids.reshape(n)[starts].numpy()
        first_steps = _continue_episodes(
            episode_ids,
            lengths,
            seg_ended.tolist(),
            staged,
            grid,
            obs_keys,
            starts,
            tails,
            None if counts is None else counts[starts].numpy(),
        )
    else:
        # A segment starts a new episode at a lane's start and after an episode end.
        new_episode = (starts % time_len == 0) | ended.reshape(n)[(starts - 1).clamp(min=0)]
        n_new = int(new_episode.sum())
        fresh = np.array(
            [FRESH_EPISODE_ID_BASE + secrets.randbits(62) for _ in range(n_new)], dtype=np.int64
        )
        episode_ids = fresh[(torch.cumsum(new_episode.long(), 0) - 1).numpy()]
        first_steps = np.zeros(len(lengths), dtype=np.int64)
        running = 0
        for i, new in enumerate(new_episode.tolist()):
            if new:
                running = 0 if counts is None else int(counts[starts[i]])
            first_steps[i] = running
            running += int(lengths[i])
    if counts is not None:
        _check_step_counts(real(counts), first_steps, lengths, rows, time_len)
    open_episodes.clear()
    open_episodes.update(staged)

    steps: dict[Key, torch.Tensor] = {}
    for key, value in grid.items():
        if (
            key[0] == "collector"
            or key[:1] in RESERVED_KEYS
            or key in (DONE, TERMINATED, TRUNCATED)
            or (key[0] == "next" and key[1:] in obs_keys)
        ):
            continue
        steps[key] = real(value.reshape(n, *value.shape[2:]))
    steps[TERMINATED] = real(terminated)
    steps[TRUNCATED] = real(truncated)
    return PackedSegments(steps, tails, lengths.astype(np.int64), episode_ids, first_steps)


def _continue_episodes(
    episode_ids: np.ndarray,
    lengths: np.ndarray,
    seg_ended: list[bool],
    open_episodes: OpenEpisodes,
    grid: dict[Key, torch.Tensor],
    obs_keys: list[Key],
    starts: torch.Tensor,
    tails: dict[Key, torch.Tensor],
    counts: np.ndarray | None,
) -> np.ndarray:
    """Each segment's first step, continuing the episodes ``open_episodes`` holds; updates it.
    An episode it does not hold starts at ``counts[i]`` (0 without counts).

    A trajectory that an earlier call left open continues only where its first observation
    is the one it stopped on; otherwise the call is refused (and nothing changes).
    """
    state = dict(open_episodes)
    time_len = next(iter(grid.values())).shape[1]
    seen: set[int] = set()
    last_of: dict[int, int] = {}
    first_steps = np.empty(len(lengths), dtype=np.int64)
    for i, (ep, length, done) in enumerate(
        zip(episode_ids.tolist(), lengths.tolist(), seg_ended, strict=True)
    ):
        if ep not in seen and ep in state:
            digest = state[ep][1]
            lane, t = divmod(int(starts[i]), time_len)
            first = {k: grid[k][lane, t] for k in obs_keys}
            if digest is not None and observation_digest(first) != digest:
                raise InvalidDataError(
                    f"episode {ep} (trajectory {ep % TRAJ_ID_LIMIT}) continues from an earlier "
                    "extend call, but its first observation is not the next observation that "
                    "call ended on: two producers share trajectory ids in one source (give "
                    "each its own source: its own ReplayClient, or Table.extend(..., "
                    "source=...)), or steps are missing"
                )
        seen.add(ep)
        if ep in state:
            first_steps[i] = state[ep][0]
        else:
            first_steps[i] = 0 if counts is None else counts[i]
        if done:
            state.pop(ep, None)
            last_of.pop(ep, None)
        else:
            state[ep] = (int(first_steps[i]) + length, None)
            last_of[ep] = i
    for ep, i in last_of.items():  # where each open trajectory stops, to check its sequel
        state[ep] = (state[ep][0], observation_digest({k: tails[k][i] for k in obs_keys}))
    open_episodes.clear()
    open_episodes.update(state)
    return first_steps


def _step_counts(counts: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``[P * T]`` int64: the steps' indices in their episodes, checked; ``None`` if absent."""
    if counts is None:
        return None
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise InvalidDataError(
            f"{format_key(STEP_COUNT)} must be integers, received {dtype_name(counts.dtype)}"
        )
    if counts[0, 0].numel() != 1:
        raise InvalidDataError(
            f"{format_key(STEP_COUNT)} must hold one count per step, received shape "
            f"{list(counts.shape)}"
        )
    counts = counts.reshape(n).to(torch.int64)
    if bool((counts < 0).any()):
        raise StepCountError(
            f"counts must be >= 0 (a step's index in its episode), received {int(counts.min())}"
        )
    return counts


def _check_step_counts(
    counts: torch.Tensor,
    first_steps: np.ndarray,
    lengths: np.ndarray,
    rows: torch.Tensor,
    time_len: int,
) -> None:
    """Refuse real rows whose count is not their step index (``first_step`` + offset)."""
    lengths_t = torch.from_numpy(lengths)
    offsets = torch.arange(len(counts)) - torch.repeat_interleave(
        torch.cumsum(lengths_t, 0) - lengths_t, lengths_t
    )
    expected = torch.repeat_interleave(torch.from_numpy(first_steps), lengths_t) + offsets
    bad = torch.nonzero(counts != expected).reshape(-1)
    if len(bad):
        i = int(bad[0])
        lane, t = divmod(int(rows[i]), time_len)
        raise StepCountError(
            f"the count of row {t} of lane {lane} is {int(counts[i])}, but that step is step "
            f"{int(expected[i])} of its episode (counted from its first step in this source's "
            "data, one more each row): counts must rise by 1 along each trajectory and "
            "continue its previous extend"
        )


def _no_observation_message(grid: dict[Key, torch.Tensor]) -> str:
    received = ", ".join(format_key(k) for k in grid)
    mirrored = [k for k in grid if k[0] == "next" and k not in _NEXT_NON_OBSERVATIONS]
    if _TRAJ_IDS in grid and not mirrored:
        return (
            "the TED data has no observation keys: no ('next', obs) repeats a root key, as in "
            "a TorchRL collector's compact_obs=True output, which drops each episode's final "
            "observation for good, so its last "
            "transitions cannot be stored exactly. Collect with compact_obs=False (millpond "
            "stores each observation once anyway); received keys " + received
        )
    return (
        "the TED data has no observation keys: expected a key at the root with the same "
        "key under 'next' (e.g. 'observation' and ('next', 'observation')); received keys "
        + received
    )


def _padding_mask(mask: torch.Tensor | None, lanes: int, time_len: int) -> torch.Tensor:
    """``[P, T]`` bool, true on real steps: ``split_trajs`` padding sits at each lane's end."""
    if mask is None:
        return torch.ones(lanes, time_len, dtype=torch.bool)
    if mask.dtype != torch.bool or mask[0, 0].numel() != 1:
        raise InvalidDataError(
            f"('collector', 'mask') must hold one bool per step, received {mask.dtype} "
            f"of shape {list(mask.shape)}"
        )
    mask = mask.reshape(lanes, time_len)
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise InvalidDataError(
            "('collector', 'mask') has a real step after padding: split_trajs padding must "
            "follow each trajectory's steps"
        )
    return mask


def _traj_ids(
    ids: torch.Tensor | None, lanes: int, time_len: int, episode_base: int
) -> torch.Tensor | None:
    """Episode ids ``[P, T]``: ``episode_base + traj_ids``, checked."""
    if ids is None:
        return None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidDataError(f"('collector', 'traj_ids') must be integers, received {ids.dtype}")
    if ids[0, 0].numel() != 1:
        raise InvalidDataError(
            f"('collector', 'traj_ids') must hold one id per step, received shape {list(ids.shape)}"
        )
    ids = ids.reshape(lanes, time_len).to(torch.int64)
    if bool((ids < 0).any()):
        raise InvalidDataError("('collector', 'traj_ids') must be >= 0 (they become episode ids)")
    limit = TRAJ_ID_LIMIT if episode_base else FRESH_EPISODE_ID_BASE
    if bool((ids >= limit).any()):
        raise InvalidDataError(
            f"('collector', 'traj_ids') must be < {limit} (they become episode ids), received "
            f"{int(ids.max())}"
        )
    return ids + episode_base
