"""ReplayClient: insert, sample, update priorities and exchange weights with replay shards.

One client talks to N shards. A writer is pinned to one shard by a stable hash of its id,
so an episode's segments stay together. ``sample`` splits a batch across shards in
proportion to each one's sampleable mass (every sample response carries the shard's mass
after the batch; Info seeds it) and asks them in parallel. A shard that cannot be reached
counts as empty, with a logged warning, until it answers again (it is tried every few
seconds); only when every shard is down does ``sample`` fail.

Every gRPC error reaches the caller as a :mod:`millpond.errors` exception (``raise ...
from`` the ``RpcError``), with the server's message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.checks import check_batch_size
from millpond.config import LIVE_SETTINGS, TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError, MillpondError
from millpond.learner.client import _iterate, _priorities, _weights
from millpond.learner.client._channels import bearer_metadata, channel_options
from millpond.learner.client._extend import Extender
from millpond.learner.client._info import combine_info
from millpond.learner.client._masses import ShardMasses
from millpond.learner.client._shards import Resolver, ShardSet
from millpond.learner.client._split import SplitSampler
from millpond.learner.client._weights import PendingPublication
from millpond.learner.client.table_reader import TableReader
from millpond.learner.client.writer import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    Writer,
)
from millpond.learner.client.writer import DEFAULT_TIMEOUT_S as DEFAULT_WRITER_TIMEOUT_S
from millpond.protos import millpond_pb2 as pb
from millpond.protos.tables import config_from_proto, config_to_proto
from millpond.routing import shard_of
from millpond.ted import episode_base

logger = logging.getLogger("millpond.client")


class ReplayClient:
    """A client of one or more replay shards.

    Args:
        addresses: ``"host:port"``, a comma-separated list of them, or a sequence. Shard
            ``i`` is the ``i``-th address; shard 0 is the weights rendezvous (the next
            shard once it is lost for good, see ``resolver``).
        token: a bearer token sent with every call (``authorization: Bearer <token>``).
        tls: ``None`` (plaintext), ``True`` (TLS with the system's root certificates), or
            the path of a PEM root certificate.
        timeout_s: the deadline of admin calls, and the default wait of :meth:`sample`,
            :meth:`iterate` and :meth:`extend`; ``None`` waits forever.
        max_message_mb: the largest gRPC message sent or received, in MiB.
        colocated: how :meth:`sample` and :meth:`iterate` get the observations of a shard
            on this host. ``None`` (default): from the table's memory-mapped files when the
            shard reports the same host and its storage directory opens here with the token
            the shard reports, else on the wire; ``True``: from the files, or
            :class:`~millpond.errors.ColocationError` naming the shard, the table and
            why not (queue tables never are: their delivered segments may be overwritten
            at once); ``False``: always on the wire. The shard picks and counts the rows
            either way, so batches are the same for the same table and seed.
        resolver: ``resolver(index)`` gives shard ``index``'s current address (``None``:
            unknown yet) or raises :class:`~millpond.errors.ShardGoneError` when it
            is lost for good; asked when a shard cannot be reached, so that a shard restarted
            on another port is found there (see :mod:`millpond.learner.client._shards`). It must
            pickle to travel with the client. ``None``: shards stay at their addresses.

    Channels are created on first use, so constructing a client never blocks. A client
    pickles as its addresses and options (writers, caches and channels stay behind), so it
    can be handed to a Ray actor.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        token: str | None = None,
        tls: bool | str | os.PathLike | None = None,
        timeout_s: float | None = 30.0,
        max_message_mb: int = 256,
        colocated: bool | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        parts = addresses.split(",") if isinstance(addresses, str) else list(addresses)
        parts = [a.strip() for a in parts if isinstance(a, str) and a.strip()]
        if not parts:
            raise InvalidConfigError(f"addresses ({addresses!r}) name no shard")
        if token is not None and (not isinstance(token, str) or not token):
            raise InvalidConfigError("token must be a non-empty string or None")
        if tls is not None and not isinstance(tls, bool | str | os.PathLike):
            raise InvalidConfigError(f"tls ({tls!r}) must be None, True or a PEM file path")
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
        ):
            raise InvalidConfigError(f"timeout_s ({timeout_s!r}) must be a positive number or None")
        if (
            isinstance(max_message_mb, bool)
            or not isinstance(max_message_mb, int)
            or not 1 <= max_message_mb <= 2047
        ):
            raise InvalidConfigError(
                f"max_message_mb ({max_message_mb!r}) must be an integer in [1, 2047]"
            )
        if colocated is not None and not isinstance(colocated, bool):
            raise InvalidConfigError(f"colocated ({colocated!r}) must be None, True or False")
        if resolver is not None and not callable(resolver):
            raise InvalidConfigError(f"resolver ({resolver!r}) must be callable or None")
        self.resolver = resolver
        self.token = token
        self.tls = tls
        self.colocated = colocated
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.max_message_mb = max_message_mb
        #: seconds this client's publications waited for acting actors (``max_lag``), in all
        self.publish_wait_s = 0.0
        self._set = ShardSet(
            parts,
            channel_options(max_message_mb),
            tls,
            bearer_metadata(token),
            self.timeout_s,
            resolver,
        )
        self._masses = ShardMasses(self._set)
        self._sampler = SplitSampler(
            self._set, self._masses, colocated, channel_options(max_message_mb), tls
        )
        self._lock = threading.Lock()
        self._closed = False
        self._client_id = _default_writer_id()
        self._extenders: dict[str, Extender] = {}
        self._writers: weakref.WeakSet[Writer] = weakref.WeakSet()

    # -- identity ------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        args = (
            self.addresses,
            self.token,
            self.tls,
            self.timeout_s,
            self.max_message_mb,
            self.colocated,
            self.resolver,
        )
        return (type(self), args)

    def __repr__(self) -> str:
        return f"ReplayClient({','.join(self.addresses)!r})"

    @property
    def addresses(self) -> list[str]:
        """The shards' addresses, shard 0 first."""
        return [s.address for s in self._set.shards]

    @property
    def episode_base(self) -> int:
        """Where the episode ids of this client's :meth:`extend` start: a trajectory's
        episode id is ``episode_base + traj_id``, so that two clients' trajectories are
        never joined, whatever their ids (:func:`millpond.ted.episode_base`)."""
        return episode_base(self._client_id)

    @property
    def num_shards(self) -> int:
        return len(self._set.shards)

    @property
    def lost_shards(self) -> list[int]:
        """Indexes of the shards that the ``resolver`` says are lost for good: never tried
        again, their mass 0 (see :mod:`millpond.learner.client._shards`)."""
        return [s.index for s in self._set.shards if s.gone]

    @property
    def unavailable_shards(self) -> list[int]:
        """Indexes of the shards this client's last call to them found unreachable (samples
        skip them and ask them again every few seconds), the lost ones included."""
        return [s.index for s in self._set.shards if s.down]

    def colocated_shards(self, table: str) -> list[int]:
        """Indexes of the shards whose ``table`` this client has read from the table's
        files on this host so far (see ``colocated``); the others' rows came on the wire."""
        return self._sampler.colocated_shards(table)

    def add_shard(self, address: str) -> int:
        """Add a shard at the end of the list; returns its index.

        Existing shards and writers are untouched (writers keep their pinning; writers
        created from now on hash over the new count). Every table this client knows is
        created on the new shard if it can be reached; otherwise it counts as empty.
        """
        if not isinstance(address, str) or not address.strip():
            raise InvalidConfigError(f"address ({address!r}) must be a non-empty 'host:port'")
        shard = self._set.add(address.strip())
        for config in list(self._masses.configs.values()):
            try:
                self._set.call(shard, "CreateTable", _create_request(config))
            except MillpondError as e:
                logger.warning("new shard %s: cannot create table %r: %s", address, config.name, e)
        return shard.index

    # -- tables --------------------------------------------------------------------------
    def create_table(self, config: TableConfig) -> TableConfig:
        """Create ``config``'s table on every shard (an identical existing one is fine).

        Returns the config as stored by shard 0 (its spec included once known). Raises
        :class:`~millpond.errors.TableExistsError` if a table of that name exists with a
        different config, and :class:`ShardUnavailableError` if a shard cannot be reached.
        """
        if not isinstance(config, TableConfig):
            raise InvalidConfigError(f"create_table needs a TableConfig, received {config!r}")
        self._check_open()
        request = _create_request(config)
        responses = self._set.on_all(lambda s: self._set.call(s, "CreateTable", request))
        stored = config_from_proto(responses[0].config)
        self._masses.configs[stored.name] = stored
        return stored

    def configure_table(self, table: str, **settings: Any) -> TableConfig:
        """Change live settings of ``table`` on every shard, while it runs: ``min_size``,
        ``samples_per_insert`` (``None``: no ratio), ``error_buffer``, and a prioritized
        table's ``alpha`` and ``beta``. Settings not given are kept. Callers held back are
        woken to check again at once, and the change persists across restarts (creating
        the table again keeps it). Needs the admin role where tokens are on.

        Typical use: prefill a table with ``samples_per_insert=None``, then switch the
        ratio on. Returns the config as shard 0 holds it now; a bad value raises
        :class:`~millpond.errors.InvalidConfigError` and changes nothing.
        """
        _check_table(table)
        unknown = set(settings) - set(LIVE_SETTINGS)
        if unknown or not settings:
            raise InvalidConfigError(
                f"configure_table takes some of {list(LIVE_SETTINGS)}, received {sorted(settings)}"
            )
        self._check_open()
        request = pb.ConfigureTableRequest(table=table)
        for name, value in settings.items():
            if name == "samples_per_insert" and value is None:
                request.no_samples_per_insert = True
                continue
            try:
                setattr(request, name, value)
            except (TypeError, ValueError):
                raise InvalidConfigError(f"{name} ({value!r}) must be a number") from None
        responses = self._set.on_all(lambda s: self._set.call(s, "ConfigureTable", request))
        stored = config_from_proto(responses[0].config)
        self._masses.configs[stored.name] = stored
        return stored

    def info(self, table: str | None = None) -> dict[str, Any]:
        """What the shards hold.

        With a ``table``: ``{"table", "config", "size", "mass", "inserts", "samples",
        "bytes_on_disk", "weights_version", "shards"}``: the numbers summed over the shards
        that answered, ``weights_version`` the weights rendezvous's (shard 0, or the
        lowest-numbered shard not lost for good; ``None`` if it did not answer), and
        ``"shards"`` one dict per shard: ``"shard"`` (index), ``"address"``, ``"available"``,
        ``"error"`` (``None``, or why the shard gave nothing) and, when it answered, its
        ``"weights_version"`` and :func:`millpond.protos.tables.info_from_proto`'s keys
        (``"config"``, ``"size"``, ``"mass"``, ``"inserts"``, ``"samples"``,
        ``"rate_limiter"``, ``"bytes_on_disk"``, ``"next_generation"``, and ``"host_id"``,
        ``"storage_dir"``, ``"storage_token"``: where a learner on the shard's host reads
        the table's files, see ``colocated``, ...).

        Without: ``{"tables": {name: the dict above}, "shards": [...], "weights_version"}``,
        the per-shard entries listing their ``"tables"`` (names).

        Raises the first shard's error if no shard answered.
        """
        if table is not None:
            _check_table(table)
        self._check_open()
        shards = self._set.shards
        request = pb.InfoRequest(table=table or "")
        results = self._set.each(shards, lambda s: self._set.call(s, "Info", request))
        return combine_info(table, shards, results, self._masses.learn)

    def checkpoint(self) -> list[str]:
        """Checkpoint every shard; returns their directories, shard 0 first."""
        self._check_open()
        request = pb.CheckpointRequest()
        responses = self._set.on_all(lambda s: self._set.call(s, "Checkpoint", request))
        return [r.path for r in responses]

    def reset(self, table: str) -> None:
        """Drop every stored step of ``table`` on every shard (its config and spec stay)."""
        _check_table(table)
        self._check_open()
        request = pb.ResetRequest(table=table)
        self._set.on_all(lambda s: self._set.call(s, "Reset", request))
        self._masses.forget(table)
        with self._lock:
            extender = self._extenders.get(table)
        if extender is not None:
            extender.forget_episodes()

    def read_table(self, table: str) -> TableReader:
        """A consistent snapshot of ``table`` on every shard, read while inserts go on.

        Iterate the :class:`~millpond.learner.client.table_reader.TableReader` for the segments each
        shard had published when the call pinned them (all shards at once), whole, oldest
        first, shard after shard; its ``config``, ``segments`` and ``steps`` say what was
        pinned. Segments overwritten before they are read are left out and counted. Needs
        the admin role where tokens are on.
        """
        _check_table(table)
        self._check_open()
        return TableReader(
            self._set.shards, table, self._set.metadata, self.max_message_mb * 1024 * 1024
        )

    # -- insert --------------------------------------------------------------------------
    def writer(
        self,
        table: str,
        writer_id: str | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        shard: int | None = None,
        timeout_s: float | None = DEFAULT_WRITER_TIMEOUT_S,
        max_in_flight_bytes: int | None = DEFAULT_MAX_IN_FLIGHT_BYTES,
    ) -> Writer:
        """A :class:`Writer` pinned to shard ``shard``, by default to shard
        ``writer_hash(writer_id) % num_shards``.

        ``writer_id`` defaults to ``"{hostname}-{pid}-{8 random hex digits}"``. The shard
        stores a ``(writer_id, sequence)`` once and sequences restart at 1 in every writer,
        so give an explicit id only to one writer at a time, and not again after a restart.
        Pin writers explicitly (e.g. actor ``i`` to shard ``i % num_shards``) to spread a
        few writers evenly; a restarted writer must keep its shard to keep its numbering.

        ``timeout_s`` bounds every wait of the writer for its shard (a write blocked on
        ``max_in_flight``, ``flush``, ``close`` and so leaving a ``with`` block): past it
        :class:`DeadlineExceededError` names the shard, the writer and what is still
        unacknowledged. ``None`` waits for ever.
        ``max_in_flight`` segments holding ``max_in_flight_bytes``: the writer's window
        (see :class:`Writer`), what it sends per round trip and keeps while the shard is away.
        """
        _check_table(table)
        if writer_id is None:
            writer_id = _default_writer_id()
        if not isinstance(writer_id, str) or not writer_id:
            raise InvalidConfigError(f"writer_id ({writer_id!r}) must be a non-empty string")
        self._check_open()
        shards = self._set.shards
        if shard is None:
            shard_index = shard_of(writer_id, len(shards))
        elif isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < len(shards):
            raise InvalidConfigError(
                f"shard ({shard!r}) must be an index in [0, {len(shards)}) of {self.addresses}"
            )
        else:
            shard_index = shard
        pinned = shards[shard_index]
        known = self._masses.configs.get(table)
        if known is None or known.spec is None:  # best effort: the writer checks the spec early
            # Ask every live shard: the first insert may have set the spec on another one, and
            # this shard must not take a different spec from this writer.
            with contextlib.suppress(MillpondError):
                self._masses.refresh(table, [s for s in shards if not s.down], doing="Info")
        writer = Writer(
            pinned,
            table,
            writer_id,
            max_in_flight,
            max_in_flight_bytes=max_in_flight_bytes,
            metadata=self._set.metadata,
            max_message_bytes=self.max_message_mb * 1024 * 1024,
            table_config=lambda: self._masses.configs.get(table),
            on_stored=lambda: self._masses.mark_stale(pinned, table),
            timeout_s=timeout_s,
        )
        self._writers.add(writer)
        return writer

    def extend(self, table: str, td: TensorDictBase, timeout_s: float | None = None) -> int:
        """Insert TED data (a TorchRL collector's output: ``[T]``, ``[P, T]``, ``[B, P, T]``,
        or ``split_trajs`` padded trajectories).

        The data is compacted here (each observation sent once; see
        :func:`millpond.ted.compact_ted`) and sent through this client's writer for
        ``table``, so one call goes to one shard. Trajectories that continue in the next
        call (same ``("collector", "traj_ids")``) keep counting their steps. This client is
        one source: its episode ids are :attr:`episode_base` plus the trajectory ids, so
        give each collector its own client. Returns the number of steps once the shard has
        stored them all (waiting up to ``timeout_s``, default the client's; on timeout they
        are still sent).
        """
        _check_table(table)
        self._check_open()
        with self._lock:
            extender = self._extenders.setdefault(table, Extender())

        def new_writer(generation: int) -> Writer:
            writer_id = f"{self._client_id}-extend-{table}-{generation}"
            # The client's timeout, not the writer default: extend waits as sample does.
            return self.writer(table, writer_id, timeout_s=self.timeout_s)

        return extender.extend(td, self.episode_base, new_writer, lambda: self._timeout(timeout_s))

    # -- sample --------------------------------------------------------------------------
    def sample(self, table: str, batch_size: int, timeout_s: float | None = None) -> TensorDict:
        """Sample a TED batch of ``batch_size`` from the shards, split by their mass.

        Returns a TensorDict ``[B]`` (``[B, slice_len]`` for slices tables; at most ``B``
        steps for queue tables) with ``("next", obs)`` rebuilt, and ``("index", "shard")``
        next to ``("index", "slot")`` and ``("index", "generation")`` so that
        ``update_priorities(table, batch["index"], priorities)`` finds each step's shard.
        Rows come grouped by shard.

        Waits up to ``timeout_s`` (default: the client's) for the rate limiter or for data,
        then raises :class:`~millpond.errors.DeadlineExceededError` (a
        :class:`~millpond.errors.RateLimiterTimeoutError`). The whole call ends within
        ``timeout_s`` plus 1 s: an answer still on the wire then (a slow link) raises
        :class:`~millpond.errors.DeadlineExceededError` naming the shard and the answer's size.
        """
        _check_table(table)
        check_batch_size(batch_size)
        self._check_open()
        return self._sampler.sample(table, int(batch_size), self._timeout(timeout_s), None)

    def iterate(
        self, table: str, batch_size: int, prefetch: int = 4, timeout_s: float | None = None
    ) -> Iterator[TensorDict]:
        """Sample batches forever, keeping ``prefetch`` batches asked ahead; yields in order.

        Closing the generator (``break`` out of the loop, ``close()``) cancels what is in
        flight and joins its threads. A client with one shard asks it ``prefetch`` batches
        per call, one call answered at a time (on the wire: evenly spaced batches, not
        bursts), the next asked for as the last batch of one arrives, each call ending within
        ``prefetch * timeout_s`` plus 10 s. A batch of 1 MiB or more is received, or read from
        the table's files on this host (``colocated``), on a thread of the iterator's own
        while the caller works on the one before; a smaller one when it is asked for. With
        several shards ``prefetch`` :meth:`sample` calls are kept in flight; for queue
        tables one at a time, so batches keep the queue's order. Errors of :meth:`sample`
        are raised here.
        """
        _check_table(table)
        check_batch_size(batch_size)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidConfigError(f"prefetch ({prefetch!r}) must be a positive integer")
        timeout = self._timeout(timeout_s)
        self._check_open()
        return _iterate.iterate(
            self._set, self._masses, self._sampler, table, int(batch_size), prefetch, timeout
        )

    def update_priorities(
        self,
        table: str,
        index: TensorDictBase | Mapping[str, Any],
        priorities: torch.Tensor | np.ndarray | Sequence[float],
    ) -> int:
        """Set the priorities of sampled steps; returns how many were applied.

        ``index`` is a sampled batch's ``"index"`` (``slot``, ``generation``, ``shard``);
        ``priorities`` has one value per step (any shape with that many elements). Each
        shard gets one call, all in parallel. Steps overwritten since they were sampled are
        skipped by their shard; a shard that cannot be reached is skipped with a warning.
        """
        _check_table(table)
        self._check_open()
        return _priorities.update_priorities(self._set, table, index, priorities)

    # -- weights -------------------------------------------------------------------------
    def publish_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        max_lag: int | None = None,
    ) -> int:
        """Publish a state dict as ``version`` on the weights rendezvous (shard 0, or the
        lowest-numbered shard not lost for good); returns it.

        Parameter names are dot-separated parts of letters, digits, ``_`` and ``-``
        (``"fc.weight"``, ``"layers.0.bias"``); tensors travel as raw bytes.

        ``max_lag`` (bounded staleness): the rendezvous stores the version only once every
        env actor acting holds ``version - max_lag`` or newer, waiting for them within the
        client's timeout (:class:`DeadlineExceededError` after it, nothing stored). The
        seconds waited add up in :attr:`publish_wait_s`.
        """
        return self.publish_weights_later(state_dict, version, max_lag=max_lag).result()

    def publish_weights_later(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        max_lag: int | None = None,
    ) -> PendingPublication:
        """:meth:`publish_weights` without waiting for the answer: the call goes on while
        the caller does (the state dict is serialized before this returns), and the
        returned handle's ``result()`` waits for it, returning the version or raising the
        error :meth:`publish_weights` would."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidDataError(f"version ({version!r}) must be a non-negative integer")
        if max_lag is not None and (
            isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0
        ):
            raise InvalidDataError(f"max_lag ({max_lag!r}) must be a non-negative integer")
        self._check_open()
        return _weights.publish(self._set, state_dict, version, max_lag, self._waited)

    def _waited(self, seconds: float) -> None:
        with self._lock:
            self.publish_wait_s += seconds

    def get_weights(
        self,
        min_version: int = 0,
        timeout_s: float = 0,
        *,
        actor: str = "",
        acting: bool = False,
    ) -> tuple[dict[str, torch.Tensor] | None, int]:
        """The latest published weights, as ``(state_dict, version)``.

        Waits up to ``timeout_s`` for a version ``>= min_version``; if there is none,
        returns ``(None, latest_version)`` (``-1`` when nothing was published).

        An env actor names itself (``actor``) to take part in bounded staleness: ``acting``,
        it acts from this call on with the version returned (its own, ``min_version - 1``,
        when none is), and holds back publications with a ``max_lag`` until its next call;
        not ``acting``, it holds nothing back.
        """
        if not isinstance(actor, str) or not isinstance(acting, bool):
            raise InvalidDataError(
                f"actor ({actor!r}) must be a string and acting ({acting!r}) a bool"
            )
        if isinstance(min_version, bool) or not isinstance(min_version, int):
            raise InvalidDataError(f"min_version ({min_version!r}) must be an integer")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s < 0:
            raise InvalidDataError(f"timeout_s ({timeout_s!r}) must be a number >= 0")
        self._check_open()
        return _weights.fetch(self._set, min_version, timeout_s, self.timeout_s, actor, acting)

    # -- lifecycle -----------------------------------------------------------------------
    def close(self, timeout_s: float | None = None) -> None:
        """Close (flush) every writer made by this client, then the channels.

        Blocks while a writer's shard is down or its table's rate limiter holds inserts
        back, for at most ``timeout_s`` seconds in all when given: writers still waiting
        then drop what is unacknowledged and :class:`DeadlineExceededError` is raised after
        the channels are closed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        first: MillpondError | None = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for writer in list(self._writers):
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                writer.close(timeout_s=left)
            except MillpondError as e:
                first = first or e
        self._set.close()
        self._sampler.close()
        if first is not None:
            raise first

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float | None:
        if timeout_s is None:
            return self.timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s < 0:
            raise InvalidConfigError(f"timeout_s ({timeout_s!r}) must be a number >= 0 or None")
        return float(timeout_s)

    def _check_open(self) -> None:
        if self._closed:
            raise MillpondError("the client is closed")


# -- helpers ------------------------------------------------------------------------------------
def _default_writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _create_request(config: TableConfig) -> pb.CreateTableRequest:
    return pb.CreateTableRequest(config=config_to_proto(config), exist_ok=True)


def _check_table(table: str) -> None:
    if not isinstance(table, str) or not table:
        raise InvalidConfigError(f"table ({table!r}) must be a non-empty string")
