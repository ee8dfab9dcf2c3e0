"""What the client knows of the shards' tables: each one's sampleable mass per shard.

Sampling splits a batch by these masses, so :class:`ShardMasses` keeps them fresh enough:
every sample response carries its shard's mass after the batch, an Info call seeds or
re-reads it (:meth:`~ShardMasses.refresh`), and :meth:`~ShardMasses.refresh_stale` re-reads
those that may be out of date and probes down shards in the background. The same Info
answers give each table's config (:attr:`~ShardMasses.configs`), kept here too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from millpond.config import TableConfig
from millpond.errors import MillpondError, TableNotFoundError
from millpond.learner.client._errors import ShardUnavailableError
from millpond.learner.client._shards import RETRY_DOWN_S, ShardHandle, ShardSet
from millpond.protos import millpond_pb2 as pb
from millpond.protos.tables import info_from_proto

#: How long a mass refresh (an Info call made for sampling) may take.
PROBE_TIMEOUT_S = 5.0
#: A shard whose cached mass is 0 is asked again (in the background) this often.
ZERO_MASS_REFRESH_S = 1.0


class ShardMasses:
    """Each table's mass per shard and its config, as last heard from the shards of ``shards``."""

    def __init__(self, shards: ShardSet) -> None:
        self._set = shards
        self._lock = threading.Lock()
        self.configs: dict[str, TableConfig] = {}
        self._masses: dict[tuple[int, str], float] = {}
        self._mass_at: dict[tuple[int, str], float] = {}
        self._refreshing: set[tuple[int, str]] = set()
        self._stale: set[tuple[int, str]] = set()
        #: Per (shard index, table): the shard's last Info about it (``info_from_proto``),
        #: which says where a learner on its host may read its files.
        self.infos: dict[tuple[int, str], dict[str, Any]] = {}

    def known(self, shard: ShardHandle, table: str) -> bool:
        """Whether ``shard``'s mass of ``table`` was ever heard."""
        return (shard.index, table) in self._masses

    def get(self, shard: ShardHandle, table: str) -> float:
        """``shard``'s last heard mass of ``table`` (0 if never heard)."""
        return self._masses.get((shard.index, table), 0.0)

    def learn(self, shard: ShardHandle, info: dict[str, Any]) -> None:
        """Remember a shard's table info (an ``info_from_proto`` dict): mass and config."""
        name = info["name"]
        self.set_mass(shard, name, info["mass"])
        self.infos[(shard.index, name)] = info
        config: TableConfig = info["config"]
        with self._lock:
            known = self.configs.get(name)
            if known is None or (known.spec is None and config.spec is not None):
                self.configs[name] = config

    def set_mass(self, shard: ShardHandle, table: str, mass: float) -> None:
        with self._lock:
            self._masses[(shard.index, table)] = max(0.0, float(mass))
            self._mass_at[(shard.index, table)] = time.monotonic()
            self._stale.discard((shard.index, table))

    def mark_stale(self, shard: ShardHandle, table: str) -> None:
        """The shard stored data for ``table`` (a writer of this client saw it): re-read
        its mass before the next sample."""
        with self._lock:
            self._stale.add((shard.index, table))

    def forget(self, table: str) -> None:
        """Every shard's mass of ``table`` is 0 (after a reset)."""
        for shard in self._set.shards:
            self.set_mass(shard, table, 0.0)

    def refresh(self, table: str, shards: Sequence[ShardHandle], doing: str = "Sample") -> None:
        """Ask ``shards`` for ``table``'s info now (mass, config); marks down shards (a
        warning says the ``doing`` call goes on without them).

        Raises :class:`TableNotFoundError` if every shard that answered lacks the table,
        or another error a shard returned that is not about reachability.
        """
        if not shards:
            return
        request = pb.InfoRequest(table=table)
        timeout_s = self._set.timeout_s
        timeout = PROBE_TIMEOUT_S if timeout_s is None else min(timeout_s, PROBE_TIMEOUT_S)
        results = self._set.each(
            shards, lambda s: self._set.call(s, "Info", request, timeout=timeout, doing=doing)
        )
        missing: list[TableNotFoundError] = []
        answered = 0
        for shard, result in zip(shards, results, strict=True):
            if isinstance(result, TableNotFoundError):
                missing.append(result)
                self.set_mass(shard, table, 0.0)
            elif isinstance(result, ShardUnavailableError) or (
                isinstance(result, MillpondError) and shard.down  # it never answered
            ):
                continue
            elif isinstance(result, MillpondError):
                raise result
            else:
                answered += 1
                found = [t for t in result.tables if t.config.name == table]
                if not found:
                    self.set_mass(shard, table, 0.0)
                for t in found:
                    self.learn(shard, info_from_proto(t))
        if missing and not answered:
            raise missing[0]

    def refresh_stale(self, table: str) -> None:
        """Re-read masses that may be out of date; retry down shards in the background.

        Asked at once: a live shard that stored data from this client's writers since its
        mass was read, and one whose cached mass is 0 (it gets no samples, so no fresh mass)
        once that value is :data:`ZERO_MASS_REFRESH_S` old. A down shard is probed without
        waiting for the answer, every :data:`RETRY_DOWN_S`.
        """
        now = time.monotonic()
        stale = []
        for shard in self._set.shards:
            key = (shard.index, table)
            if not shard.down:
                if key in self._stale or (
                    self._masses.get(key) == 0.0
                    and now - self._mass_at.get(key, 0.0) >= ZERO_MASS_REFRESH_S
                ):
                    stale.append(shard)
                continue
            if not shard.due_for_retry(now):
                continue
            with self._lock:
                if key in self._refreshing:
                    continue
                self._refreshing.add(key)
                shard.retry_at = now + RETRY_DOWN_S

            def probe(shard: ShardHandle = shard, key: tuple[int, str] = key) -> None:
                try:
                    self.refresh(table, [shard])
                except MillpondError:
                    pass
                finally:
                    with self._lock:
                        self._refreshing.discard(key)

            self._set.submit(probe)
        if stale:
            with contextlib.suppress(TableNotFoundError):
                self.refresh(table, stale)
