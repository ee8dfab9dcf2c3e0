"""Disk blocks reserved before memory-mapped files are written, so that a full disk is an error.

The storage files are sparse memory maps: a page never written has no block on disk, and
storing into it through the map makes the kernel find one. On a full filesystem it cannot,
and the process gets SIGBUS, which kills it (a shard that dies, not an insert refused).
Reserving the blocks with ``posix_fallocate`` first turns that into ``ENOSPC`` from a system
call, answered as :class:`ResourceExhaustedError` while nothing has changed yet.

Files are reserved lazily, in chunks ahead of what is used (a new table takes no space for
its whole capacity): :class:`Reservation` keeps a watermark below which every file of a
group (the files indexed by slot, or those indexed by segment record) has its blocks.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from millpond.errors import ResourceExhaustedError

#: Chunks are a 64th of a file group's capacity, within these bounds (all files together):
#: small enough that a half-filled table keeps its unused part sparse (within 1/64 of its
#: capacity), large enough that a filling ring costs at most 64 reservations per file.
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 64 * 1024 * 1024

_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(table_dir: Path, needed: int, what: str, error: OSError) -> ResourceExhaustedError:
    """The error of a reservation or file creation refused for lack of space."""
    return ResourceExhaustedError(
        f"disk full: cannot reserve space for {what} in table dir {table_dir}, "
        f"{needed} bytes needed ({error.strerror}); free space on its filesystem or move the "
        "shard to a larger one. Nothing was stored; the data stored before stays readable."
    )


def create_sparse(path: Path, size: int, table_dir: Path) -> None:
    """Create ``path`` with ``size`` bytes and no blocks (a hole); a full disk raises
    :class:`ResourceExhaustedError` instead of leaving a file of the wrong size."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in _FULL:
            path.unlink(missing_ok=True)
            raise disk_full(table_dir, size, f"creating {path.name}", e) from e
        raise


def reserve(fd: int, offset: int, length: int, table_dir: Path, what: str) -> None:
    """Give bytes ``[offset, offset + length)`` of the open file ``fd`` their blocks."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in _FULL:
            raise disk_full(table_dir, length, what, e) from e
        raise


class Reservation:
    """Blocks reserved for units ``[0, reserved)`` (slots, records) of a group of files.

    Args:
        table_dir: the table's directory, for error messages.
        limit: number of units the files hold.
        what: what a unit is, for error messages (``"slots"``, ``"segment records"``).

    Files join with :meth:`add`, each with its bytes per unit; :meth:`resume` then moves
    the watermark past what they hold already.
    """

    def __init__(self, table_dir: Path, limit: int, what: str, typical: int | None = None) -> None:
        self.table_dir = table_dir
        self.limit = limit
        #: What the chunks are sized for (a 64th of it each): ``limit`` unless most uses
        #: stay well below it.
        self.typical = limit if typical is None else typical
        self.what = what
        self.reserved = 0
        self._files: list[tuple[int, int, str]] = []  # fd, bytes per unit, file name

    def add(self, fd: int, unit_bytes: int, name: str) -> None:
        self._files.append((fd, unit_bytes, name))
        self.reserved = 0  # the new file has nothing reserved yet

    def resume(self) -> None:
        """Start the watermark where the first hole of any file is (an opened table's
        files have blocks from unit 0 on, as far as its ring was written), so that the
        first insert does not reserve that part again."""
        ends = [_first_hole(fd) // unit for fd, unit, _ in self._files if unit]
        self.reserved = min(min(ends, default=0), self.limit)

    @property
    def unit_bytes(self) -> int:
        return sum(unit for _, unit, _ in self._files)

    def ensure(self, end: int) -> None:
        """Reserve through unit ``end`` (exclusive), a chunk ahead when there is room.

        Raises :class:`ResourceExhaustedError` when the disk cannot hold even ``end``; the
        watermark then stays where it was (blocks reserved meanwhile are kept for later).
        """
        end = min(end, self.limit)
        if end <= self.reserved:
            return
        unit = max(1, self.unit_bytes)
        chunk = min(max(self.typical // 64, MIN_CHUNK_BYTES // unit), MAX_CHUNK_BYTES // unit)
        target = min(self.limit, max(end, self.reserved + max(1, chunk)))
        try:
            self._reserve(target)
        except ResourceExhaustedError:
            if target == end:
                raise
            self._reserve(end)  # the chunk does not fit; what this write needs may

    def _reserve(self, end: int) -> None:
        start = self.reserved
        for fd, unit, name in self._files:
            if not unit:  # a column of empty rows (shape [..., 0]) has no bytes to hold
                continue
            try:
                os.posix_fallocate(fd, start * unit, (end - start) * unit)
            except OSError as e:
                if e.errno not in _FULL:
                    raise
                what = f"{self.what} {start}-{end - 1} (in {name} and the other files)"
                raise disk_full(self.table_dir, (end - start) * self.unit_bytes, what, e) from e
        self.reserved = end


def data_end(fd: int) -> int:
    """The offset past the last region of ``fd`` that has blocks (the rest is holes).

    On tmpfs even reading a hole through a memory map takes a page, so that a read beyond
    this (a SIGBUS on a full disk) must be avoided. Where the filesystem cannot tell
    (``SEEK_DATA`` unsupported), the file's size.
    """
    size = os.fstat(fd).st_size
    end = pos = 0
    while pos < size:
        try:
            pos = os.lseek(fd, os.lseek(fd, pos, os.SEEK_DATA), os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data past pos
                break
            return size
        end = pos
    return end


def _first_hole(fd: int) -> int:
    """The offset of the first hole of ``fd`` (0 where the filesystem cannot tell)."""
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError:
        return 0
