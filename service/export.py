"""A table's stored steps written back out in TED form: a memory-mapped TensorDict or HDF5.

The inverse of :func:`millpond.ted.compact_ted`: every stored step comes back as one TED row
with ``("next", obs)`` rebuilt from the following slot, so ``TensorDict.load_memmap`` or a
TorchRL ``ReplayBuffer.extend`` takes it as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from millpond.sample_format import assemble_ted
from millpond.segments import flatten
from millpond.service.storage import SegmentStorage, SlotColumn
from millpond.spec import Key, dtype_name, parse_dtype

if TYPE_CHECKING:
    from millpond.service.table import Table

__all__ = ["EXPORT_CHUNK_ROWS", "export_hdf5", "export_ted", "load_hdf5"]

#: Rows gathered (and held in memory) at a time by the exporters.
EXPORT_CHUNK_ROWS = 4096


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
    with table.reading() as storage:
        if storage.spec is None:  # nothing was ever inserted
            open_sink(0, TensorDict({}, batch_size=[1]))
            return
        slots = storage.published_step_slots()
        write = open_sink(len(slots), _ted_rows(storage, np.zeros(1, dtype=np.int64)))
        for offset in range(0, len(slots), EXPORT_CHUNK_ROWS):
            write(offset, _ted_rows(storage, slots[offset : offset + EXPORT_CHUNK_ROWS]))


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
