"""A table's stored steps written back out in TED form: a memory-mapped TensorDict or HDF5,
and such an export stored back into a table exactly.

The inverse of :func:`millpond.ted.compact_ted`: every stored step comes back as one TED row
with ``("next", obs)`` rebuilt from the following slot, so ``TensorDict.load_memmap`` or a
TorchRL ``ReplayBuffer.extend`` takes it as it is. :func:`import_ted` stores an export back,
episode ids and steps included, so that exporting again gives the same rows bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.config import TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.sample_format import assemble_ted
from millpond.segments import PackedSegments, flatten
from millpond.service.storage import SegmentStorage, SlotColumn
from millpond.spec import Key, dtype_name, parse_dtype
from millpond.ted import compact_ted, episode_base, observation_keys, rows_differ

if TYPE_CHECKING:
    from millpond.service.table import Table

__all__ = [
    "EXPORT_CHUNK_ROWS",
    "EXPORT_ORDERS",
    "HDF5_COMPRESSIONS",
    "ExportSummary",
    "export_hdf5",
    "export_table",
    "export_ted",
    "flat_checkpoint_breaks",
    "import_ted",
    "load_hdf5",
    "pack_export",
    "spooled_table",
]

#: Rows gathered (and held in memory) at a time by the exporters.
EXPORT_CHUNK_ROWS = 4096
#: Row orders of an export: ``"publication"`` (oldest segment first) or ``"episode"``
#: (each episode's rows together, episodes in the order their first segment was stored).
EXPORT_ORDERS = ("publication", "episode")
#: HDF5 compression filters :func:`export_hdf5` takes (``None``: none).
HDF5_COMPRESSIONS = (None, "gzip", "lzf")
#: Target bytes of one HDF5 chunk (h5py's advice: 10 KiB to 1 MiB).
_HDF5_CHUNK_BYTES = 1 << 20
_TRAJ_IDS: Key = ("collector", "traj_ids")


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_table` wrote.

    Attributes:
        rows: TED rows (stored steps) written.
        flat_breaks: rows, the last excepted, whose ``("next", obs)`` is not the following
            row's observation although their ``("next", "done")`` is false. TorchRL's
            ``FlatStorageCheckpointer`` keeps one ``("next", obs)`` only where ``done`` is
            set (and at the cursor), so a buffer filled with the export restores it exactly
            when this is 0 (see :func:`flat_checkpoint_breaks`).
    """

    rows: int
    flat_breaks: int


def export_table(
    table: Table,
    path: str | os.PathLike,
    *,
    format: str = "ted",
    order: str = "publication",
    compression: str | None = None,
    compression_opts: int | None = None,
) -> ExportSummary:
    """Export ``table`` to ``path`` as ``"ted"`` (:func:`export_ted`) or ``"hdf5"``
    (:func:`export_hdf5`, with its ``compression``); see those for the layout and ``order``."""
    if format == "ted":
        if compression is not None or compression_opts is not None:
            raise InvalidConfigError("compression is for HDF5 exports; a TED export is memmapped")
        _check_order(order)
        _, summary = _export_ted(table, Path(path), order)
        return summary
    if format == "hdf5":
        return _export_hdf5(table, path, order, compression, compression_opts)
    raise InvalidConfigError(f"unknown export format {format!r}; expected 'ted' or 'hdf5'")


def export_ted(table: Table, path: str | os.PathLike, *, order: str = "publication") -> TensorDict:
    """Write every stored step of ``table`` as a TED TensorDict memory-mapped under ``path``.

    Rows come oldest segment first (in publication order), and within a segment in step
    order; ``order="episode"`` puts each episode's rows together instead, in step order,
    episodes in the order their first stored segment was published (what TorchRL's
    trajectory samplers and its ``FlatStorageCheckpointer`` expect of a buffer). Each row
    holds the root observation keys and step keys, ``("next", obs)``, ``("next", "reward" |
    "done" | "terminated" | "truncated")`` (flags ``[N, 1]``), root
    ``done``/``terminated``/``truncated`` (``False``), ``episode_id``, ``step`` and
    ``("collector", "traj_ids")`` (the episode id), so that ``TensorDict.load_memmap(path)``
    gives it back and a TorchRL ``ReplayBuffer`` can ``extend()`` it.

    The table is read under its lock (inserts and samples wait meanwhile), a chunk of
    :data:`EXPORT_CHUNK_ROWS` rows at a time; nothing is modified. Returns the
    memory-mapped TensorDict.
    """
    _check_order(order)
    td, _ = _export_ted(table, Path(path), order)
    return td


