"""JSON files that a crash leaves old or new, never half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_json(path: Path, obj: object, fsync: bool = True) -> None:
    """Write JSON so that readers see the old or the new file, never a mix (tmp, fsync, rename).

    ``fsync=False`` leaves out the disk flushes: the rename still makes it all or nothing for
    a killed process (the kernel's page cache keeps what was written), not for a machine
    crash.

    A failed write (a full disk: ``OSError`` ``ENOSPC``, which the service answers as
    RESOURCE_EXHAUSTED) removes its temporary file, so that it holds no space, and leaves
    the old file as it was.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_file(tmp, json.dumps(obj, indent=1).encode(), fsync)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not fsync:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_file(path: Path, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path``; ``fsync``: and wait until it is on disk (not the directory
    entry)."""
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
