"""Shard handles: each shard's address, stub and liveness, and the calls made to them.

A :class:`ShardHandle` owns one lazily created gRPC channel and remembers whether the shard
answered lately (a shard found unreachable is tried again every :data:`RETRY_DOWN_S`). A
:class:`ShardSet` holds one client's handles and makes its calls: one call with its error
mapped and the shard's state noted (:meth:`ShardSet.call`), or the same function on several
shards in parallel on its thread pool (:meth:`ShardSet.each`, :meth:`ShardSet.on_all`).

Shards that move. A client may be given a *resolver*: ``resolver(index)`` returns shard
``index``'s current address, ``None`` when it cannot say yet, or raises
:class:`ShardGoneError` when the shard is lost for good. A shard that a supervisor restarts
may come back on another port: when a call finds a shard unreachable, its handle asks the
resolver (at most every :data:`RESOLVE_EVERY_S`), and a new address replaces the old one,
the next call dialling it; a shard the resolver calls gone is never tried again (samples
skip it, writers pinned to it fail with :class:`ShardGoneError`, so that their owner can
write to another shard).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from millpond.errors import MillpondError, ShardGoneError
from millpond.learner.client._channels import TLS, open_channel
from millpond.learner.client._errors import from_rpc_error, is_connect_failure
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc

logger = logging.getLogger("millpond.client")

T = TypeVar("T")

#: Seconds between attempts to reach a shard that was found down.
RETRY_DOWN_S = 3.0
#: Seconds between two questions to the resolver about one shard.
RESOLVE_EVERY_S = 0.5


#: ``resolver(index)``: shard ``index``'s address now, ``None`` if unknown yet; raises
#: :class:`ShardGoneError` for a shard lost for good.
Resolver = Callable[[int], "str | None"]
_POOL_WORKERS = 32
#: "The client's default timeout" for :meth:`ShardSet.call`.
DEFAULT = object()


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
        tls: TLS,
        resolver: Resolver | None = None,
    ) -> None:
        self.index = index
        self.address = address
        self._resolver = resolver
        self._resolved_at = 0.0
        self._old_channels: list[grpc.Channel] = []
        self.gone = False
        self._options = list(options)
        self._tls = tls
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ReplayStub | None = None
        self._raw_insert: grpc.StreamStreamMultiCallable | None = None
        self._raw_sample: grpc.UnaryStreamMultiCallable | None = None
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
                self._channel = open_channel(self.address, self._options, self._tls)
                self._raw_insert = self._channel.stream_stream(
                    "/millpond.v1.Replay/Insert",
                    request_serializer=None,
                    response_deserializer=pb.InsertResponse.FromString,
                )
                self._raw_sample = self._channel.unary_stream(
                    "/millpond.v1.Replay/Sample",
                    request_serializer=pb.SampleRequest.SerializeToString,
                    response_deserializer=None,
                )
                self._stub = pb_grpc.ReplayStub(self._channel)
            return self._stub

    @property
    def raw_insert(self) -> grpc.StreamStreamMultiCallable:
        """``Insert`` taking requests already serialized (``bytes``, see
        :mod:`millpond.protos.wire`), creating the channel on first use."""
        self.stub  # noqa: B018  (creates the channel and this call with it)
        return self._raw_insert

    @property
    def raw_sample(self) -> grpc.UnaryStreamMultiCallable:
        """``Sample`` answering with the responses' bytes (parse them with
        :func:`millpond.protos.wire.parse_sample_response`), creating the channel on first
        use."""
        self.stub  # noqa: B018  (creates the channel and this call with it)
        return self._raw_sample

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
        return self.down and not self.gone and now >= self.retry_at

    def resolve(self) -> str:
        """Ask the resolver where the shard is now (after a call found it unreachable).

        Returns ``"moved"`` (a new address: the next call dials it, and the shard counts
        as up), ``"gone"`` (lost for good: down for ever), or ``"same"`` (no resolver, no
        answer yet, or asked less than :data:`RESOLVE_EVERY_S` ago)."""
        if self.gone:
            return "gone"
        now = time.monotonic()
        with self._lock:
            if self._resolver is None or now - self._resolved_at < RESOLVE_EVERY_S:
                return "same"
            self._resolved_at = now
        try:
            address = self._resolver(self.index)
        except ShardGoneError as e:
            with self._lock:
                first = not self.gone
                self.gone = self.down = True
                self.retry_at = float("inf")
            if first:
                logger.warning("shard %d (%s) is lost for good: %s", self.index, self.address, e)
            return "gone"
        except Exception as e:  # the resolver could not say: ask again later
            logger.debug("shard %d: the resolver failed: %s", self.index, e)
            return "same"
        if not address or address == self.address:
            return "same"
        with self._lock:
            old, self.address = self.address, address
            if self._channel is not None:  # calls in flight on it end by themselves
                self._old_channels.append(self._channel)
            self._channel = None
            self._stub = None
            self.down = False
        logger.warning("shard %d moved from %s to %s", self.index, old, address)
        return "moved"

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            for channel in self._old_channels:
                channel.close()
            self._old_channels.clear()
            self._channel = None
            self._stub = None

    def __repr__(self) -> str:
        return f"ShardHandle({self.index}, {self.address!r}{', down' if self.down else ''})"


class ShardSet:
    """The shards of one client and the thread pool that calls them in parallel.

    Args:
        addresses: one per shard, shard 0 first.
        options: gRPC channel options.
        tls: see :func:`millpond.learner.client._channels.channel_credentials`.
        metadata: sent with every call.
        timeout_s: the default deadline of calls (``None``: none).
        resolver: where a shard is now (see the module docstring); ``None``: shards stay
            at their addresses.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        options: Sequence[tuple[str, Any]],
        tls: TLS,
        metadata: tuple[tuple[str, str], ...] | None,
        timeout_s: float | None,
        resolver: Resolver | None = None,
    ) -> None:
        self._options = list(options)
        self._tls = tls
        self.resolver = resolver
        self.metadata = metadata
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._shards = [
            ShardHandle(i, a, self._options, tls, resolver) for i, a in enumerate(addresses)
        ]
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # -- the list ------------------------------------------------------------------------
    @property
    def shards(self) -> list[ShardHandle]:
        """The handles, shard 0 first (a snapshot: :meth:`add` replaces the list)."""
        return self._shards

    def rendezvous(self) -> ShardHandle:
        """The weights rendezvous: the lowest-numbered shard not lost for good.

        Shard 0 while it lives (down or restarting included: publications and fetches wait
        for it); once its resolver calls it gone, the next shard, and so on. Every client
        of a job asks the same resolver, so the learner and the actors move together.
        Raises :class:`ShardGoneError` when every shard is lost for good.
        """
        shards = self.shards
        for shard in shards:
            if not shard.gone:
                return shard
        raise ShardGoneError(
            f"every shard is lost for good ({', '.join(s.address for s in shards)}): no "
            "shard can hold the weights"
        )

    def add(self, address: str) -> ShardHandle:
        with self._lock:
            shard = ShardHandle(len(self._shards), address, self._options, self._tls, self.resolver)
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
        doing: str | None = None,
    ) -> Any:
        """One unary (or client-streaming) call, with errors mapped and shard state noted.

        ``timeout``: the call's deadline in seconds (default: the client's ``timeout_s``).
        ``doing``: the client's call it serves, for the warning of a shard found down
        (``"Sample"`` for the ``Info`` calls sampling makes; default: ``method``).
        """
        deadline = self.timeout_s if timeout is DEFAULT else timeout
        try:
            response = getattr(shard.stub, method)(
                request, timeout=deadline, metadata=self.metadata
            )
        except grpc.RpcError as err:
            self.note_failure(shard, err, doing or method)
            raise from_rpc_error(err, shard.address) from err
        self.note_up(shard)
        return response

    def note_failure(self, shard: ShardHandle, err: grpc.RpcError, method: str) -> None:
        if is_connect_failure(err):
            self.note_down(shard, from_rpc_error(err, shard.address), method)

    def note_down(self, shard: ShardHandle, error: MillpondError, method: str = "Sample") -> None:
        """Mark ``shard`` down, found so by a ``method`` call (the warning names it)."""
        if shard.resolve() == "moved":  # restarted elsewhere: the next call dials it
            return
        if shard.gone:
            return
        if shard.mark_down():
            if method == "Sample":
                logger.warning(
                    "shard %s is unavailable (%s); sampling continues from the other shards, "
                    "and it is tried again every few seconds",
                    shard.address,
                    error,
                )
            else:  # info, a table's creation...: no sampling to go on
                logger.warning(
                    "shard %s did not answer %s (%s); it is marked unavailable and tried "
                    "again every few seconds",
                    shard.address,
                    method,
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
