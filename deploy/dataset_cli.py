"""``millpond export`` and ``millpond import``: a table's rows to and from a TED export or a
Minari dataset.

``millpond export DIR --table NAME --format ted|hdf5 OUT`` writes the stored steps of table
NAME of the shard directory DIR (what ``millpond serve --dir DIR`` serves) as TED rows: a
memory-mapped TensorDict directory (``TensorDict.load_memmap(OUT)``) or an HDF5 file
(``--compression gzip|lzf``). ``millpond import IN --format ted|hdf5 DIR --table NAME``
stores such an export into a table, created if missing, so that exporting it again gives
the same rows bit for bit (:mod:`millpond.service.export`). ``--format minari`` writes the
table's episodes as a Minari dataset (OUT is its id, under ``--minari-root``) and reads one
back (:mod:`millpond.service.minari_format`, which states the episode rules).

In place of DIR, export takes the addresses of a running service
(``host:port[,host:port...]``): a consistent snapshot of the table on every shard, read while
inserts go on (``ReplayClient.read_table``), is stored into a temporary table next to OUT
(:func:`~millpond.service.export.spooled_table`), which the same exporters then write out.

From a directory, both open the table's files directly, so they refuse a table that another
process holds open for writing (a running ``millpond serve`` on DIR): two writers of the
same files would corrupt them. The check asks the kernel for a read lease on the table's
files (Linux), which it grants only if no process has them open for writing.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.errors import (
    InvalidConfigError,
    InvalidDataError,
    MillpondError,
    TableExistsError,
    TableNotFoundError,
)
from millpond.learner.client import ReplayClient
from millpond.service.export import (
    EXPORT_ORDERS,
    export_table,
    import_ted,
    load_hdf5,
    pack_export,
    spooled_table,
)
from millpond.service.minari_format import export_minari, load_minari, minari_root, minari_ted
from millpond.service.shard import Shard
from millpond.service.table import Table
from millpond.service.table_files import holds_table

FORMATS = ("ted", "hdf5", "minari")
T = TypeVar("T")
#: The table files a server holds open for writing as long as it serves the table.
_HELD_FILES = ("counters.bin", "data/slots.bin", "data/segments.bin")
#: ``host:port[,host:port...]``: the shards of a running service, not a directory.
_ADDRESSES = re.compile(r"[^\s,/]+:\d+(,[^\s,/]+:\d+)*")


# -- parsers --------------------------------------------------------------------------------
def build_export_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond export")
    p.description = (
        "Write a table's stored steps as TED rows: a memory-mapped TensorDict directory "
        "(--format ted) or an HDF5 file (--format hdf5); or its episodes as a Minari dataset "
        "(--format minari, OUT a dataset id). DIR is a shard directory, as "
        "`millpond serve --dir DIR` writes it (with --shards N, one of DIR/shard-i), whose "
        "table must not be open in a running server; or the addresses of a running service, "
        "host:port[,host:port...], whose table is exported as a consistent snapshot of every "
        "shard, read while inserts go on (copied into a temporary table next to OUT first; "
        "needs the admin role where tokens are on)."
    )
    p.add_argument(
        "dir",
        metavar="DIR_OR_ADDRESS",
        help="shard directory holding the table, or a running service's host:port[,host:port...]",
    )
    p.add_argument(
        "out",
        metavar="OUT",
        help="where to write the export (must not exist); for minari, a dataset id such as "
        "millpond/cartpole-v0",
    )
    p.add_argument("--table", required=True, metavar="NAME", help="table to export")
    p.add_argument("--format", required=True, metavar="{ted,hdf5,minari}", help="export format")
    p.add_argument(
        "--compression",
        default="none",
        metavar="{gzip,lzf,none}",
        help="HDF5 compression filter (default none)",
    )
    p.add_argument(
        "--compression-level", type=int, metavar="N", help="gzip level, 0 to 9 (default 4)"
    )
    p.add_argument(
        "--order",
        default="publication",
        metavar="{" + ",".join(EXPORT_ORDERS) + "}",
        help="row order: oldest segment first (default), or each episode's rows together",
    )
    _add_minari_root(p)
    p.add_argument(
        "--env",
        metavar="ID",
        help="minari: the gymnasium env id whose observation and action spaces the dataset "
        "records (default: unbounded Boxes of the stored dtypes and shapes)",
    )
    _add_busy_flag(p)
    p.add_argument(
        "--token",
        default=os.environ.get("MILLPOND_TOKEN"),
        help="a running service's admin token, where it has tokens (default: $MILLPOND_TOKEN)",
    )
    p.add_argument("--tls-ca", metavar="PEM", help="a running service's TLS root certificate")
    return p


def build_import_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond import")
    p.description = (
        "Store an export (what millpond export writes) into a table of the shard directory "
        "DIR, creating the table (and DIR) if missing. "
        "Exporting the table afterwards gives the same rows bit for bit. The shard must "
        "not be open in a running server."
    )
    p.add_argument(
        "input",
        metavar="IN",
        help="the export: a TED directory, an HDF5 file, or a Minari dataset id",
    )
    p.add_argument("dir", metavar="DIR", help="shard directory (created if missing)")
    p.add_argument("--format", required=True, metavar="{ted,hdf5,minari}", help="format of IN")
    p.add_argument("--table", required=True, metavar="NAME", help="table to store into")
    p.add_argument(
        "--source",
        metavar="NAME",
        help="number the episodes anew in this extend source's id range "
        "(default: keep the exported episode ids; for minari, the source minari:IN)",
    )
    p.add_argument(
        "--sampler",
        metavar="{uniform,prioritized,queue,slices,prioritized_slices}",
        help="a new table's sampler (default uniform)",
    )
    p.add_argument(
        "--capacity",
        type=int,
        metavar="SLOTS",
        help="a new table's capacity in slots (default: 1.5 x the slots the rows take; a "
        "segment of L steps takes L + 1)",
    )
    p.add_argument("--slice-len", type=int, metavar="N", help="a new slices table's slice_len")
    _add_minari_root(p)
    _add_busy_flag(p)
    return p


def _add_minari_root(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--minari-root",
        metavar="PATH",
        help="minari: where datasets live (default $MINARI_DATASETS_PATH, else ~/.minari/datasets)",
    )


def _add_busy_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-busy-check",
        action="store_true",
        help="do not check that no other process has the table open (where that check "
        "cannot run: not Linux, or files owned by another user); the server must be stopped",
    )


# -- commands -------------------------------------------------------------------------------
def run_export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise InvalidConfigError(f"unknown format {args.format!r}; expected ted, hdf5 or minari")
    if args.format == "minari":
        return _export_minari(args)
    for flag, value in (("--minari-root", args.minari_root), ("--env", args.env)):
        if value is not None:
            raise InvalidConfigError(f"{flag} is for --format minari")
    compression = None if args.compression == "none" else args.compression
    if args.format == "ted" and (compression is not None or args.compression_level is not None):
        raise InvalidConfigError("--compression is for --format hdf5")
    out = Path(args.out)
    if out.exists():
        raise InvalidConfigError(f"{out} exists: remove it or choose another path")
    try:
        with _table_to_export(args, out.absolute().parent) as table:
            summary = export_table(
                table,
                out,
                format=args.format,
                order=args.order,
                compression=compression,
                compression_opts=args.compression_level,
            )
    except ImportError as e:  # HDF5 without h5py: the message says what to install
        raise InvalidConfigError(str(e)) from None
    how = args.format if compression is None else f"{args.format}, {compression}"
    print(
        f"millpond: exported {summary.rows} rows of table {args.table!r} to {out} "
        f"({how}, {_nbytes(out)} bytes)",
        flush=True,
    )
    if summary.flat_breaks:
        print(
            f"millpond: note: {summary.flat_breaks} row(s) end a trajectory without done, so "
            "TorchRL's FlatStorageCheckpointer would not restore this export exactly (its "
            "default checkpointer does; see docs/service.md)",
            file=sys.stderr,
        )
    return 0


def run_import(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise InvalidConfigError(f"unknown format {args.format!r}; expected ted, hdf5 or minari")
    if args.format == "minari":
        packed = pack_export(
            minari_ted(_minari(load_minari, args.input, root=args.minari_root)),
            source=args.source or f"minari:{args.input}",
        )
    else:
        if args.minari_root is not None:
            raise InvalidConfigError("--minari-root is for --format minari")
        packed = pack_export(_load(Path(args.input), args.format), source=args.source)
    needed = packed.num_steps + len(packed)
    shard = _shard_dir(args.dir, create=False, allow_missing=True)
    table_dir = shard / "tables" / args.table
    if not args.skip_busy_check and (shard / "tables").is_dir():
        _check_not_open([d for d in (shard / "tables").iterdir() if holds_table(d)], shard)
    if holds_table(table_dir):
        table = Table.open(table_dir)
        _check_same_table(table.config, args)
    else:
        capacity = args.capacity if args.capacity is not None else max(2, needed + needed // 2)
        config = TableConfig(
            name=args.table,
            capacity=capacity,
            sampler=args.sampler or "uniform",
            slice_len=args.slice_len,
        )
        if needed > capacity:  # what import_ted refuses, before anything is created
            raise InvalidConfigError(
                f"the {packed.num_steps} rows need {needed} slots ({len(packed)} segments of L "
                f"steps take L + 1 each), more than table {args.table!r} holds (capacity "
                f"{capacity}): pass --capacity {needed} or more"
            )
        shard = _shard_dir(args.dir, create=True)
        table = Table.create(table_dir, config)
    try:
        rows = import_ted(table, packed, timeout=0)
        capacity = table.config.capacity
        slice_len = table.config.slice_len or 1
    finally:
        table.close()
    largest = capacity // slice_len
    print(
        f"millpond: imported {rows} rows into table {args.table!r} of {shard} "
        f"({len(packed)} segments, {needed} of {capacity} slots); it samples batches of at "
        f"most {largest}{f' slices of {slice_len} steps' if slice_len > 1 else ' steps'} "
        "(its capacity: give --capacity for larger ones)",
        flush=True,
    )
    return 0


def _export_minari(args: argparse.Namespace) -> int:
    if args.compression != "none" or args.compression_level is not None:
        raise InvalidConfigError("--compression is for --format hdf5")
    if args.order != "publication":
        raise InvalidConfigError("--order is for ted and hdf5: a Minari dataset holds episodes")
    with _table_to_export(args, minari_root(args.minari_root)) as table:
        s = _minari(export_minari, table, args.out, root=args.minari_root, env=args.env)
    print(
        f"millpond: exported {s.episodes} episodes ({s.steps} steps) of table {args.table!r} "
        f"to Minari dataset {args.out!r} at {s.path}",
        flush=True,
    )
    notes = []
    if s.dropped_partial:
        notes.append(
            f"{s.dropped_partial} episode(s) ({s.dropped_steps} steps) left out: not "
            "stored whole from step 0 (beginning evicted)"
        )
    if s.truncated_open:
        notes.append(f"{s.truncated_open} open episode(s) written as truncated at their last step")
    if s.left_out_keys:
        notes.append(f"step keys with no place in a Minari episode: {', '.join(s.left_out_keys)}")
    for note in notes:
        print(f"millpond: note: {note}", file=sys.stderr)
    return 0


def _minari(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(...)``, a missing minari said as what to install."""
    try:
        return fn(*args, **kwargs)
    except ImportError as e:
        raise InvalidConfigError(str(e)) from None


