"""Admission of long-lived streams, so that a shard full of writers still answers probes.

gRPC's Python server runs every call on one thread pool of ``max_workers`` threads, and a
stream holds its thread for as long as it is open: an Insert stream as long as its writer
keeps writing (a writer idle for ``IDLE_STREAM_S`` ends it). Without a bound, ``max_workers`` writers take every thread, and health checks, Info
and learners' Sample calls wait in the queue behind them; an orchestrator then restarts a
shard that is only busy. :class:`AdmissionInterceptor` keeps threads back:

- Insert streams take at most ``max_workers - reserve`` threads;
- all streams together (Insert, Sample, GetWeights, PublishWeights, health Watch), and
  PublishWeightsAtOnce (unary, but it may wait for the actors as long as PublishWeights),
  take at most ``max_workers - 1``, so a unary call (health Check, Info, UpdatePriorities)
  always finds a thread.

A stream beyond its bound is refused at once with RESOURCE_EXHAUSTED and the class
:class:`~millpond.errors.ShardBusyError`, which a writer retries with backoff (and a
learner's Sample while its wait lasts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from millpond.errors import ShardBusyError
from millpond.protos.status import ERROR_KEY, status_of

log = logging.getLogger("millpond.server")

_INSERT = "/millpond.v1.Replay/Insert"
#: Unary calls that may hold their thread as long as a stream does.
_WAITING_UNARY = frozenset({"/millpond.v1.Replay/PublishWeightsAtOnce"})
_LOG_EVERY_S = 10.0


def reserve_for(max_workers: int) -> int:
    """Threads kept from Insert streams: an eighth of the pool, at least 2."""
    return max(2, max_workers // 8)


class _Gate:
    """A count of admitted calls with a limit; never blocks."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.admitted = 0
        self.refused = 0
        self.logged_at = -float("inf")
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self.admitted >= self.limit:
                return False
            self.admitted += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.admitted -= 1


class AdmissionInterceptor(grpc.ServerInterceptor):
    """Bounds concurrent streams (see the module docstring) for a pool of ``max_workers``."""

    def __init__(self, max_workers: int, reserve: int | None = None) -> None:
        reserve = reserve_for(max_workers) if reserve is None else reserve
        self.streams = _Gate("streams", max(1, max_workers - 1))
        self.inserts = _Gate(
            "Insert streams", max(1, min(self.streams.limit, max_workers - reserve))
        )

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        streaming = handler.request_streaming or handler.response_streaming
        if not streaming and handler_call_details.method not in _WAITING_UNARY:
            return handler
        gates = [self.streams]
        if handler_call_details.method == _INSERT:
            gates.append(self.inserts)
        return _admitted(handler, gates)


def _admitted(handler: grpc.RpcMethodHandler, gates: list[_Gate]) -> grpc.RpcMethodHandler:
    """``handler`` whose behavior first takes a place in every gate, or refuses the call.

    The place is taken in the pool thread (where the behavior runs), not here: a call
    cancelled before a thread picks it up never runs its behavior and so never leaves.
    """
    if handler.request_streaming and handler.response_streaming:
        behavior, wrap = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, wrap = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, wrap = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, wrap = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    def admitted(request, context):
        taken: list[_Gate] = []
        for gate in gates:
            if not gate.enter():
                for t in taken:
                    t.leave()
                _refuse(context, gate)
            taken.append(gate)
        left = threading.Event()

        def leave() -> None:
            if not left.is_set():
                left.set()
                for t in taken:
                    t.leave()

        # Called once the call ends, however it ends (finished, failed, cancelled).
        if not context.add_callback(leave):
            leave()
        try:
            return behavior(request, context)
        except BaseException:
            leave()
            raise

    return wrap(admitted, handler.request_deserializer, handler.response_serializer)


def _refuse(context: grpc.ServicerContext, gate: _Gate) -> None:
    error = ShardBusyError(
        f"shard busy: {gate.admitted} {gate.name} open, the most this shard serves at once "
        "(raise --max-workers, or add shards); retry with backoff"
    )
    code, details, name = status_of(error)
    gate.refused += 1
    now = time.monotonic()
    if now - gate.logged_at >= _LOG_EVERY_S:  # writers retry: one line per burst, not per try
        gate.logged_at = now
        log.warning("refusing streams (%d so far): %s", gate.refused, details)
    if name is not None:
        context.set_trailing_metadata(((ERROR_KEY, name),))
    context.abort(code, details)
