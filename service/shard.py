"""A shard: a directory of tables, opened together and checkpointed together.

Layout::

    DIR/shard.json            format marker
    DIR/tables/NAME/          one directory per table (see :class:`Table`)

Opening an existing directory resumes every table in it. A table directory that cannot be
opened (its ``meta.json`` edited or garbled, or missing along with its copy while the
directory holds data; a file missing; not writable) is refused by name: the shard serves
its other tables, logs the refusal, and every call naming that table, creating it
included, raises the same :class:`StorageCorruptedError` until the operator repairs or
moves the directory (and restarts the shard). Nothing in a refused directory is deleted
or overwritten.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from pathlib import Path

from millpond.config import TableConfig
from millpond.errors import (
    MillpondError,
    StorageCorruptedError,
    TableExistsError,
    TableNotFoundError,
)
from millpond.service.atomic_json import atomic_write_json
from millpond.service.table import Table
from millpond.service.table_files import (
    holds_data,
    holds_table,
    os_error,
    refuse_without_meta,
    restorable,
)
from millpond.service.verifier import check_verify_settings

log = logging.getLogger(__name__)


class Shard:
    """The tables of one replay shard, stored under ``path``.

    Args:
        path: the shard's directory; created if missing, resumed if it holds tables.
        fsync: flush each insert to disk (survives a machine crash, not just a killed process).
        verify, verify_rate_mb: when the reopened tables check their segments' data against
            their checksums (see :meth:`Table.open`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fsync: bool = False,
        verify: str = "background",
        verify_rate_mb: float = 0.0,
    ) -> None:
        check_verify_settings(verify, verify_rate_mb)
        self.path = Path(path)
        self.fsync = fsync
        self._verify = (verify, verify_rate_mb)
        self._lock = threading.Lock()
        self._tables: dict[str, Table] = {}
        #: Tables whose directory cannot be opened, by name: what every call naming them gets.
        self._refused: dict[str, StorageCorruptedError] = {}
        tables = self.path / "tables"
        try:
            tables.mkdir(parents=True, exist_ok=True)
            if not (self.path / "shard.json").exists():
                atomic_write_json(self.path / "shard.json", {"format": 1})
            writable = all(os.access(d, os.W_OK | os.X_OK) for d in (self.path, tables))
            table_dirs = sorted(p for p in tables.iterdir() if p.is_dir())
        except OSError as e:
            raise os_error(e, f"cannot open the shard in {self.path}") from None
        if not writable:
            raise StorageCorruptedError(
                f"shard directory {self.path} is not writable (permission denied or a "
                "read-only filesystem): make it and its tables/ writable by the user running "
                "millpond, or serve a copy of it"
            )
        for table_dir in table_dirs:
            self._open_table(table_dir)

    def _open_table(self, table_dir: Path) -> None:
        name = table_dir.name
        try:
            if holds_table(table_dir) or restorable(table_dir):
                verify, rate = self._verify
                table = Table.open(
                    table_dir, fsync=self.fsync, name=name, verify=verify, verify_rate_mb=rate
                )
                self._tables[table.name] = table
            elif holds_data(table_dir):
                raise refuse_without_meta(table_dir)
            # Otherwise: the remains of a create that failed, removed by the next create.
        except Exception as e:
            if isinstance(e, MillpondError):
                text = str(e)
            elif isinstance(e, OSError):
                text = str(os_error(e, f"cannot open the table in {table_dir}"))
            else:  # not a refusal the table files name: a bug, so the traceback is logged
                log.exception("opening %s", table_dir)
                text = f"{table_dir} cannot be opened: {type(e).__name__}: {e}"
            if not text.startswith(f"table {name!r}"):
                text = f"table {name!r} is not served: {text}"
            self._refused[name] = StorageCorruptedError(text)
            log.error("%s", text)

    def create_table(self, config: TableConfig, *, exist_ok: bool = True) -> Table:
        """Create a table, or return the existing one if its config is the same, live
        settings aside (:data:`~millpond.config.LIVE_SETTINGS`: they may have been changed
        while it ran; the existing table keeps them).

        A table of that name with a different config raises :class:`TableExistsError`.
        """
        with self._lock:
            self._check_refused(config.name)
            existing = self._tables.get(config.name)
            if existing is not None:
                if exist_ok and _same_config(existing.config, config):
                    return existing
                raise TableExistsError(
                    f"table {config.name!r} exists with a different config "
                    f"({existing.config.sampler}, capacity {existing.config.capacity})"
                )
            table = Table.create(self.path / "tables" / config.name, config, fsync=self.fsync)
            self._tables[config.name] = table
            return table

    def table(self, name: str) -> Table:
        """The table called ``name``; raises :class:`TableNotFoundError` if there is none."""
        self._check_refused(name)
        try:
            return self._tables[name]
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise TableNotFoundError(f"no table {name!r} on this shard (tables: {known})") from None

    __getitem__ = table

    def _check_refused(self, name: str) -> None:
        refusal = self._refused.get(name)
        if refusal is not None:
            raise StorageCorruptedError(str(refusal))

    @property
    def refused(self) -> dict[str, str]:
        """Tables whose directory could not be opened: name -> why, and what to do."""
        return {name: str(e) for name, e in self._refused.items()}

    @property
    def tables(self) -> dict[str, Table]:
        return dict(self._tables)

    def drop_table(self, name: str) -> None:
        """Delete a table and its files."""
        with self._lock:
            self.table(name).destroy()
            del self._tables[name]

    def checkpoint(self) -> None:
        """Checkpoint every table (see :meth:`Table.checkpoint`)."""
        for table in list(self._tables.values()):
            table.checkpoint()

    def close(self) -> None:
        for table in list(self._tables.values()):
            table.close()

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_config(a: TableConfig, b: TableConfig) -> bool:
    # A table that took its spec from data still matches a config that declared none, and
    # one whose live settings were changed while it ran (ConfigureTable) the config it was
    # created with: the changes persist (the table's config is what creating it returns).
    a, b = a.without_live_settings(), b.without_live_settings()
    return replace(a, spec=None) == replace(b, spec=None) and (b.spec is None or a.spec == b.spec)