# -- helpers --------------------------------------------------------------------------------
@contextlib.contextmanager
def _table_to_export(args: argparse.Namespace, spool: Path) -> Iterator[Table]:
    """The table ``args`` name: opened from its shard directory once no other process holds
    its files open for writing (unless ``--skip-busy-check``), or, for a running service's
    addresses, its snapshot stored into a temporary table under ``spool``."""
    if _is_service(args.dir):
        with _live_table(args, spool) as table:
            yield table
        return
    if args.tls_ca is not None:
        raise InvalidConfigError("--tls-ca is for a running service's addresses")
    shard = _shard_dir(args.dir, create=False)
    table_dir = _table_dir(shard, args.table)
    if not args.skip_busy_check:
        _check_not_open([table_dir], shard)
    table = Table.open(table_dir)
    try:
        yield table
    finally:
        table.close()


def _is_service(arg: str) -> bool:
    """Whether ``arg`` names a running service's shards (an existing path never does)."""
    return not Path(arg).exists() and _ADDRESSES.fullmatch(arg) is not None


@contextlib.contextmanager
def _live_table(args: argparse.Namespace, spool: Path) -> Iterator[Table]:
    """A consistent snapshot of the table on the shards ``args.dir`` names, in a temporary
    table under ``spool`` (deleted afterwards)."""
    if args.skip_busy_check:
        raise InvalidConfigError("--skip-busy-check is for a shard directory")
    spool.mkdir(parents=True, exist_ok=True)
    client = ReplayClient(args.dir, token=args.token, tls=args.tls_ca, colocated=False)
    with client, client.read_table(args.table) as reader:
        slots = reader.steps + reader.segments
        with spooled_table(args.table, reader, slots, spool) as table:
            if reader.overwritten_segments:
                print(
                    f"millpond: note: {reader.overwritten_segments} segment(s) "
                    f"({reader.overwritten_steps} steps) of the snapshot were overwritten by "
                    "inserts before they were read: left out",
                    file=sys.stderr,
                )
            if reader.cut_segments:
                print(
                    f"millpond: note: {reader.cut_segments} segment(s) ({reader.cut_steps} "
                    "steps) left out after a gap so overwritten in their episode: each "
                    "episode's exported steps are one unbroken run",
                    file=sys.stderr,
                )
            yield table


