"""A job's run directory, claimed by one ``millpond launch`` at a time and never written over
unasked.

:func:`claim_run_dir` takes a directory for a job before anything of the job starts: a new
one (a default name ``NAME-YYYYmmdd-HHMMSS-XXXX``, its suffix random, created with
``exist_ok=False`` so that two jobs started in the same second cannot share it), an empty
one, the run directory a resumed job continues, or (``overwrite``) an earlier run's, whose
files are removed first. It holds an exclusive lock on :data:`LOCK_FILE` in the directory
while the job runs: a second launch into the same directory is refused, whatever its flags.
The lock is the operating system's (``flock``), so a job that dies releases it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import time
from pathlib import Path

from millpond.errors import InvalidConfigError

__all__ = ["LOCK_FILE", "RunDir", "claim_run_dir", "default_run_dir"]

#: The file a running job holds locked in its run directory (kept there afterwards: removing
#: a lock file others may be opening would let two jobs lock two different files).
LOCK_FILE = ".millpond-launch.lock"

_SUFFIX_BYTES = 2  # 4 hex digits: 65,536 names per job name and second


class RunDir:
    """A claimed run directory: :attr:`path`, locked until :meth:`release`."""

    def __init__(self, path: Path, lock_fd: int, created: bool) -> None:
        self.path = path
        self.created = created  # the claim made the directory
        self._fd: int | None = lock_fd

    def release(self) -> None:
        """Let another job claim the directory (when this job has ended)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops its flock

    def abandon(self) -> None:
        """Release the claim of a job that wrote nothing, and remove the directory if the
        claim made it: a job refused before it started leaves no directory behind."""
        self.release()
        if self.created and _entries(self.path) == []:
            shutil.rmtree(self.path, ignore_errors=True)


def default_run_dir(parent: str | Path, name: str) -> Path:
    """A fresh path ``parent/NAME-YYYYmmdd-HHMMSS-XXXX`` (not created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(parent) / f"{name}-{stamp}-{secrets.token_hex(_SUFFIX_BYTES)}"


def claim_run_dir(
    path: str | Path | None,
    *,
    parent: str | Path = "runs",
    name: str = "run",
    resume: bool = False,
    overwrite: bool = False,
) -> RunDir:
    """Claim the run directory of a job (see the module docstring).

    Args:
        path: the directory named (``--run-dir`` or ``--resume``); ``None``: a new one
            under ``parent`` named after ``name``.
        resume: the job continues the run in ``path``: it must be there.
        overwrite: an earlier run in ``path`` is replaced: its files are removed.

    Raises :class:`InvalidConfigError` naming the directory when it holds an earlier run
    (without ``resume`` or ``overwrite``), files that are not a run's, or a job that runs now.
    """
    if path is None:
        Path(parent).mkdir(parents=True, exist_ok=True)
        while True:
            candidate = default_run_dir(parent, name)
            try:
                candidate.mkdir(exist_ok=False)
            except FileExistsError:  # the same second and suffix: draw another
                continue
            return RunDir(candidate, _lock(candidate), created=True)
    path = Path(path)
    if resume:
        if not path.is_dir():
            raise InvalidConfigError(f"--resume {path}: no such run directory")
        return RunDir(path, _lock(path), created=False)
    _check_free(path, overwrite)  # before the lock: a refused launch changes nothing there
    created = False
    try:
        path.mkdir(parents=True, exist_ok=False)
        created = True
    except FileExistsError:
        if not path.is_dir():
            raise InvalidConfigError(f"--run-dir {path}: exists and is not a directory") from None
    fd = _lock(path)
    try:
        _check_free(path, overwrite)  # again, now that no other launch can write there
        if overwrite:
            for entry in _entries(path):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    except BaseException:
        os.close(fd)
        raise
    return RunDir(path, fd, created)


def _check_free(path: Path, overwrite: bool) -> None:
    """Refuse a directory that holds files, unless they are a run's and ``overwrite``."""
    if not path.exists():
        return
    if not path.is_dir():
        raise InvalidConfigError(f"--run-dir {path}: exists and is not a directory")
    entries = _entries(path)
    if not entries:
        return
    names = ", ".join(sorted(e.name for e in entries)[:4]) + (", ..." if len(entries) > 4 else "")
    if not (path / "config.yaml").is_file():
        raise InvalidConfigError(
            f"--run-dir {path}: holds files that are not a millpond run's ({names}); name a "
            "new or empty directory"
        )
    if not overwrite:
        raise InvalidConfigError(
            f"--run-dir {path}: holds an earlier run ({names}); continue it with --resume "
            f"{path}, name a new directory, or replace it with --overwrite (its files are "
            "deleted)"
        )


def _entries(path: Path) -> list[Path]:
    """What the directory holds besides the lock file."""
    with contextlib.suppress(FileNotFoundError):
        return [e for e in path.iterdir() if e.name != LOCK_FILE]
    return []


def _lock(path: Path) -> int:
    """An exclusive lock on the directory's lock file: its descriptor; refused while another
    job holds it."""
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise InvalidConfigError(
            f"run directory {path}: another millpond launch is writing to it now ({holder}); "
            "two jobs never share a run directory"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}".encode())
    return fd
