"""Reading sampled observations straight from a table's files, on the shard's host.

A learner on the same host as a shard asks the shard only which slots it sampled (the
sampler, priorities and rate limiter stay on the shard, so counting stays exact) and reads
the observation rows from the table's memory-mapped column files itself: no copy into a
message, none out of it. :class:`ColocatedReader` opens those files read-only.

The files are written while they are read. A writer unpublishes a segment (clears its
generation) before it overwrites its slots, and generations are never reused, so a slot
whose generation, read *after* its rows, is still the one the shard sampled was not
overwritten while it was read: :meth:`ColocatedReader.read` reports the others, and the
caller draws those rows again rather than return them torn.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from millpond.errors import ColocationError
from millpond.frame_stacks import rebuild
from millpond.spec import OBSERVATION, Key, TableSpec, format_key
from millpond.storage_format import (
    CHAIN_WIDTH,
    CHAINS_FILE,
    COLUMN_INDEX,
    COLUMNS_DIR,
    RECORD_WIDTH,
    SEGMENTS_FILE,
    SLOTS_FILE,
    ChainField,
    RecordField,
    num_prefix_rows,
    records_in,
    storage_identity,
)

__all__ = ["ColocatedReader", "host_id"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This host's identity: its hostname and the kernel's boot id (so a rebooted host, or
    another one of the same name, never matches). Containers of one host that share the
    hostname match; the storage token then tells whether they share the files too."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _map_readonly(file: Path, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    """The bytes of ``file`` mapped read-only, ``[shape[0], row bytes]`` (its size checked
    first)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    expected = shape[0] * row
    size = file.stat().st_size
    if size != expected:
        raise ColocationError(f"{file} has {size} bytes, expected {expected}")
    # A plain ndarray view: numpy's memmap subclass costs microseconds on every indexing.
    return np.memmap(file, dtype=np.uint8, mode="r", shape=(shape[0], row)).view(np.ndarray)