def _shard_dir(path: str, *, create: bool, allow_missing: bool = False) -> Path:
    """The shard directory ``path`` (created if ``create`` and missing or empty); otherwise
    an error that says what to pass instead."""
    p = Path(path)
    if (p / "tables").is_dir():
        return p
    shards = sorted(q.name for q in p.glob("shard-*") if (q / "tables").is_dir())
    if shards:
        raise InvalidConfigError(
            f"{p} holds {len(shards)} shards ({', '.join(shards)}), as `millpond serve "
            f"--shards N` writes them: pass one shard directory, e.g. {p / shards[0]} (each "
            "shard stores its own part of a table)"
        )
    if holds_table(p):
        raise InvalidConfigError(
            f"{p} is a table directory: pass its shard directory, {p.parent.parent}, "
            f"with --table {p.name}"
        )
    empty = not p.exists() or (p.is_dir() and not any(p.iterdir()))
    if create and empty:
        Shard(p).close()  # lays out an empty shard: shard.json and tables/
        return p
    if allow_missing and empty:
        return p
    if not p.exists():
        raise InvalidConfigError(
            f"{p} does not exist: pass a shard directory (what `millpond serve --dir` serves)"
        )
    raise InvalidConfigError(
        f"{p} is not a shard directory (it has no tables/): pass what `millpond serve --dir` serves"
    )


