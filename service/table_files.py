"""A table's directory: creating and opening it, its JSON files and counters, recovery.

Layout of one table's directory::

    meta.json       format, config and a copy of the counters (rewritten atomically)
    writers.json    highest stored sequence of each writer, for idempotent re-sends
    counters.bin    int64[8], see :class:`Counter`
    priorities.bin  prioritized tables: raw priorities (the sampler's own file)
    data/           the segments (:class:`~millpond.service.storage.SegmentStorage`):
                    columns/, slots.bin (4 bytes per slot), segments.bin (a record per segment)

A table is there once ``meta.json`` is; everything in memory that the files do not hold
(the sampler's index, open episodes, writer marks) is rebuilt from them by :meth:`recover`.
"""

from __future__ import annotations

import json
import os
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from millpond.config import TableConfig
from millpond.errors import StorageCorruptedError
from millpond.service.atomic_json import atomic_write_json
from millpond.service.storage import (
    SEGMENTS_FILE,
    SLOTS_FILE,
    SegmentBatch,
    SegmentStorage,
    column_filename,
)
from millpond.spec import OBSERVATION, TERMINATED, TRUNCATED, TableSpec

if TYPE_CHECKING:
    from millpond.service.samplers import Sampler

#: The on-disk format. 2: slot metadata is an int32 record pointer per slot plus one record
#: per segment (``slots.bin``, ``segments.bin``); 1 had eight int64 fields per slot.
FORMAT = 2
META_FILE = "meta.json"
WRITERS_FILE = "writers.json"
COUNTERS_FILE = "counters.bin"
_N_COUNTERS = 8  # room for more counters without a new format


class Counter(IntEnum):
    """The entries of ``counters.bin`` (memory-mapped, so the counts survive a killed process)."""

    INSERTS = 0  # the rate limiter's
    SAMPLES = 1  # the rate limiter's
    NEXT_GENERATION = 2
    QUEUE_CURSOR = 3  # the queue sampler's: the last delivered generation


def holds_table(path: Path) -> bool:
    return (path / META_FILE).exists()


def new_table_dir(path: str | os.PathLike) -> Path:
    """``path``, created if missing, for a new table; :class:`FileExistsError` if it holds one."""
    path = Path(path)
    if holds_table(path):
        raise FileExistsError(f"{path} already holds a table")
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_config(path: Path) -> TableConfig:
    """The config of the table stored in ``path`` (:class:`StorageCorruptedError` if none)."""
    meta_file = path / META_FILE
    if not meta_file.exists():
        raise StorageCorruptedError(f"{path} holds no table (missing {META_FILE})")
    try:
        meta = json.loads(meta_file.read_text())
        config = TableConfig.from_json(meta["config"])
    except (ValueError, KeyError) as e:
        raise StorageCorruptedError(f"{meta_file} is unreadable: {e}") from e
    fmt = meta.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt < FORMAT:
        raise StorageCorruptedError(
            f"{meta_file}: the table was written in on-disk format {fmt}, and this millpond "
            f"reads format {FORMAT} only (the format changed: since format 2 the slot metadata "
            "is a 4-byte pointer per slot plus a record per segment, not 64 bytes per slot). "
            "Export it with the millpond that wrote it (millpond.service.export) and insert "
            "it into a new table, or create the table anew."
        )
    if fmt != FORMAT:
        raise StorageCorruptedError(f"{meta_file}: unknown format {fmt!r}")
    return config


#: The parts of a table directory that :func:`disk_usage` tells apart.
DISK_PARTS = (
    "observations",  # observation column files (step and tail slots)
    "step fields",  # the other column files (actions, rewards, flags, ...)
    "slot pointers",  # data/slots.bin
    "segment records",  # data/segments.bin
    "sampler",  # the sampler's own files (priorities.bin)
    "table files",  # meta.json, writers.json, counters.bin, columns/index.json, ...
)


def disk_usage(path: str | os.PathLike, spec: TableSpec | None) -> dict[str, int]:
    """Bytes on disk (``st_blocks * 512``: sparse regions never written count nothing) of
    every file under the table directory ``path``, by part (see :data:`DISK_PARTS`)."""
    from millpond.service.samplers import PRIORITIES_FILE  # imports this module

    path = Path(path)
    data = path / "data"
    observation_files = set()
    if spec is not None:
        observation_files = {
            column_filename(k) for k, f in spec.fields.items() if f.role == OBSERVATION
        }
    usage = dict.fromkeys(DISK_PARTS, 0)
    for p in path.rglob("*"):
        if not p.is_file():
            continue
        if p == data / SLOTS_FILE:
            part = "slot pointers"
        elif p == data / SEGMENTS_FILE:
            part = "segment records"
        elif p.parent == data / "columns" and p.suffix == ".bin":
            part = "observations" if p.name in observation_files else "step fields"
        elif p == path / PRIORITIES_FILE:
            part = "sampler"
        else:
            part = "table files"
        usage[part] += p.stat().st_blocks * 512
    return usage