def _export_ted(table: Table, path: Path, order: str) -> tuple[TensorDict, ExportSummary]:
    out: list[TensorDict] = []

    def open_sink(n_rows: int, template: TensorDict) -> Callable[[int, TensorDict], None]:
        dest = template.expand(n_rows).memmap_like(path, existsok=True)
        out.append(dest)

        def write(offset: int, chunk: TensorDict) -> None:
            dest[offset : offset + chunk.batch_size[0]] = chunk

        return write

    summary = _export(table, open_sink, order)
    return out[0], summary


def export_hdf5(
    table: Table,
    path: str | os.PathLike,
    *,
    order: str = "publication",
    compression: str | None = None,
    compression_opts: int | None = None,
) -> None:
    """Write what :func:`export_ted` writes into the HDF5 file ``path`` (needs ``h5py``).

    Nested keys become groups (``next/observation``); each leaf is a dataset of ``N`` rows,
    chunked by rows (about 1 MiB a chunk) and written a chunk at a time, with its torch
    dtype in the ``torch_dtype`` attribute (``bfloat16`` is stored as its ``int16`` bits).
    The file's ``num_rows`` attribute holds ``N``. ``compression`` is ``None`` (the
    default), ``"gzip"`` (``compression_opts``: its level, 0 to 9, h5py's default 4) or
    ``"lzf"``: lossless HDF5 filters, which any HDF5 reader undoes. Read it back with
    :func:`load_hdf5`.
    """
    _export_hdf5(table, path, order, compression, compression_opts)