def _table_dir(shard: Path, name: str) -> Path:
    table_dir = shard / "tables" / name
    if not holds_table(table_dir):
        known = sorted(d.name for d in (shard / "tables").iterdir() if holds_table(d))
        raise TableNotFoundError(
            f"no table {name!r} in {shard} (tables: {', '.join(known) or 'none'})"
        )
    return table_dir


def _check_not_open(table_dirs: list[Path], shard: Path) -> None:
    """Refuse tables another process holds open for writing (a server): a read lease is
    granted only on a file that no process has open for writing (Linux ``F_SETLEASE``)."""
    if not hasattr(fcntl, "F_SETLEASE"):
        raise MillpondError(
            "cannot check that no server holds the table (file leases are Linux-only): stop "
            f"any `millpond serve` on {shard} and pass --skip-busy-check"
        )
    for table_dir in table_dirs:
        for rel in _HELD_FILES:
            path = table_dir / rel
            if not path.exists():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                with _sigio_ignored():
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EBUSY):
                    raise MillpondError(
                        f"table {table_dir.name!r} of {shard} is open in another process (a "
                        f"running `millpond serve --dir {shard}`?): stop it first; two "
                        "processes writing one table's files would corrupt them"
                    ) from None
                raise MillpondError(
                    f"cannot check whether another process has {path} open ({e.strerror}): "
                    f"stop any `millpond serve` on {shard} and pass --skip-busy-check"
                ) from None
            finally:
                os.close(fd)


@contextlib.contextmanager
def _sigio_ignored() -> Iterator[None]:
    """A lease holder gets SIGIO (default action: exit) when another process opens the file
    for writing; the lease lasts microseconds here, and must not kill the command."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGIO, previous)


def _check_same_table(config: TableConfig, args: argparse.Namespace) -> None:
    asked = {"sampler": args.sampler, "capacity": args.capacity, "slice_len": args.slice_len}
    differs = {k: v for k, v in asked.items() if v is not None and getattr(config, k) != v}
    if differs:
        have = ", ".join(f"{k} {getattr(config, k)}" for k in differs)
        raise TableExistsError(
            f"table {config.name!r} exists with {have}; leave out "
            + ", ".join(f"--{k.replace('_', '-')}" for k in differs)
            + " to import into it as it is"
        )


def _load(path: Path, fmt: str) -> TensorDict:
    if not path.exists():
        raise InvalidConfigError(f"{path} does not exist")
    if fmt == "ted":
        if not (path.is_dir() and (path / "meta.json").exists()):
            raise InvalidDataError(
                f"{path} is not a memory-mapped TensorDict directory (millpond export "
                "--format ted writes one)"
            )
        try:
            return TensorDict.load_memmap(path)
        except Exception as e:  # tensordict raises whatever its loaders meet
            raise InvalidDataError(f"cannot load {path} as a TensorDict: {e}") from None
    try:
        return load_hdf5(path)
    except ImportError as e:
        raise InvalidConfigError(str(e)) from None
    except (OSError, KeyError, MillpondError) as e:
        raise InvalidDataError(
            f"cannot load {path} as a millpond HDF5 export (millpond export --format hdf5 "
            f"writes one): {e}"
        ) from None


def _nbytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
