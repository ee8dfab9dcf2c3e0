"""The client's view of its shards: channels, up/down state, masses, and split sampling.

A :class:`ShardHandle` owns one lazily created gRPC channel and remembers whether the shard
answered lately. A :class:`ShardSet` holds the handles, each table's sampleable mass per
shard (from every sample response, seeded by Info), the calls' plumbing (error mapping,
parallel fan-out) and :meth:`ShardSet.sample`: a batch split across shards by
:func:`split_batch`, asked in parallel, and merged. :class:`CallSet` tracks the gRPC calls
of one operation so that they can all be cancelled at once (a closed ``iterate``
generator, a failed ``sample``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.errors import (
    InvalidConfigError,
    MillpondError,
    RateLimiterTimeoutError,
    TableNotFoundError,
)
from millpond.learner._errors import ShardUnavailableError, from_rpc_error, is_connect_failure
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.codec import decode_sample
from millpond.protos.tables import info_from_proto

logger = logging.getLogger("millpond.client")

T = TypeVar("T")

#: Seconds between attempts to reach a shard that was found down.
RETRY_DOWN_S = 3.0
#: Extra seconds a call's gRPC deadline allows beyond the wait the server is asked to honour.
DEADLINE_SLACK_S = 10.0
#: How long a mass refresh (an Info call made for sampling) may take.
PROBE_TIMEOUT_S = 5.0
#: A shard whose cached mass is 0 is asked again (in the background) this often.
ZERO_MASS_REFRESH_S = 1.0
_POOL_WORKERS = 32
#: "The client's default timeout" for :meth:`ShardSet.call`.
DEFAULT = object()


def channel_options(max_message_mb: int) -> list[tuple[str, Any]]:
    """gRPC channel options: message size limits, keepalive, quick reconnects.

    Keepalive pings every 5 minutes: servers by default refuse pings that come more often on
    an idle connection (``grpc.http2.min_recv_ping_interval_without_data_ms``, 5 minutes).
    Reconnect backoff is capped at 2 s, so a restarted shard is found again quickly.
    """
    size = int(max_message_mb) * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 300_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def channel_credentials(tls: bool | str | os.PathLike | None) -> grpc.ChannelCredentials | None:
    """``None`` (plaintext), system roots (``True``) or a PEM root certificate file."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    try:
        with open(tls, "rb") as f:
            roots = f.read()
    except OSError as e:
        raise InvalidConfigError(f"tls ({tls!r}): cannot read the root certificate: {e}") from e
    return grpc.ssl_channel_credentials(root_certificates=roots)


class ShardHandle:
    """One shard as the client sees it: address, channel, stub, and whether it is up.

    Attributes:
        index: the shard's position in the client's list (stable: shards are only appended).
        address: ``host:port``.
        down: the last call found the shard unreachable; its mass counts as 0 meanwhile.
        retry_at: ``time.monotonic()`` after which a down shard is tried again.
    """

    def __init__(
        self,
        index: int,
        address: str,
        options: Sequence[tuple[str, Any]],
        tls: bool | str | os.PathLike | None,
    ) -> None:
        self.index = index
        self.address = address
        self._options = list(options)
        self._tls = tls
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ReplayStub | None = None
        self.down = False
        self.retry_at = 0.0

    @property
    def stub(self) -> pb_grpc.ReplayStub:
        """The Replay stub, creating the channel on first use."""
        stub = self._stub
        if stub is not None:
            return stub
        with self._lock:
            if self._stub is None:
                creds = channel_credentials(self._tls)
                if creds is None:
                    self._channel = grpc.insecure_channel(self.address, options=self._options)
                else:
                    self._channel = grpc.secure_channel(self.address, creds, options=self._options)
                self._stub = pb_grpc.ReplayStub(self._channel)
            return self._stub

    def mark_down(self) -> bool:
        """Record that the shard is unreachable; returns whether it was up until now."""
        with self._lock:
            was_up = not self.down
            self.down = True
            self.retry_at = time.monotonic() + RETRY_DOWN_S
            return was_up

    def mark_up(self) -> bool:
        """Record that the shard answered; returns whether it was down until now."""
        with self._lock:
            was_down = self.down
            self.down = False
            return was_down

    def due_for_retry(self, now: float) -> bool:
        return self.down and now >= self.retry_at

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None

    def __repr__(self) -> str:
        return f"ShardHandle({self.index}, {self.address!r}{', down' if self.down else ''})"