class Recovered(NamedTuple):
    """What :meth:`TableFiles.recover` rebuilds besides the storage and the sampler."""

    writer_sequences: dict[int, int]  # writer hash -> highest stored sequence
    open_episodes: dict[int, int]  # episode id -> next step, for episodes not ended


class TableFiles:
    """The table's own files in ``path``: ``meta.json``, ``writers.json``, ``counters.bin``.

    ``fresh`` creates them (the counters zeroed); otherwise they are opened as they are.
    """

    def __init__(self, path: Path, *, fresh: bool) -> None:
        self.path = path
        self._counters = np.memmap(
            path / COUNTERS_FILE, dtype=np.int64, mode="w+" if fresh else "r+", shape=(_N_COUNTERS,)
        )
        if fresh:
            self._counters[Counter.NEXT_GENERATION] = 1

    @property
    def limiter_counters(self) -> np.ndarray:
        """Inserts and samples, for the rate limiter to count in (a view of the file)."""
        return self._counters[Counter.INSERTS : Counter.SAMPLES + 1]

    @property
    def next_generation(self) -> int:
        return int(self._counters[Counter.NEXT_GENERATION])

    def take_generations(self, n: int) -> int:
        """Number ``n`` new segments; returns the first of their generations."""
        first = int(self._counters[Counter.NEXT_GENERATION])
        self._counters[Counter.NEXT_GENERATION] = first + n
        return first

    def reset_counters(self) -> int:
        """Zero every counter but the next generation, and return that.

        Generations keep counting up so that indexes sampled before stay stale.
        """
        next_gen = int(self._counters[Counter.NEXT_GENERATION])
        self._counters[:] = 0
        self._counters[Counter.NEXT_GENERATION] = next_gen
        # What a queue sampler's reset sets too: every dropped generation counts as delivered.
        self._counters[Counter.QUEUE_CURSOR] = next_gen - 1
        return next_gen

    def flush(self) -> None:
        self._counters.flush()

    def write_meta(self, config: TableConfig, writer_sequences: dict[int, int]) -> None:
        """Rewrite ``writers.json`` then ``meta.json``, each atomically."""
        atomic_write_json(
            self.path / WRITERS_FILE, {str(k): v for k, v in writer_sequences.items()}
        )
        c = self._counters
        atomic_write_json(
            self.path / META_FILE,
            {
                "format": FORMAT,
                "config": config.to_json(),
                "counters": {
                    "inserts": int(c[Counter.INSERTS]),
                    "samples": int(c[Counter.SAMPLES]),
                    "next_generation": int(c[Counter.NEXT_GENERATION]),
                    "queue_delivered_through": int(c[Counter.QUEUE_CURSOR]),
                },
            },
        )

    def recover(self, storage: SegmentStorage, sampler: Sampler) -> Recovered:
        """Rebuild the in-memory state of a reopened table from its files.

        The storage drops torn segments and the sampler takes back the others; writer marks
        come from ``writers.json`` and the stored segments (whichever is newer), and the
        next generation moves past the newest stored one.
        """
        segments = storage.recover()
        sampler.recover(segments)
        writers = self._read_writers()
        if len(segments) and segments.writers is not None and segments.sequences is not None:
            for w, q in zip(segments.writers.tolist(), segments.sequences.tolist()):
                if w and q > writers.get(w, 0):
                    writers[w] = q
        open_episodes = _open_episodes(storage, segments)
        newest = int(segments.generations.max()) if len(segments) else 0
        self._counters[Counter.NEXT_GENERATION] = max(self.next_generation, newest + 1)
        return Recovered(writers, open_episodes)

    def _read_writers(self) -> dict[int, int]:
        writers_file = self.path / WRITERS_FILE
        if not writers_file.exists():
            return {}
        try:
            saved = json.loads(writers_file.read_text())
            return {int(k): int(v) for k, v in saved.items()}
        except (ValueError, AttributeError) as e:
            raise StorageCorruptedError(f"{writers_file} is unreadable: {e}") from e


def _open_episodes(storage: SegmentStorage, segments: SegmentBatch) -> dict[int, int]:
    """Episode id -> next step, for episodes whose newest stored segment did not end."""
    if not len(segments) or storage.spec is None:
        return {}
    order = np.lexsort((segments.first_steps, segments.episode_ids))
    eps = segments.episode_ids[order]
    newest = order[np.append(eps[1:] != eps[:-1], True)]
    last_slots = segments.starts[newest] + segments.lengths[newest] - 1
    now, _ = storage.gather(last_slots)
    ended = (now[TERMINATED] | now[TRUNCATED]).numpy()
    return {
        int(segments.episode_ids[i]): int(segments.first_steps[i] + segments.lengths[i])
        for i, e in zip(newest.tolist(), ended.tolist())
        if not e
    }
