"""A table's directory: creating and opening it, its JSON files and counters, recovery.

Layout of one table's directory::

    meta.json       format, config (and its SHA-256), a copy of the counters (rewritten
                    atomically)
    writers.json    highest stored sequence of each writer, for idempotent re-sends
    counters.bin    int64[8], see :class:`~.table_counters.Counter`
    priorities.bin  prioritized and prioritized slices tables: raw priorities (the
                    sampler's own file)
    data/           the segments (:class:`~millpond.service.storage.SegmentStorage`):
                    columns/, slots.bin (4 bytes per slot), segments.bin (a record per segment),
                    config.json (a copy of meta.json's config, rewritten when it changes)

A table is there once ``meta.json`` is; everything in memory that the files do not hold
(the sampler's index, open episodes, writer marks) is rebuilt from them by :meth:`recover`.

``meta.json`` carries the SHA-256 of its config, and opening checks that the other files
are the ones that config describes (the column files and their index, the sampler's file,
``counters.bin``): an edited or misplaced ``meta.json`` is refused rather than read as a
different table, since the same bytes under another dtype or sampler would be served as
wrong rows. A lost ``meta.json`` is rebuilt from ``data/config.json`` (the counters live in
``counters.bin``, and generations continue past the newest stored, so nothing collides). A
directory with neither is the remains of a create that failed (``meta.json`` is written
last) unless it holds stored segments (:func:`holds_data`); then it is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from millpond.config import TableConfig
from millpond.errors import (
    InvalidConfigError,
    MillpondError,
    ResourceExhaustedError,
    StorageCorruptedError,
    TableExistsError,
)
from millpond.frame_stacks import PREFIX_DIR
from millpond.service.atomic_json import atomic_write_json
from millpond.service.samplers import PRIORITIES_FILE, Sampler
from millpond.service.segment_batch import SegmentBatch
from millpond.service.storage import (
    CHAINS_FILE,
    CHECKSUMS_FILE,
    RECORD_WIDTH,
    SEGMENTS_FILE,
    SLOTS_FILE,
    SegmentStorage,
    column_filename,
)
from millpond.service.table_counters import COUNTERS_FILE, N_COUNTERS, Counter
from millpond.spec import OBSERVATION, TERMINATED, TRUNCATED, TableSpec

#: The on-disk format. 2: slot metadata is an int32 record pointer per slot plus one record
#: per segment (``slots.bin``, ``segments.bin``); 1 had eight int64 fields per slot.
FORMAT = 2
META_FILE = "meta.json"
WRITERS_FILE = "writers.json"
COLUMN_INDEX = "data/columns/index.json"
CONFIG_COPY = "data/config.json"
#: The key of ``meta.json`` that holds the SHA-256 of its config (see :func:`config_digest`).
CONFIG_DIGEST = "config_sha256"


def holds_table(path: Path) -> bool:
    return (path / META_FILE).exists()


def _restore_or_move(path: Path, file: str) -> str:
    rebuild = ""
    if file == META_FILE and (path / CONFIG_COPY).exists():
        rebuild = f"delete {file} to rebuild it from {CONFIG_COPY} (the config last stored), "
    return (
        f"{rebuild}restore {file} from a backup of this table, or move the directory {path} "
        "out of the shard's tables/ (the shard serves its other tables meanwhile)"
    )


def restorable(path: Path) -> bool:
    """Whether ``path`` lost its ``meta.json`` but holds data and the config's copy."""
    return not holds_table(path) and (path / CONFIG_COPY).exists() and holds_data(path)