def split_batch(n: int, masses: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Split ``n`` draws among shards in proportion to ``masses`` (systematic sampling).

    Each shard gets ``floor(n * p)`` or one more, with expectation exactly ``n * p``, so the
    merged batch samples every stored step with the same probability it would have in one
    table holding everything. Shards with zero mass get nothing; ``sum(masses)`` must be > 0.
    """
    m = np.clip(np.asarray(masses, dtype=np.float64), 0.0, None)
    total = m.sum()
    if not total > 0:
        raise ValueError("split_batch needs a positive total mass")
    edges = np.floor(np.cumsum(m / total) * n + rng.random()).astype(np.int64)
    edges = np.clip(edges, 0, n)
    edges[-1] = n  # floor(n + u) == n; rounding in the cumulative sum may say n - 1
    return [int(c) for c in np.diff(edges, prepend=0)]


class CallSet:
    """The gRPC calls of one operation, cancellable at once (children included)."""

    def __init__(self, parent: CallSet | None = None) -> None:
        self._lock = threading.Lock()
        self._calls: set[Any] = set()
        self._children: set[CallSet] = set()
        self._parent = parent
        self.cancelled = False
        if parent is not None:
            parent._adopt(self)

    def _adopt(self, child: CallSet) -> None:
        with self._lock:
            self._children.add(child)
            cancelled = self.cancelled
        if cancelled:
            child.cancel()

    def child(self) -> CallSet:
        return CallSet(self)

    def add(self, call: Any) -> bool:
        """Track ``call``; if the set was cancelled already, cancel it and return False."""
        with self._lock:
            if not self.cancelled:
                self._calls.add(call)
                return True
        call.cancel()
        return False

    def discard(self, call: Any) -> None:
        with self._lock:
            self._calls.discard(call)

    def cancel(self) -> None:
        """Cancel every tracked call and child; later :meth:`add` calls cancel at once."""
        with self._lock:
            self.cancelled = True
            calls, children = list(self._calls), list(self._children)
            self._calls.clear()
        for call in calls:
            call.cancel()
        for child in children:
            child.cancel()

    def release(self) -> None:
        """Detach from the parent (the operation is over)."""
        if self._parent is not None:
            with self._parent._lock:
                self._parent._children.discard(self)


class Cancelled(Exception):
    """The operation's calls were cancelled (a closed ``iterate`` generator)."""


class _ShardDown(Exception):
    def __init__(self, shard: ShardHandle, error: MillpondError) -> None:
        super().__init__(str(error))
        self.shard = shard
        self.error = error


class ShardSet:
    """The shards of one client, what it knows about their tables, and a thread pool.

    Args:
        addresses: one per shard, shard 0 first.
        options: gRPC channel options.
        tls: see :func:`channel_credentials`.
        metadata: sent with every call.
        timeout_s: the default deadline of calls (``None``: none).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        options: Sequence[tuple[str, Any]],
        tls: bool | str | os.PathLike | None,
        metadata: tuple[tuple[str, str], ...] | None,
        timeout_s: float | None,
    ) -> None:
        self._options = list(options)
        self._tls = tls
        self.metadata = metadata
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._shards = [ShardHandle(i, a, self._options, tls) for i, a in enumerate(addresses)]
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._rng = np.random.default_rng()
        self.configs: dict[str, TableConfig] = {}
        self._masses: dict[tuple[int, str], float] = {}
        self._mass_at: dict[tuple[int, str], float] = {}
        self._refreshing: set[tuple[int, str]] = set()
        self._stale: set[tuple[int, str]] = set()

    # -- the list ------------------------------------------------------------------------
    @property
    def shards(self) -> list[ShardHandle]:
        """The handles, shard 0 first (a snapshot: :meth:`add` replaces the list)."""
        return self._shards

    def add(self, address: str) -> ShardHandle:
        with self._lock:
            shard = ShardHandle(len(self._shards), address, self._options, self._tls)
            self._shards = [*self._shards, shard]
            return shard

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for shard in self._shards:
            shard.close()

    # -- calls ---------------------------------------------------------------------------
    def call(
        self,
        shard: ShardHandle,
        method: str,
        request: Any,
        timeout: float | object | None = DEFAULT,
    ) -> Any:
        """One unary (or client-streaming) call, with errors mapped and shard state noted.

        ``timeout``: the call's deadline in seconds (default: the client's ``timeout_s``).
        """
        deadline = self.timeout_s if timeout is DEFAULT else timeout
        try:
            response = getattr(shard.stub, method)(
                request, timeout=deadline, metadata=self.metadata
            )
        except grpc.RpcError as err:
            self.note_failure(shard, err)
            raise from_rpc_error(err, shard.address) from err
        self.note_up(shard)
        return response

    def note_failure(self, shard: ShardHandle, err: grpc.RpcError) -> None:
        if is_connect_failure(err):
            self._note_down(shard, from_rpc_error(err, shard.address))

    def _note_down(self, shard: ShardHandle, error: MillpondError) -> None:
        if shard.mark_down():
            logger.warning(
                "shard %s is unavailable (%s); sampling continues from the other shards, "
                "and it is tried again every few seconds",
                shard.address,
                error,
            )

    def note_up(self, shard: ShardHandle) -> None:
        if shard.mark_up():
            logger.info("shard %s is available again", shard.address)

    def each(
        self, shards: Sequence[ShardHandle], fn: Callable[[ShardHandle], T]
    ) -> list[T | MillpondError]:
        """``fn(shard)`` for every shard in parallel; each result or the error raised."""
        if len(shards) == 1:
            try:
                return [fn(shards[0])]
            except MillpondError as e:
                return [e]
        futures = [self.submit(fn, s) for s in shards]
        out: list[T | MillpondError] = []
        for future in futures:
            try:
                out.append(future.result())
            except MillpondError as e:
                out.append(e)
        return out

    def on_all(self, fn: Callable[[ShardHandle], T]) -> list[T]:
        """``fn(shard)`` on every shard in parallel; raises the first error after all ran."""
        results = self.each(self._shards, fn)
        for result in results:
            if isinstance(result, MillpondError):
                raise result
        return results  # type: ignore[return-value]

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise MillpondError("the client is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=_POOL_WORKERS, thread_name_prefix="millpond-client"
                )
            pool = self._pool
        return pool.submit(fn, *args)

    # -- what the shards hold ------------------------------------------------------------
    def learn(self, shard: ShardHandle, info: dict[str, Any]) -> None:
        """Remember a shard's table info (an ``info_from_proto`` dict): mass and config."""
        name = info["name"]
        self.set_mass(shard, name, info["mass"])
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

    def forget_masses(self, table: str) -> None:
        """Every shard's mass of ``table`` is 0 (after a reset)."""
        for shard in self._shards:
            self.set_mass(shard, table, 0.0)

    def refresh(self, table: str, shards: Sequence[ShardHandle]) -> None:
        """Ask ``shards`` for ``table``'s info now (mass, config); marks down shards.

        Raises :class:`TableNotFoundError` if every shard that answered lacks the table,
        or another error a shard returned that is not about reachability.
        """
        if not shards:
            return
        request = pb.InfoRequest(table=table)
        timeout = (
            PROBE_TIMEOUT_S if self.timeout_s is None else min(self.timeout_s, PROBE_TIMEOUT_S)
        )
        results = self.each(shards, lambda s: self.call(s, "Info", request, timeout=timeout))
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
        for shard in self._shards:
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

            self.submit(probe)
        if stale:
            with contextlib.suppress(TableNotFoundError):
                self.refresh(table, stale)

    # -- sampling ------------------------------------------------------------------------
    def sample(
        self, table: str, batch_size: int, timeout: float | None, parent: CallSet | None
    ) -> TensorDict:
        """A batch split across the live shards by mass, asked in parallel, merged.

        A shard found down meanwhile is skipped (its share asked from the others); waits up
        to ``timeout`` seconds in all. Raises :class:`Cancelled` if ``parent`` is cancelled.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = CallSet(parent)
        parts: dict[int, list[TensorDict]] = {}
        try:
            self.refresh_stale(table)
            remaining = int(batch_size)
            while remaining > 0:
                plan = self._allocate(table, remaining, deadline, timeout, calls)
                wait = None if deadline is None else max(0.001, deadline - time.monotonic())
                futures = [
                    (shard, n, self.submit(self._sample_shard, shard, table, n, wait, calls))
                    for shard, n in plan
                ]
                remaining = 0
                error: BaseException | None = None
                for shard, n, future in futures:
                    try:
                        parts.setdefault(shard.index, []).append(future.result())
                    except _ShardDown:
                        remaining += n  # asked again from the shards still up
                    except BaseException as e:
                        if error is None or isinstance(error, Cancelled):
                            error = e
                        calls.cancel()
                if error is not None:
                    raise error
        finally:
            calls.release()
        batches = [td for index in sorted(parts) for td in parts[index]]
        return batches[0] if len(batches) == 1 else torch.cat(batches, dim=0)

    def _sample_shard(
        self, shard: ShardHandle, table: str, n: int, wait: float | None, calls: CallSet
    ) -> TensorDict:
        request = pb.SampleRequest(
            table=table,
            batch_size=n,
            num_batches=1,
            timeout_ms=0 if wait is None else max(1, int(wait * 1000)),
        )
        deadline = None if wait is None else wait + DEADLINE_SLACK_S
        if calls.cancelled:
            raise Cancelled
        call = shard.stub.Sample(request, timeout=deadline, metadata=self.metadata)
        if not calls.add(call):
            raise Cancelled
        try:
            responses = list(call)
        except grpc.RpcError as err:
            if calls.cancelled:
                raise Cancelled from None
            error = from_rpc_error(err, shard.address)
            if is_connect_failure(err):
                self._note_down(shard, error)
                raise _ShardDown(shard, error) from err
            raise error from err
        finally:
            calls.discard(call)
        self.note_up(shard)
        if len(responses) != 1:
            raise MillpondError(
                f"shard {shard.address}: expected one sample batch, received {len(responses)}"
            )
        td = decode_sample(responses[0])
        td.set(("index", "shard"), torch.full_like(td.get(("index", "slot")), shard.index))
        self.set_mass(shard, table, responses[0].mass)
        return td

    def _allocate(
        self,
        table: str,
        n: int,
        deadline: float | None,
        timeout: float | None,
        calls: CallSet,
    ) -> list[tuple[ShardHandle, int]]:
        """How many of ``n`` draws each live shard serves (waiting while all are empty)."""
        delay = 0.01
        refreshed = False
        while True:
            if calls.cancelled:
                raise Cancelled
            shards = self._shards
            live = [s for s in shards if not s.down]
            if not live:  # ask them all now rather than wait for their retry time
                self.refresh(table, shards)
                live = [s for s in shards if not s.down]
                if not live:
                    raise ShardUnavailableError(
                        f"sample {table!r}: all {len(shards)} shards are unavailable "
                        f"({', '.join(s.address for s in shards)})"
                    )
            unknown = [s for s in live if (s.index, table) not in self._masses]
            if unknown:
                self.refresh(table, unknown)
                continue
            masses = [self._masses.get((s.index, table), 0.0) for s in live]
            if sum(masses) > 0:
                counts = split_batch(n, masses, self._rng)
                return [(s, k) for s, k in zip(live, counts, strict=True) if k > 0]
            if refreshed:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RateLimiterTimeoutError(
                        f"sample {table!r}: no shard had data to sample after {timeout} s"
                    )
                time.sleep(delay)
                delay = min(0.2, delay * 2)
            self.refresh(table, live)
            refreshed = True