def _export_hdf5(
    table: Table,
    path: str | os.PathLike,
    order: str,
    compression: str | None,
    compression_opts: int | None,
) -> ExportSummary:
    _check_order(order)
    if compression not in HDF5_COMPRESSIONS:
        raise InvalidConfigError(
            f"unknown HDF5 compression {compression!r}; expected one of {HDF5_COMPRESSIONS}"
        )
    if compression_opts is not None:
        if compression != "gzip":
            raise InvalidConfigError("a compression level is for gzip only")
        if (
            isinstance(compression_opts, bool)
            or not isinstance(compression_opts, int)
            or not 0 <= compression_opts <= 9
        ):
            raise InvalidConfigError(
                f"gzip compression level ({compression_opts!r}) must be an integer in [0, 9]"
            )
    h5py = _import_h5py()
    with h5py.File(path, "w") as f:

        def open_sink(n_rows: int, template: TensorDict) -> Callable[[int, TensorDict], None]:
            f.attrs["num_rows"] = n_rows
            datasets = {}
            for key, value in flatten(template).items():
                shape = tuple(value.shape[1:])
                chunked: dict[str, Any] = {}
                if n_rows:
                    row_bytes = max(1, value[:1].numel() * value.element_size())
                    rows = max(1, min(n_rows, EXPORT_CHUNK_ROWS, _HDF5_CHUNK_BYTES // row_bytes))
                    chunked = {"chunks": (rows, *shape)}
                    if compression is not None:
                        chunked.update(compression=compression, compression_opts=compression_opts)
                datasets[key] = ds = f.create_dataset(
                    "/".join(key),
                    shape=(n_rows, *shape),
                    dtype=_numpy(value[:0]).dtype,
                    **chunked,
                )
                ds.attrs["torch_dtype"] = dtype_name(value.dtype)

            def write(offset: int, chunk: TensorDict) -> None:
                rows = chunk.batch_size[0]
                for key, value in flatten(chunk).items():
                    datasets[key][offset : offset + rows] = _numpy(value)

            return write

        return _export(table, open_sink, order)


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


def flat_checkpoint_breaks(td: TensorDictBase) -> int:
    """Rows of the TED data ``td`` (batch ``[N]``) that TorchRL's ``FlatStorageCheckpointer``
    would not restore exactly: 0 means it restores every row bit for bit.

    The checkpointer stores each observation once and keeps a row's ``("next", obs)`` only
    where ``("next", "done")`` is set (and at the buffer's last written row); elsewhere it
    rebuilds it as the following row's observation. A row breaks that when its
    ``("next", obs)`` differs (bitwise) from the next row's ``obs`` with ``done`` false: in
    an export, where a segment of an unfinished episode is followed by another episode's
    rows (``order="episode"`` leaves such a row only after each unfinished episode but the
    last one).
    """
    if td.batch_dims != 1:
        raise InvalidDataError(f"expected TED rows of batch [N], received {list(td.batch_size)}")
    counter = _FlatBreaks()
    for offset in range(0, td.batch_size[0], EXPORT_CHUNK_ROWS):
        counter.add(td[offset : offset + EXPORT_CHUNK_ROWS])
    return counter.breaks


class _FlatBreaks:
    """Counts :func:`flat_checkpoint_breaks` over consecutive chunks of rows."""

    def __init__(self) -> None:
        self.breaks = 0
        self._last: tuple[dict[Key, torch.Tensor], bool] | None = None  # last row's next obs

    def add(self, chunk: TensorDictBase) -> None:
        rows = chunk.batch_size[0]
        if rows == 0:
            return
        keys = observation_keys(chunk)
        done = chunk.get(("next", "done"), None)
        done = (
            torch.zeros(rows, dtype=torch.bool) if done is None else done.reshape(rows, -1).any(-1)
        )
        differs = torch.zeros(rows, dtype=torch.bool)  # row r: next obs vs obs of row r + 1
        first = torch.zeros((), dtype=torch.bool)
        for k in keys:
            now, nxt = chunk[k], chunk[("next", *k)]
            differs[:-1] |= rows_differ(nxt[:-1], now[1:])
            if self._last is not None:
                first |= rows_differ(self._last[0][k], now[:1])[0]
        if self._last is not None and bool(first) and not self._last[1]:
            self.breaks += 1
        self.breaks += int((differs[:-1] & ~done[:-1]).sum())
        self._last = ({k: chunk[("next", *k)][-1:].clone() for k in keys}, bool(done[-1]))


@contextlib.contextmanager
def spooled_table(
    name: str,
    segments: Iterable[PackedSegments],
    slots: int,
    directory: str | os.PathLike,
) -> Iterator[Table]:
    """A temporary table ``name`` under ``directory`` holding ``segments`` (stored in the
    order given, episode ids and first steps kept), for the exporters to read as they read
    any table; deleted afterwards.

    ``slots``: what the segments take at most (steps + segments), its capacity. A
    snapshot read from a running service (``ReplayClient.read_table``) becomes a table this
    way, so that its exports are those of a shard directory holding the same segments.
    """
    from millpond.service.table import Table  # the table imports nothing of the exporters

    work = Path(tempfile.mkdtemp(prefix=".millpond-snapshot-", dir=directory))
    try:
        table = Table.create(work / name, TableConfig(name=name, capacity=max(2, int(slots))))
        try:
            stored = 0
            for packed in segments:
                stored += packed.num_steps + len(packed)
                if stored > table.config.capacity:
                    raise InvalidDataError(
                        f"the segments take more than the {slots} slots announced for them"
                    )
                table.insert_packed(packed, timeout=0)
            yield table
        finally:
            table.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- import ---------------------------------------------------------------------------------
def pack_export(td: TensorDictBase, *, source: str | None = None) -> PackedSegments:
    """The segments that store the exported rows ``td`` (batch ``[N]``) exactly.

    Rows are cut into segments as :func:`~millpond.ted.compact_ted` cuts them, and also
    wherever ``episode_id`` changes or ``step`` does not count up by one; each segment keeps
    the ``episode_id`` and ``step`` of its rows. So a table that stores them exports the
    same rows again, bit for bit and in the same order (the segments are stored in row
    order), whatever the episode ids (random ones too) and wherever the episodes' stored
    steps began. With ``source``, episodes are numbered anew in that extend source's range
    (:func:`~millpond.ted.episode_base` plus the episode's rank in ``td``), so they never
    join the table's other episodes; steps are kept.

    Data without ``episode_id`` and ``step`` (TED that no millpond table exported) is cut
    by :func:`~millpond.ted.compact_ted` alone, as :meth:`Table.extend` would, with
    ``("collector", "traj_ids")`` in ``source``'s range.
    """
    base = 0 if source is None else episode_base(source)
    if not isinstance(td, TensorDictBase):
        raise InvalidDataError(f"expected a TED TensorDict, received {type(td).__name__}")
    if "episode_id" not in td or "step" not in td:
        return compact_ted(td, {}, base)
    if td.batch_dims != 1:
        raise InvalidDataError(f"exported rows have batch size [N]; received {list(td.batch_size)}")
    n = td.batch_size[0]
    if n == 0:
        raise InvalidDataError("the export holds no rows")
    episodes = _int_column(td, "episode_id", n)
    steps = _int_column(td, "step", n)
    # Runs: rows of one episode with consecutive steps. Each becomes a trajectory of its own,
    # so compact_ted cuts between runs (and within them, where observations do not chain).
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = (episodes[1:] != episodes[:-1]) | (steps[1:] != steps[:-1] + 1)
    run_of_row = np.cumsum(new_run) - 1
    run_starts = np.flatnonzero(new_run)
    rows = td.exclude("episode_id", "step", "collector")
    rows.set(_TRAJ_IDS, torch.from_numpy(run_of_row.astype(np.int64)))
    packed = compact_ted(rows, {}, 0)  # one lane: segments in row order
    run_episodes = episodes[run_starts]
    if source is not None:
        uniq, first, inverse = np.unique(run_episodes, return_index=True, return_inverse=True)
        rank = np.empty(len(uniq), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(uniq), dtype=np.int64)
        run_episodes = base + rank[inverse.reshape(-1)]
    segment_starts = np.cumsum(packed.lengths) - packed.lengths
    return dataclasses.replace(
        packed,
        episode_ids=run_episodes[packed.episode_ids],  # compact_ted's ids are the run numbers
        first_steps=steps[segment_starts].copy(),
    )


def import_ted(
    table: Table,
    td: TensorDictBase | PackedSegments,
    *,
    source: str | None = None,
    timeout: float | None = None,
) -> int:
    """Store exported rows ``td`` into ``table`` exactly (see :func:`pack_export`; ``td`` may
    be what it returned already); returns the rows stored.

    Refused (:class:`InvalidDataError`, nothing stored) where the rows would not fit the
    table at once: they need ``rows + segments`` slots, and a table smaller than that would
    evict some of them while storing the rest. ``timeout`` bounds the wait for the table's
    rate limiter (or full queue), as in :meth:`Table.insert`.
    """
    packed = td if isinstance(td, PackedSegments) else pack_export(td, source=source)
    needed = packed.num_steps + len(packed)
    if needed > table.config.capacity:
        raise InvalidDataError(
            f"the {packed.num_steps} rows need {needed} slots ({len(packed)} segments of L steps "
            f"take L + 1 each), more than table {table.name!r} holds "
            f"(capacity {table.config.capacity}): it would evict some of them"
        )
    table.insert_packed(packed, timeout)
    return packed.num_steps


def _int_column(td: TensorDictBase, key: str, n: int) -> np.ndarray:
    value = td.get(key)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise InvalidDataError(f"{key!r} must hold integers, received {value.dtype}")
    if value.numel() != n:
        raise InvalidDataError(f"{key!r} must hold one value per row, received {list(value.shape)}")
    out = value.reshape(n).to(torch.int64).numpy()
    if (out < 0).any():
        raise InvalidDataError(f"{key!r} must be >= 0")
    return out


# -- export internals -----------------------------------------------------------------------
def _check_order(order: str) -> None:
    if order not in EXPORT_ORDERS:
        raise InvalidConfigError(f"unknown export order {order!r}; expected one of {EXPORT_ORDERS}")


def _export(
    table: Table,
    open_sink: Callable[[int, TensorDict], Callable[[int, TensorDict], None]],
    order: str = "publication",
) -> ExportSummary:
    """Feed ``table``'s stored steps, as TED chunks, to a sink made by ``open_sink(n, template)``.

    ``template`` is a one-row TED TensorDict with the output's keys, dtypes and shapes (its
    values are meaningless); the sink is then called with ``(row offset, chunk)``.
    """
    flat = _FlatBreaks()
    table.verify_all()  # a reopened table's unverified segments: every row is read
    with table.reading() as storage:
        if storage.spec is None:  # nothing was ever inserted
            open_sink(0, TensorDict({}, batch_size=[1]))
            return ExportSummary(0, 0)
        slots = storage.published_step_slots()
        if order == "episode":
            slots = _episode_order(storage, slots)
        write = open_sink(len(slots), _ted_rows(storage, np.zeros(1, dtype=np.int64)))
        for offset in range(0, len(slots), EXPORT_CHUNK_ROWS):
            chunk = _ted_rows(storage, slots[offset : offset + EXPORT_CHUNK_ROWS])
            write(offset, chunk)
            flat.add(chunk)
    return ExportSummary(len(slots), flat.breaks)


def _episode_order(storage: SegmentStorage, slots: np.ndarray) -> np.ndarray:
    """``slots`` (in publication order) grouped by episode, in step order within each,
    episodes in the order of their first slot."""
    if len(slots) == 0:
        return slots
    info = [
        storage.slot_info(slots[i : i + EXPORT_CHUNK_ROWS])[
            :, [SlotColumn.EPISODE_ID, SlotColumn.STEP]
        ]
        for i in range(0, len(slots), EXPORT_CHUNK_ROWS)
    ]
    episodes, steps = np.concatenate(info).T
    uniq, first, inverse = np.unique(episodes, return_index=True, return_inverse=True)
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniq), dtype=np.int64)
    return slots[np.lexsort((steps, rank[inverse.reshape(-1)]))]


def _ted_rows(storage: SegmentStorage, slots: np.ndarray) -> TensorDict:
    """The TED rows of step ``slots`` as the table samples them, plus collector traj ids."""
    now, nxt = storage.gather(slots)
    info = storage.slot_info(slots)
    td = assemble_ted(
        now,
        nxt,
        slots,
        generations=info[:, SlotColumn.GENERATION],
        episode_ids=info[:, SlotColumn.EPISODE_ID],
        steps=info[:, SlotColumn.STEP],
    )
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
