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

import secrets
from collections.abc import Iterable

import numpy as np
import torch
from tensordict import TensorDictBase

from millpond.errors import InvalidDataError
from millpond.segments import PackedSegments, episode_ends, flatten
from millpond.spec import DONE, RESERVED_KEYS, TERMINATED, TRUNCATED, Key, dtype_name, format_key

__all__ = ["FRESH_EPISODE_ID_BASE", "compact_ted", "observation_keys", "rows_differ"]

#: Episode ids of trajectories without ``("collector", "traj_ids")`` lie in
#: ``[FRESH_EPISODE_ID_BASE, 2**63)``: random, so they need no counter to persist.
FRESH_EPISODE_ID_BASE = 1 << 62

_TRAJ_IDS: Key = ("collector", "traj_ids")
#: Leaves under ``"next"`` that are not observations.
_NEXT_NON_OBSERVATIONS = frozenset(
    {("next", "reward"), ("next", "done"), ("next", "terminated"), ("next", "truncated")}
)


def observation_keys(keys: TensorDictBase | Iterable[Key]) -> list[Key]:
    """The observation keys of TED data (a TensorDict, or its leaf keys), in key order.

    A root leaf ``k`` is an observation when ``("next", *k)`` is a leaf too, ``k`` is not
    under ``"collector"``, and it is none of the keys sampling produces itself
    (``done``/``terminated``/``truncated``, ``index``, ...) nor reward.
    """
    if isinstance(keys, TensorDictBase):
        keys = keys.keys(include_nested=True, leaves_only=True)
    leaves = [(k,) if isinstance(k, str) else tuple(k) for k in keys]
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