def _as_tensor(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The mapped bytes ``raw`` as a tensor of ``shape`` and ``dtype`` (no copy)."""
    with warnings.catch_warnings():
        # The map is read-only and is only ever read: torch warns that it cannot write it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw.reshape(-1))
    return flat.view(dtype).reshape(shape)


def _open_readonly(file: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``file`` mapped read-only as a tensor of ``shape`` (its size checked first)."""
    return _as_tensor(_map_readonly(file, shape, dtype), shape, dtype)


class ColocatedReader:
    """The observation columns of one table, mapped read-only from its storage directory.

    Args:
        directory: the table's storage directory (``TableInfo.storage_dir``).
        token: the storage token the shard reported; the directory must hold the same.
        capacity: the table's slots.
        spec: the table's fields (only the observation keys are read).
        stacks: its frame-stacked keys and their frame counts (``TableConfig.frame_stacks``).

    Raises :class:`ColocationError`, saying why, where the files cannot be opened or are not
    that table's.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        token: str,
        capacity: int,
        spec: TableSpec,
        stacks: Mapping[Key, int] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.token = token
        self.capacity = capacity
        if not self.directory.is_absolute():
            raise ColocationError(f"storage directory {str(directory)!r} is not absolute")
        if not self.directory.is_dir():
            raise ColocationError(f"storage directory {self.directory} is not on this host")
        found = storage_identity(self.directory)
        if found is None:
            raise ColocationError(
                f"cannot read the storage token and files of {self.directory} here (no token, "
                "or no permission to read them)"
            )
        if found != token:
            raise ColocationError(
                f"storage directory {self.directory} holds another table's files (storage "
                f"token {found!r}, the shard's is {token!r})"
            )
        stacks = dict(stacks or {})
        try:
            index = json.loads((self.directory / COLUMNS_DIR / COLUMN_INDEX).read_text())
            files = {tuple(c["key"]): c["file"] for c in index["columns"]}
            prefix_files = {tuple(p["key"]): p["file"] for p in index.get("prefixes", [])}
            self._slots = _open_readonly(self.directory / SLOTS_FILE, (capacity,), torch.int32)
            records_file = self.directory / SEGMENTS_FILE
            n_records = records_in(records_file.stat().st_size, capacity)
            self._records = _open_readonly(records_file, (n_records, RECORD_WIDTH), torch.int64)
            # Where each segment's older frames are (tables with frame stacks made before
            # chains.bin have none: their prefixes are indexed by record).
            chains_file = self.directory / CHAINS_FILE
            self._chains: torch.Tensor | None = None
            if stacks and chains_file.exists():
                self._chains = _open_readonly(chains_file, (n_records, CHAIN_WIDTH), torch.int64)
            self.columns: dict[Key, torch.Tensor] = {}
            self.prefixes: dict[Key, torch.Tensor] = {}
            self._rows: dict[Key, np.ndarray] = {}  # the columns' bytes, a row per slot
            for key, f in spec.fields.items():
                if f.role != OBSERVATION:
                    continue
                if key not in files:
                    raise ColocationError(f"{COLUMN_INDEX} names no file for {format_key(key)}")
                file = self.directory / COLUMNS_DIR / files[key]
                if key in stacks:
                    k, frame = stacks[key], tuple(f.shape[1:])
                    self.columns[key] = _open_readonly(file, (capacity, *frame), f.dtype)
                    if key not in prefix_files:
                        raise ColocationError(f"no prefix file for {format_key(key)}")
                    self.prefixes[key] = _open_readonly(
                        self.directory / prefix_files[key],  # relative to the storage
                        (num_prefix_rows(capacity), k - 1, *frame),
                        f.dtype,
                    )
                else:
                    raw = _map_readonly(file, (capacity, *f.shape), f.dtype)
                    self._rows[key] = raw
                    self.columns[key] = _as_tensor(raw, (capacity, *f.shape), f.dtype)
        except ColocationError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ColocationError(f"cannot open the files in {self.directory}: {e}") from None
        self._spec = spec

    def __repr__(self) -> str:
        return f"ColocatedReader({str(self.directory)!r})"

    def generations(self, slots: torch.Tensor) -> torch.Tensor:
        """The generation each slot's segment has now (0 where none is published)."""
        pointers = torch.index_select(self._slots, 0, slots).long()
        return torch.index_select(self._records[:, RecordField.GENERATION], 0, pointers)

    def read(
        self,
        slots: torch.Tensor,
        generations: torch.Tensor,
        rows: torch.Tensor,
        next_rows: torch.Tensor,
    ) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor], torch.Tensor]:
        """The observations and next observations of a sampled batch, and which distinct
        slots were overwritten while they were read.

        Args:
            slots: int64 ``[U]``, the distinct observation slots (``ColocatedRows.slots``).
            generations: int64 ``[U]``, the generation each had when sampled.
            rows: int32, the batch's shape: the slot of each step's observation.
            next_rows: int32, the batch's shape: the slot of each step's next observation.

        Returns ``(obs, next_obs, stale)``: ``{key: [*batch, *shape]}`` twice, and a bool
        ``[U]`` true where the slot's generation, read after its rows, differs from
        ``generations``; the rows that read such a slot hold garbage and must be redrawn.
        """
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ColocationError(f"slots outside the table's {self.capacity} slots")
        shape = tuple(rows.shape)
        at = torch.index_select(slots, 0, rows.reshape(-1).long())
        at_next = torch.index_select(slots, 0, next_rows.reshape(-1).long())
        obs: dict[Key, torch.Tensor] = {}
        nxt: dict[Key, torch.Tensor] = {}
        starts = records = None
        if self.prefixes:  # a step and its next slot are in one segment: one lookup serves both
            records = torch.index_select(self._slots, 0, slots).long()
            if self._chains is None:
                starts = torch.index_select(self._records[:, RecordField.START], 0, records)
            else:  # a segment that continues its chain reads back to the chain's start
                chain = torch.index_select(self._chains, 0, records)
                starts = chain[:, ChainField.START].contiguous()
                records = chain[:, ChainField.PREFIX].contiguous()
        for key, col in self.columns.items():
            feature = tuple(col.shape[1:])
            if key in self.prefixes:
                assert starts is not None and records is not None
                for out, where, r in ((obs, at, rows), (nxt, at_next, next_rows)):
                    r = r.reshape(-1).long()
                    stacked = rebuild(col, self.prefixes[key], where, starts[r], records[r])
                    out[key] = stacked.reshape(*shape, *stacked.shape[1:])
                continue
            # One buffer for both: two of megabytes each, freed together, would make the
            # allocator hand their pages back and fault them in again on every batch.
            both = np.empty((2, len(at), self._rows[key].shape[1]), dtype=np.uint8)
            for i, (out, where) in enumerate(((obs, at), (nxt, at_next))):
                # "clip" copies straight into the buffer ("raise" goes through a
                # temporary); the slots were checked above.
                np.take(self._rows[key], where.numpy(), axis=0, out=both[i], mode="clip")
                values = torch.from_numpy(both[i]).view(col.dtype)
                out[key] = values.reshape(*shape, *feature)
        # After every read: a slot overwritten meanwhile was unpublished before its rows were.
        stale = self.generations(slots) != generations
        return obs, nxt, stale
