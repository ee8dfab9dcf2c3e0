"""Fixtures shared by millpond's tests.

Helpers that tests import (envs, rollouts, segmenting, readers of a table's slots) live in
``millpond.testing``: with ``--import-mode=importlib`` test modules cannot import each other.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from millpond.config import TableConfig
from millpond.service.table import Table


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A random generator seeded from the test's id: the same every run, different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def make_table(tmp_path) -> Iterator[Callable[..., Table]]:
    """``make_table(config, **kwargs)``: a new table under ``tmp_path``, closed at teardown."""
    tables: list[Table] = []

    def make(config: TableConfig, **kwargs) -> Table:
        table = Table.create(tmp_path / "tables" / config.name, config, **kwargs)
        tables.append(table)
        return table

    yield make
    for table in tables:
        table.close()
