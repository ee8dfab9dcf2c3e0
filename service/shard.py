"""A shard: a directory of tables, opened together and checkpointed together.

Layout::

    DIR/shard.json            format marker
    DIR/tables/NAME/          one directory per table (see :class:`Table`)

Opening an existing directory resumes every table in it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from millpond.config import TableConfig
from millpond.errors import TableExistsError, TableNotFoundError
from millpond.service.atomic_json import atomic_write_json
from millpond.service.table import Table
from millpond.service.table_files import holds_table


class Shard:
    """The tables of one replay shard, stored under ``path``.

    Args:
        path: the shard's directory; created if missing, resumed if it holds tables.
        fsync: flush each insert to disk (survives a machine crash, not just a killed process).
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._tables: dict[str, Table] = {}
        (self.path / "tables").mkdir(parents=True, exist_ok=True)
        if not (self.path / "shard.json").exists():
            atomic_write_json(self.path / "shard.json", {"format": 1})
        for table_dir in sorted((self.path / "tables").iterdir()):
            if holds_table(table_dir):
                table = Table.open(table_dir, fsync=fsync)
                self._tables[table.name] = table

    def create_table(self, config: TableConfig, *, exist_ok: bool = True) -> Table:
        """Create a table, or return the existing one if its config is the same.

        A table of that name with a different config raises :class:`TableExistsError`.
        """
        with self._lock:
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
        try:
            return self._tables[name]
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise TableNotFoundError(f"no table {name!r} on this shard (tables: {known})") from None

    __getitem__ = table

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
    # A table that took its spec from data still matches a config that declared none.
    return a == b and (b.spec is None or a.spec == b.spec)
