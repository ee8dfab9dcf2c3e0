"""Conversion between TorchRL's TED format and millpond's compact segment tables.

TED (TorchRL Episode Data) stores every observation twice: at the root for step ``t`` and
under ``"next"`` for step ``t``'s successor. :func:`compact_ted` cuts TED data into
segments whose ``("next", obs)`` is the following row's ``obs``, so each observation is
stored once (see the *compact segment layout* in the design notes); :func:`export_ted` and
:func:`export_hdf5` write a table's stored steps back out in TED form.

Import is lossless for any input: a segment is cut wherever the next observation is not
bitwise the following row's observation, so nothing is ever inferred.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.errors import InvalidDataError
from millpond.service.sample_format import assemble_ted
from millpond.service.segments import PackedSegments, _as_flags, flatten
from millpond.service.spec import (
    DONE,
    RESERVED_KEYS,
    TERMINATED,
    TRUNCATED,
    Key,
    dtype_name,
    format_key,
    parse_dtype,
)
from millpond.service.storage import _GEN, _KIND, SLOT_STEP

if TYPE_CHECKING:
    from millpond.service.table import Table

#: Episode ids of trajectories without ``("collector", "traj_ids")`` lie in
#: ``[FRESH_EPISODE_ID_BASE, 2**63)``: random, so they need no counter to persist.
FRESH_EPISODE_ID_BASE = 1 << 62
#: Rows gathered (and held in memory) at a time by the exporters.
EXPORT_CHUNK_ROWS = 4096

_TRAJ_IDS: Key = ("collector", "traj_ids")
_FLAG_NAMES = ("done", "terminated", "truncated")


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
    flag_keys = {("next", f) for f in _FLAG_NAMES} | {("next", "reward")}
    obs_keys = [
        k
        for k in grid
        if k[0] not in ("next", "collector")
        and k[:1] not in RESERVED_KEYS
        and ("next", *k) in grid
        and ("next", *k) not in flag_keys
    ]
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
    terminated, truncated = _episode_ends(
        {
            k: grid[k].reshape(n, *grid[k].shape[2:])
            for k in (DONE, TERMINATED, TRUNCATED)
            if k in grid
        },
        n,
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
        cut[:, :-1] |= _differs(grid[("next", *k)][:, :-1], grid[k][:, 1:])
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


def _episode_ends(flags: dict[Key, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``terminated`` and ``truncated`` ``[n]``, by the rules of ``normalize_steps``."""
    done, term, trunc = flags.get(DONE), flags.get(TERMINATED), flags.get(TRUNCATED)
    if term is None and done is None:
        raise InvalidDataError(
            "TED data needs ('next', 'terminated') and ('next', 'truncated'), or ('next', 'done')"
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


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[P, T']``: whether rows of ``a`` and ``b`` (``[P, T', ...]``) differ in any bit.

    Floating-point values are compared as integers of their width, so NaNs with the same
    bits are equal and ``-0.0`` differs from ``0.0``.
    """
    lanes, steps = a.shape[:2]
    if a.dtype.is_floating_point or a.dtype.is_complex:
        bits = _SAME_WIDTH_INT.get(a.element_size())
        if bits is None:  # complex128: a view as int64 needs contiguous rows
            a, b, bits = a.contiguous(), b.contiguous(), torch.int64
        a, b = a.view(bits), b.view(bits)
    if a.numel() == 0:
        return torch.zeros(lanes, steps, dtype=torch.bool)
    return (a != b).reshape(lanes, steps, -1).any(-1)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- export ---------------------------------------------------------------------------------
def export_ted(table: Table, path: str | os.PathLike) -> TensorDict:
    """Write every stored step of ``table`` as a TED TensorDict memory-mapped under ``path``.

    Rows come oldest segment first (in publication order), and within a segment in step
    order. Each row holds the root observation keys and step keys, ``("next", obs)``,
    ``("next", "reward" | "done" | "terminated" | "truncated")`` (flags ``[N, 1]``), root
    ``done``/``terminated``/``truncated`` (``False``), ``episode_id``, ``step`` and
    ``("collector", "traj_ids")`` (the episode id), so that ``TensorDict.load_memmap(path)``
    gives it back and a TorchRL ``ReplayBuffer`` can ``extend()`` it.

    The table is read under its lock (inserts and samples wait meanwhile), a chunk of
    :data:`EXPORT_CHUNK_ROWS` rows at a time; nothing is modified. Returns the
    memory-mapped TensorDict.
    """
    path = Path(path)
    out: list[TensorDict] = []

    def open_sink(n_rows: int, template: TensorDict) -> Callable[[int, TensorDict], None]:
        dest = template.expand(n_rows).memmap_like(path, existsok=True)
        out.append(dest)

        def write(offset: int, chunk: TensorDict) -> None:
            dest[offset : offset + chunk.batch_size[0]] = chunk

        return write

    _export(table, open_sink)
    return out[0]


def export_hdf5(table: Table, path: str | os.PathLike) -> None:
    """Write what :func:`export_ted` writes into the HDF5 file ``path`` (needs ``h5py``).

    Nested keys become groups (``next/observation``); each leaf is a dataset of ``N`` rows,
    chunked by rows and written a chunk at a time, with its torch dtype in the
    ``torch_dtype`` attribute (``bfloat16`` is stored as its ``int16`` bits). The file's
    ``num_rows`` attribute holds ``N``. Read it back with :func:`load_hdf5`.
    """
    h5py = _import_h5py()
    with h5py.File(path, "w") as f:

        def open_sink(n_rows: int, template: TensorDict) -> Callable[[int, TensorDict], None]:
            f.attrs["num_rows"] = n_rows
            datasets = {}
            for key, value in flatten(template).items():
                shape = tuple(value.shape[1:])
                datasets[key] = ds = f.create_dataset(
                    "/".join(key),
                    shape=(n_rows, *shape),
                    dtype=_numpy(value[:0]).dtype,
                    chunks=(max(1, min(n_rows, EXPORT_CHUNK_ROWS)), *shape) if n_rows else None,
                )
                ds.attrs["torch_dtype"] = dtype_name(value.dtype)

            def write(offset: int, chunk: TensorDict) -> None:
                rows = chunk.batch_size[0]
                for key, value in flatten(chunk).items():
                    datasets[key][offset : offset + rows] = _numpy(value)

            return write

        _export(table, open_sink)


def load_hdf5(path: str | os.PathLike) -> TensorDict:
    """Read a file written by :func:`export_hdf5` into a TensorDict of batch ``[N]``."""
    h5py = _import_h5py()
    leaves: dict[Key, torch.Tensor] = {}
    with h5py.File(path, "r") as f:
        n_rows = int(f.attrs["num_rows"])

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                dtype = parse_dtype(obj.attrs["torch_dtype"])
                value = torch.from_numpy(np.ascontiguousarray(obj[()]))
                leaves[tuple(name.split("/"))] = (
                    value.view(dtype) if value.dtype != dtype else value
                )

        f.visititems(visit)
    root: dict[str, Any] = {}
    for key, value in leaves.items():
        d = root
        for part in key[:-1]:
            d = d.setdefault(part, {})
        d[key[-1]] = value
    return TensorDict(root, batch_size=[n_rows])


def _export(
    table: Table, open_sink: Callable[[int, TensorDict], Callable[[int, TensorDict], None]]
) -> None:
    """Feed ``table``'s stored steps, as TED chunks, to a sink made by ``open_sink(n, template)``.

    ``template`` is a one-row TED TensorDict with the output's keys, dtypes and shapes (its
    values are meaningless); the sink is then called with ``(row offset, chunk)``.
    """
    with table._cond:
        table._check_open()
        storage = table.storage
        if storage.spec is None:  # nothing was ever inserted
            open_sink(0, TensorDict({}, batch_size=[1]))
            return
        meta = np.asarray(storage.meta)
        slots = np.flatnonzero((meta[:, _GEN] > 0) & (meta[:, _KIND] == SLOT_STEP))
        slots = slots[np.lexsort((slots, meta[slots, _GEN]))]  # by generation, then slot
        write = open_sink(len(slots), _ted_rows(table, np.zeros(1, dtype=np.int64)))
        for offset in range(0, len(slots), EXPORT_CHUNK_ROWS):
            write(offset, _ted_rows(table, slots[offset : offset + EXPORT_CHUNK_ROWS]))


def _ted_rows(table: Table, slots: np.ndarray) -> TensorDict:
    """The TED rows of step ``slots`` as the table samples them, plus collector traj ids."""
    now, nxt = table.storage.gather(slots)
    td = assemble_ted(now, nxt, slots, table.storage.slot_info(slots))
    td = td.exclude("index")
    td["collector", "traj_ids"] = td["episode_id"].clone()
    return td


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: keep the bits
        t = t.view(torch.int16)
    return t.numpy()


def _import_h5py() -> Any:
    try:
        import h5py
    except ImportError as e:
        raise ImportError("HDF5 files need h5py: pip install 'millpond[hdf5]'") from e
    return h5py