def holds_data(path: Path) -> bool:
    """Whether the table directory ``path`` holds a stored segment, or ever numbered one.

    Reads only the allocated extents of the (sparse) ``segments.bin``, so a huge empty table
    costs nothing. A directory without ``meta.json`` for which this is false is what a create
    that failed before writing it leaves, and can be removed.
    """
    counters = path / COUNTERS_FILE
    if counters.exists() and counters.stat().st_size >= (Counter.NEXT_GENERATION + 1) * 8:
        c = np.fromfile(counters, dtype=np.int64, count=Counter.NEXT_GENERATION + 1)
        if c[Counter.NEXT_GENERATION] > 1:
            return True
    records = path / "data" / SEGMENTS_FILE
    if not records.exists():
        return False
    width = RECORD_WIDTH * 8
    chunk = width * (1 << 16)
    with open(records, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
                end = os.lseek(fd, start, os.SEEK_HOLE)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only holes left
                    return False
                start, end = pos, size  # no SEEK_DATA on this filesystem: read it all
            start -= start % width
            end = min(size, -(-end // width) * width)  # whole records
            f.seek(start)
            for offset in range(start, end, chunk):
                buf = f.read(min(chunk, end - offset))
                n = len(buf) // width
                generations = np.frombuffer(buf, dtype=np.int64, count=n * RECORD_WIDTH)
                if generations[::RECORD_WIDTH].any():
                    return True
            pos = end
    return False


def refuse_without_meta(path: Path) -> StorageCorruptedError:
    """The refusal of a table directory that holds data but no ``meta.json``."""
    return StorageCorruptedError(
        f"table {path.name!r} is not served: {path} holds stored segments but no {META_FILE} "
        f"(the table's config) nor its copy {CONFIG_COPY}. "
        f"{_restore_or_move(path, META_FILE).capitalize()}; until then "
        "every call naming the table is refused, creating it included, and nothing there is "
        "touched"
    )


def new_table_dir(path: str | os.PathLike) -> Path:
    """``path``, created if missing, for a new table.

    :class:`TableExistsError` if it holds a table, :class:`StorageCorruptedError` if it holds
    a table's data without its ``meta.json``; the remains of a failed create are removed.
    """
    path = Path(path)
    if holds_table(path):
        raise TableExistsError(f"{path} already holds a table")
    if path.exists():
        if holds_data(path):
            raise refuse_without_meta(path)
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def config_digest(config: dict) -> str:
    """The SHA-256 of a config's JSON form, keys sorted: what ``meta.json`` vouches with."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_config(path: Path, name: str | None = None) -> TableConfig:
    """The config of the table stored in ``path``.

    :class:`StorageCorruptedError`, naming ``meta.json`` and the fix, if it is missing,
    unreadable, edited (its config does not match its digest) or, given the ``name`` the
    table must have (a shard's directory names its table), another table's.
    """
    meta_file = path / META_FILE
    fix = _restore_or_move(path, META_FILE)
    if not meta_file.exists():
        raise StorageCorruptedError(f"{path} holds no table (missing {META_FILE}): {fix}")
    return _parse_meta(meta_file, fix, name)


def read_config_copy(path: Path, name: str | None = None) -> TableConfig:
    """The config in ``data/config.json``, to rebuild a lost ``meta.json`` from; checked as
    :func:`read_config` checks ``meta.json``."""
    fix = _restore_or_move(path, META_FILE)
    return _parse_meta(path / CONFIG_COPY, fix, name)


def _parse_meta(meta_file: Path, fix: str, name: str | None) -> TableConfig:
    try:
        meta = json.loads(meta_file.read_bytes())
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise ValueError("expected an object with a 'config' object")
        fmt = meta.get("format")
        if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt < FORMAT:
            raise StorageCorruptedError(
                f"{meta_file}: the table was written in on-disk format {fmt}, and this "
                f"millpond reads format {FORMAT} only (the format changed: since format 2 the "
                "slot metadata is a 4-byte pointer per slot plus a record per segment, not 64 "
                "bytes per slot). Export it with the millpond that wrote it "
                "(millpond.service.export) and insert it into a new table, or create the "
                "table anew."
            )
        if fmt != FORMAT:
            raise ValueError(f"unknown format {fmt!r}")
        digest = meta.get(CONFIG_DIGEST)
        # meta.json written before the digest existed has none; the next write adds it.
        if digest is not None and digest != config_digest(meta["config"]):
            raise StorageCorruptedError(
                f"{meta_file} was edited: its config does not match the {CONFIG_DIGEST} it "
                f"was written with. A table's config cannot change in place (the files are "
                f"laid out for it): {fix}; to change the config, export the table and import "
                "it into a new one"
            )
        config = TableConfig.from_json(meta["config"])
    except StorageCorruptedError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, MillpondError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise StorageCorruptedError(f"{meta_file} is unreadable ({reason}): {fix}") from None
    if name is not None and config.name != name:
        raise StorageCorruptedError(
            f"{meta_file} describes table {config.name!r}, not the table {name!r} of its "
            f"directory (copied from another table?): {fix}"
        )
    return config


def check_files(path: Path, config: TableConfig) -> None:
    """Refuse (:class:`StorageCorruptedError`, naming the file) table files that are not the
    ones ``config`` describes, before anything opens (and so creates or rewrites) them."""
    fix = _restore_or_move(path, "it")
    for d in (path, path / "data"):
        if not d.is_dir():
            raise StorageCorruptedError(f"{d} is missing (the table's segments): {fix}")
        if not os.access(d, os.W_OK | os.X_OK):
            raise StorageCorruptedError(
                f"{d} is not writable (permission denied or a read-only filesystem): make it "
                "writable by the user running millpond, or move the table out of the shard"
            )
    counters = path / COUNTERS_FILE
    if not counters.exists():
        raise StorageCorruptedError(
            f"{counters} is missing (the table's generation and rate-limiter counters): {fix}"
        )
    if counters.stat().st_size != N_COUNTERS * 8:
        raise StorageCorruptedError(
            f"{counters} has {counters.stat().st_size} bytes, expected {N_COUNTERS * 8}: {fix}"
        )
    priorities = path / PRIORITIES_FILE
    if config.has_priorities:
        expected = (config.capacity + 1) * 8
        if not priorities.exists():
            raise StorageCorruptedError(
                f"{priorities} is missing, and {path / META_FILE} describes a "
                f"{config.sampler} table: {fix}"
            )
        if priorities.stat().st_size != expected:
            raise StorageCorruptedError(
                f"{priorities} has {priorities.stat().st_size} bytes, expected {expected} "
                f"for capacity {config.capacity}: {fix}"
            )
    elif priorities.exists():
        raise StorageCorruptedError(
            f"{path} holds {PRIORITIES_FILE}, which only a table with priorities has, and "
            f"{path / META_FILE} describes a {config.sampler} table: "
            f"{_restore_or_move(path, META_FILE)}"
        )
    _check_columns(path, config, fix)


def _check_columns(path: Path, config: TableConfig, fix: str) -> None:
    index_file = path / COLUMN_INDEX
    columns = index_file.parent
    if config.spec is None:
        stray = sorted(p.name for p in columns.glob("*.bin")) if columns.exists() else []
        if stray:
            raise StorageCorruptedError(
                f"{path / META_FILE} declares no keys, but {columns} holds column files "
                f"({', '.join(stray[:3])}): {_restore_or_move(path, META_FILE)}"
            )
        return
    try:
        index = json.loads(index_file.read_bytes())
        stored = {tuple(c["key"]): c["file"] for c in index["columns"]}
    except FileNotFoundError:
        raise StorageCorruptedError(f"{index_file} is missing: {fix}") from None
    except (ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise StorageCorruptedError(f"{index_file} is unreadable ({reason}): {fix}") from None
    expected = {key: column_filename(key) for key in config.spec.fields}
    if stored != expected:
        raise StorageCorruptedError(
            f"{index_file} lists the columns {sorted(stored)}, and {path / META_FILE} the keys "
            f"{sorted(expected)}: {fix}"
        )
    for name in expected.values():
        if not (columns / name).exists():
            raise StorageCorruptedError(f"column file {columns / name} is missing: {fix}")


def os_error(e: OSError, what: str) -> MillpondError:
    """An OSError met while creating or opening a table, as the millpond error it means."""
    where = f"{e.filename}: " if e.filename else ""
    detail = f"{where}{e.strerror or e}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ResourceExhaustedError(
            f"{what}: disk full ({detail}); free space on the shard's disk (a table reserves "
            "its space as it fills, so even a small one needs some at creation)"
        )
    if e.errno == errno.ENOMEM:
        return ResourceExhaustedError(
            f"{what}: out of memory mapping the table's files ({detail}); choose a smaller "
            "capacity, or raise the process's address-space and map limits"
        )
    if e.errno == errno.ENAMETOOLONG:
        return InvalidConfigError(
            f"{what}: the path is too long for the filesystem ({detail}); choose a shorter "
            "table name or shard directory"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageCorruptedError(
            f"{what}: {e.filename or 'the shard directory'} is not writable or not readable "
            f"({e.strerror}: permission denied or a read-only filesystem); make the shard "
            "directory readable and writable by the user running millpond"
        )
    return StorageCorruptedError(f"{what}: {detail}")


#: The parts of a table directory that :func:`disk_usage` tells apart.
DISK_PARTS = (
    "observations",  # observation column files (step and tail slots), frame-stack prefixes
    "step fields",  # the other column files (actions, rewards, flags, ...)
    "slot pointers",  # data/slots.bin
    "segment records",  # data/segments.bin, data/checksums.bin, data/chains.bin (per record)
    "sampler",  # the sampler's own files (priorities.bin)
    "table files",  # meta.json, writers.json, counters.bin, columns/index.json, ...
)


def disk_usage(path: str | os.PathLike, spec: TableSpec | None) -> dict[str, int]:
    """Bytes on disk (``st_blocks * 512``: sparse regions never written count nothing) of
    every file under the table directory ``path``, by part (see :data:`DISK_PARTS`)."""
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
        elif p in (data / SEGMENTS_FILE, data / CHECKSUMS_FILE, data / CHAINS_FILE):
            part = "segment records"
        elif p.parent == data / "columns" and p.suffix == ".bin":
            part = "observations" if p.name in observation_files else "step fields"
        elif p.parent == data / PREFIX_DIR:  # the older frames of frame-stacked observations
            part = "observations"
        elif p == path / PRIORITIES_FILE:
            part = "sampler"
        else:
            part = "table files"
        usage[part] += p.stat().st_blocks * 512
    return usage


class Recovered(NamedTuple):
    """What :meth:`TableFiles.recover` rebuilds besides the storage and the sampler."""

    writer_sequences: dict[int, int]  # writer hash -> highest stored sequence
    # Episode id -> next step, for episodes not ended; None while the data is unverified
    # (the episode ends are read from it: see open_episodes).
    open_episodes: dict[int, int] | None


class TableFiles:
    """The table's own files in ``path``: ``meta.json``, ``writers.json``, ``counters.bin``.

    ``fresh`` creates them (the counters zeroed); otherwise they are opened as they are.
    """

    def __init__(self, path: Path, *, fresh: bool) -> None:
        self.path = path
        self._copy_digest: str | None = None  # of the config in CONFIG_COPY, once written
        self._counters = np.memmap(
            path / COUNTERS_FILE, dtype=np.int64, mode="w+" if fresh else "r+", shape=(N_COUNTERS,)
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
        config_json = json.loads(json.dumps(config.to_json()))  # as a reader will see it
        digest = config_digest(config_json)
        if digest != self._copy_digest:
            # Apart from meta.json, so that losing it loses no config; only when it changes.
            copy = {"format": FORMAT, "config": config_json, CONFIG_DIGEST: digest}
            atomic_write_json(self.path / CONFIG_COPY, copy)
            self._copy_digest = digest
        atomic_write_json(
            self.path / META_FILE,
            {
                "format": FORMAT,
                "config": config_json,
                CONFIG_DIGEST: digest,
                "counters": {
                    "inserts": int(c[Counter.INSERTS]),
                    "samples": int(c[Counter.SAMPLES]),
                    "next_generation": int(c[Counter.NEXT_GENERATION]),
                    "queue_delivered_through": int(c[Counter.QUEUE_CURSOR]),
                },
            },
        )

    def recover(
        self, storage: SegmentStorage, sampler: Sampler, check_data: bool = True
    ) -> Recovered:
        """Rebuild the in-memory state of a reopened table from its files.

        The storage drops torn segments and the sampler takes back the others; writer marks
        come from ``writers.json`` and the stored segments (whichever is newer), and the
        next generation moves past the newest stored one. ``check_data``: see
        :meth:`SegmentStorage.recover`.
        """
        writers = self._read_writers()  # first: a garbled file refuses before any repair
        segments = storage.recover(check_data)
        sampler.recover(segments)
        if len(segments) and segments.writers is not None and segments.sequences is not None:
            for w, q in zip(segments.writers.tolist(), segments.sequences.tolist()):
                if w and q > writers.get(w, 0):
                    writers[w] = q
        open_episodes = open_episodes_of(storage, segments) if not storage.unverified else None
        newest = int(segments.generations.max()) if len(segments) else 0
        self._counters[Counter.NEXT_GENERATION] = max(self.next_generation, newest + 1)
        return Recovered(writers, open_episodes)

    def _read_writers(self) -> dict[int, int]:
        writers_file = self.path / WRITERS_FILE
        if not writers_file.exists():
            return {}
        try:
            saved = json.loads(writers_file.read_bytes())
            return {int(k): int(v) for k, v in saved.items()}
        except (ValueError, AttributeError, TypeError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise StorageCorruptedError(
                f"{writers_file} is unreadable ({reason}): restore it from a backup of this "
                "table, or delete it (each writer's mark is then rebuilt from its segments "
                "still stored; a writer re-sending segments already evicted could store them "
                "twice)"
            ) from None


def open_episodes_of(storage: SegmentStorage, segments: SegmentBatch) -> dict[int, int]:
    """Episode id -> next step, for episodes whose newest stored segment did not end (read
    from the segments' data: verified segments only)."""
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