# -- import ---------------------------------------------------------------------------------
def compact_ted(td: TensorDictBase, extend_state: dict[int, int]) -> PackedSegments:
    """Cut TED data (batch ``[T]`` or ``[P, T]``) into segments, each observation kept once.

    Observation keys are the leaves ``k`` (possibly nested, never under ``"next"``) for
    which ``("next", *k)`` exists too, flags and reward excepted. Lane ``p``'s time axis is
    cut after step ``t`` when ``("next", "done" | "terminated" | "truncated")[p, t]`` is
    set, when ``("collector", "traj_ids")`` changes between ``t`` and ``t + 1``, or when
    any ``("next", k)[p, t]`` differs bitwise from ``k[p, t + 1]``. A segment's tail is
    ``("next", obs)`` at its last step, so the stored data gives back every input row
    exactly, terminal and truncated steps included.

    Root ``done``/``terminated``/``truncated`` and the other keys a table generates when
    sampling (``episode_id``, ``step``, ``index``, ``weight``) are dropped, as is everything
    under ``"collector"``, so sampled or exported data can be extended again. ``("next", "done")`` is checked against ``terminated | truncated``
    and then dropped (with ``done`` alone, it is taken as ``terminated``).

    Episode ids: with ``("collector", "traj_ids")``, a trajectory's id is its episode id,
    and ``extend_state`` (episode id -> next step index) carries trajectories that have not
    ended from one call to the next, so their step indexes continue. It is updated in place
    only if the call succeeds: trajectories that end here are removed, the others hold
    their next step. Without trajectory ids, lanes cannot be matched across calls: each
    lane's first trajectory starts a new episode, and so does every step that follows an
    episode end. Those episodes get random ids in ``[FRESH_EPISODE_ID_BASE, 2**63)``, far
    above the ids that counters starting from 0 (collectors' trajectory ids, writers')
    hand out, and unique across calls, processes and restarts with no state to persist
    (a collision among ``n`` such ids has probability below ``n**2 / 2**63``).
    Trajectory ids are taken as given: two sources that reuse them share episodes.

    Returns the segments packed lane after lane, in time order within a lane.
    Raises :class:`InvalidDataError` for data that is not TED.
    """
    if not isinstance(td, TensorDictBase):
        raise InvalidDataError(f"expected a TED TensorDict, received {type(td).__name__}")
    if td.batch_dims not in (1, 2):
        raise InvalidDataError(
            f"TED data must have batch size [T] or [P, T] (lanes, time); received "
            f"{list(td.batch_size)} ({td.batch_dims} batch dimensions)"
        )
    if td.device is not None and td.device.type != "cpu":
        td = td.to("cpu")
    lanes, time_len = (1, td.batch_size[0]) if td.batch_dims == 1 else tuple(td.batch_size)
    n = lanes * time_len
    if n == 0:
        raise InvalidDataError(f"TED data of batch size {list(td.batch_size)} holds no steps")

    leaves = flatten(td)
    for key, value in leaves.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidDataError(f"key {format_key(key)} is not a tensor; it cannot be stored")
    # Every leaf as [P, T, ...] (a [T] batch is one lane).
    grid = {k: v.reshape(lanes, time_len, *v.shape[td.batch_dims :]) for k, v in leaves.items()}
    obs_keys = observation_keys(grid)
    if not obs_keys:
        raise InvalidDataError(
            "the TED data has no observation keys: expected a key at the root with the same "
            "key under 'next' (e.g. 'observation' and ('next', 'observation')); received keys "
            + ", ".join(format_key(k) for k in grid)
        )
    for k in obs_keys:
        now, nxt = grid[k], grid[("next", *k)]
        if now.dtype != nxt.dtype or now.shape != nxt.shape:
            raise InvalidDataError(
                f"observation {format_key(k)} is {dtype_name(now.dtype)}{list(now.shape[2:])} "
                f"but {format_key(('next', *k))} is {dtype_name(nxt.dtype)}{list(nxt.shape[2:])}"
            )
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
    traj_ids = _traj_ids(grid.get(_TRAJ_IDS), lanes, time_len)

    # Cut after step t of a lane where the episode ends, the trajectory changes, or an
    # observation's next value is not (bitwise) the following row's value.
    cut = ended.clone()
    cut[:, -1] = True
    if traj_ids is not None:
        cut[:, :-1] |= traj_ids[:, :-1] != traj_ids[:, 1:]
    for k in obs_keys:
        differs = rows_differ(
            grid[("next", *k)][:, :-1].flatten(0, 1), grid[k][:, 1:].flatten(0, 1)
        )
        cut[:, :-1] |= differs.reshape(lanes, time_len - 1)
    cut = cut.reshape(n)
    ends = torch.nonzero(cut).reshape(-1)
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    lengths = (ends - starts + 1).numpy()

    if traj_ids is not None:
        episode_ids = traj_ids.reshape(n)[starts].numpy()
        state = dict(extend_state)
    else:
        # A segment starts a new episode at a lane's start and after an episode end.
        new_episode = (starts % time_len == 0) | ended.reshape(n)[starts - 1]
        n_new = int(new_episode.sum())
        fresh = np.array(
            [FRESH_EPISODE_ID_BASE + secrets.randbits(62) for _ in range(n_new)], dtype=np.int64
        )
        episode_ids = fresh[(torch.cumsum(new_episode.long(), 0) - 1).numpy()]
        state = {}
    first_steps = np.empty(len(lengths), dtype=np.int64)
    seg_ended = ended.reshape(n)[ends].tolist()
    for i, (ep, length, done) in enumerate(
        zip(episode_ids.tolist(), lengths.tolist(), seg_ended, strict=True)
    ):
        first_steps[i] = state.get(ep, 0)
        if done:
            state.pop(ep, None)
        else:
            state[ep] = int(first_steps[i]) + length

    steps: dict[Key, torch.Tensor] = {}
    for key, value in grid.items():
        if (
            key[0] == "collector"
            or key[:1] in RESERVED_KEYS
            or key in (DONE, TERMINATED, TRUNCATED)
            or (key[0] == "next" and key[1:] in obs_keys)
        ):
            continue
        steps[key] = value.reshape(n, *value.shape[2:])
    steps[TERMINATED] = terminated
    steps[TRUNCATED] = truncated
    tails = {k: grid[("next", *k)].reshape(n, *grid[k].shape[2:])[ends] for k in obs_keys}

    if traj_ids is not None:
        extend_state.clear()
        extend_state.update(state)
    return PackedSegments(steps, tails, lengths.astype(np.int64), episode_ids, first_steps)


def _traj_ids(ids: torch.Tensor | None, lanes: int, time_len: int) -> torch.Tensor | None:
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
    return ids
