"""Mass-proportional splitting: one sample batch asked from several shards and merged.

:func:`split_batch` divides a batch among shards in proportion to their sampleable masses,
so the merged batch draws every stored step as one table holding everything would.
:class:`SplitSampler` does that for a table: it splits by the masses the client knows
(:mod:`millpond.learner.client._masses`), asks the live shards in parallel, re-asks a shard's share
from the others when it goes down meanwhile, and concatenates the parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.errors import (
    DeadlineExceededError,
    RateLimiterTimeoutError,
    ShardBusyError,
)
from millpond.learner.client._calls import CallSet, Cancelled
from millpond.learner.client._channels import TLS
from millpond.learner.client._colocated import Colocation
from millpond.learner.client._errors import (
    ShardUnavailableError,
    from_rpc_error,
    is_connect_failure,
    is_own_deadline,
)
from millpond.learner.client._masses import ShardMasses
from millpond.learner.client._shard_calls import (
    BUSY_BACKOFF_INITIAL_S,
    BUSY_BACKOFF_MAX_S,
    ShardCalls,
    ShardDown,
    from_shard,
    while_busy,
)
from millpond.learner.client._shards import ShardHandle, ShardSet
from millpond.protos import millpond_pb2 as pb
from millpond.protos import wire
from millpond.protos.samples import decode_sample

#: Extra seconds a colocated stream's gRPC deadline allows beyond the waits the server is
#: asked to honour.
DEADLINE_SLACK_S = 10.0
#: Samplers whose rows are drawn independently, with replacement: one batch of ``k * n``
#: rows is ``k`` batches of ``n``. (A queue hands out each step once, in order.)
JOINED_SAMPLERS = ("uniform", "prioritized", "slices", "prioritized_slices")

#: Batches of at least this many bytes are received or read one ahead, on a thread of
#: their own, each batch of a call apart: their transfer, or their gather from the memory
#: map, lets go of the GIL for long enough to overlap the learner's update. Smaller ones
#: are read when asked for, a colocated call's batches drawn and read as one: the hand-over
#: between two threads (and their turns at the GIL) would cost more than the read it hides
#: (a CartPole batch of 128 steps, ~6 KB: ~0.1-0.3 ms of CPU a batch more with the thread,
#: of a ~2 ms DQN step).
READ_AHEAD_BYTES = 1 << 20


def joined_batches(config: TableConfig | None, batch_size: int, prefetch: int) -> bool:
    """Whether a colocated stream draws its ``prefetch`` batches as one: for tables that
    draw each row on its own (uniform, prioritized, their slices), where the rows of all of
    them fit the table (a larger batch is refused), more than one is asked at a time, and
    a batch is small (:func:`small_batches`). Large batches are read one at a time, one
    ahead: read together, the learner would wait for all of them at once, then for none."""
    if config is None or prefetch < 2 or config.sampler not in JOINED_SAMPLERS:
        return False
    if not small_batches(config, batch_size):
        return False
    return batch_size * prefetch * (config.slice_len or 1) <= config.capacity


def small_batches(config: TableConfig | None, batch_size: int) -> bool:
    """Whether batches of ``batch_size`` steps of the table take under
    :data:`READ_AHEAD_BYTES`, next observations included (``False`` while its keys are
    not known)."""
    if config is None or config.spec is None:
        return False
    spec = config.spec
    return batch_size * (spec.slot_bytes + spec.observation_bytes) < READ_AHEAD_BYTES


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


class SplitSampler(ShardCalls):
    """Samples a table across the shards of ``shards``, split by the masses in ``masses``."""

    def __init__(
        self,
        shards: ShardSet,
        masses: ShardMasses,
        colocated: bool | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLS = None,
    ) -> None:
        """``colocated``: see :class:`Colocation`; ``options`` and ``tls``: those of the
        client's channels, for the colocated calls' own."""
        self._set = shards
        self._masses = masses
        self._colocation = Colocation(colocated, masses, options, tls)
        self._rng = np.random.default_rng()

    def sample(
        self, table: str, batch_size: int, timeout: float | None, parent: CallSet | None
    ) -> TensorDict:
        """A batch split across the live shards by mass, asked in parallel, merged.

        A shard found down meanwhile is skipped (its share asked from the others); waits up
        to ``timeout`` seconds in all. Raises :class:`Cancelled` if ``parent`` is cancelled.
        A queue table whose shards answered in part before one timed out gives the steps
        received (fewer than ``batch_size``): they left their shards' queues for good.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = CallSet(parent)
        parts: dict[int, list[TensorDict]] = {}
        try:
            self._masses.refresh_stale(table)
            remaining = int(batch_size)
            while remaining > 0:
                plan = self._allocate(table, remaining, deadline, timeout, calls)
                wait = None if deadline is None else max(0.001, deadline - time.monotonic())
                # One shard's part is asked on this thread: a hop through the pool costs
                # more than a colocated batch's own RPC on a busy host.
                start = self._inline if len(plan) == 1 else self._set.submit
                futures = [
                    (shard, n, start(self._sample_shard, shard, table, n, wait, calls))
                    for shard, n in plan
                ]
                remaining = 0
                error: BaseException | None = None
                for shard, n, future in futures:
                    try:
                        part = future.result()
                        parts.setdefault(shard.index, []).append(part)
                    except ShardDown:
                        remaining += n  # asked again from the shards still up
                    except BaseException as e:
                        if error is None or isinstance(error, Cancelled):
                            error = e
                        calls.cancel()
                if error is not None:
                    if parts and isinstance(error, RateLimiterTimeoutError) and self._queue(table):
                        # The steps the other shards delivered are gone from their queues:
                        # a short batch (queue batches hold at most B) rather than lose them.
                        break
                    raise error
        finally:
            calls.release()
        batches = [td for index in sorted(parts) for td in parts[index]]
        return batches[0] if len(batches) == 1 else torch.cat(batches, dim=0)

    def stream(
        self, table: str, batch_size: int, prefetch: int, timeout: float | None, calls: CallSet
    ) -> Iterator[TensorDict] | None:
        """Batches of a table held by this client's only shard, asked ``prefetch`` at a
        time in one call (what a prefetching iterator keeps in flight, without a call per
        batch), the next call asked for as the last batch of one arrives (of a joined
        draw, below, as its batches are handed out); ``None`` where the client has several
        shards (then :meth:`sample` serves).

        On the wire, the batches of a call come one after another on its stream, and the
        next call opens once the last of them has arrived: one answer transfers at a time,
        so they arrive evenly spaced (calls in flight together interleave their answers on
        the connection and land in bursts, each learner's wait short or a whole burst long).

        Read from the table's files on this host (colocated), where the ``prefetch`` batches
        fit the table together (:func:`joined_batches`), they are drawn as one batch of
        ``prefetch * batch_size`` rows, read and decoded once, and handed out in
        ``batch_size`` parts: a uniform or prioritized table draws every row independently
        (importance weights over the table's largest, not the batch's), so the parts are
        what ``prefetch`` separate draws would be, at about a third of the client's CPU per
        batch. The rate limiter then counts the rows of a call at once."""
        shards = self._set.shards
        if len(shards) != 1 or shards[0].down:
            return None
        shard = shards[0]
        if not self._masses.known(shard, table):
            self._masses.refresh(table, [shard])
        if not self._colocation.wanted(shard, table):
            return self._stream(shard, table, batch_size, prefetch, timeout, calls, on_wire=True)
        joined = joined_batches(self._masses.configs.get(table), batch_size, prefetch)
        return self._stream(shard, table, batch_size, prefetch, timeout, calls, joined)

    def _stream(
        self,
        shard: ShardHandle,
        table: str,
        n: int,
        prefetch: int,
        timeout: float | None,
        calls: CallSet,
        joined: bool = False,
        on_wire: bool = False,
    ) -> Iterator[TensorDict]:
        backoff = BUSY_BACKOFF_INITIAL_S
        # Each batch may wait ``timeout`` for the rate limiter; the call, for all of them.
        deadline = None if timeout is None else prefetch * timeout + DEADLINE_SLACK_S
        request = pb.SampleRequest(
            table=table,
            batch_size=n * prefetch if joined else n,
            num_batches=1 if joined else prefetch,
            timeout_ms=0 if timeout is None else max(1, int(timeout * 1000)),
            colocated=not on_wire,
        )
        responses = 1 if joined else prefetch
        # Answers on the wire come as bytes, parsed below (observations stay views of them).
        stub = shard.raw_sample if on_wire else self._colocation.stub(shard).Sample

        def open_call() -> Any:
            call = stub(request, timeout=deadline, metadata=self._set.metadata)
            return call if calls.add(call) else None

        try:
            call = open_call()
            while call is not None:
                upcoming = None
                received = 0
                try:
                    for response in call:
                        received += 1
                        if received == responses and not joined:
                            # The next call is asked for while this one's last batch is read:
                            # the shard samples meanwhile, not after.
                            upcoming = open_call()
                        if isinstance(response, bytes):
                            response = wire.parse_sample_response(response)
                        self._masses.set_mass(shard, table, response.mass)
                        late = None
                        if response.HasField("colocated_rows"):
                            try:
                                td, late = self._read_colocated(
                                    shard, table, response, timeout, calls, defer=joined
                                )
                            except ShardDown as down:  # its error, not the internal signal
                                raise down.error from down
                        else:
                            td = from_shard(decode_sample(response), shard)
                        if not joined:
                            yield td
                            continue
                        # The next call is asked for now: the shard draws it while this
                        # one's parts are trained on (asked for with the last part, its
                        # answer came a step late: a small batch is read in microseconds).
                        upcoming = open_call()
                        for i, part in enumerate(td.split(n)):
                            if late is not None and (i + 1) * n > late.first:
                                try:
                                    late.fill()  # the part holds late rows: written in now
                                except ShardDown as down:
                                    raise down.error from down
                                late = None
                            yield part
                except grpc.RpcError as err:
                    if calls.cancelled:
                        return
                    if on_wire and deadline is not None and is_own_deadline(err):
                        late = self._late(shard, table, n * prefetch, deadline)
                        raise DeadlineExceededError(late) from err
                    error = from_rpc_error(err, shard.address)
                    if is_connect_failure(err):
                        self._set.note_down(shard, error)
                    if isinstance(error, ShardBusyError) and not received:
                        time.sleep(backoff)  # refused at once: asked again, as sample does
                        backoff = min(BUSY_BACKOFF_MAX_S, backoff * 2)
                        call = open_call()
                        continue
                    raise error from err
                finally:
                    call.cancel()  # the iterator closed mid-call: the shard stops sampling
                    calls.discard(call)
                self._set.note_up(shard)
                backoff = BUSY_BACKOFF_INITIAL_S
                call = upcoming if upcoming is not None else open_call()
        finally:
            calls.cancel()  # the upcoming call too

    def _queue(self, table: str) -> bool:
        config = self._masses.configs.get(table)
        return config is not None and config.sampler == "queue"

    @staticmethod
    def _inline(fn: Callable[..., TensorDict], *args: Any) -> Future[TensorDict]:
        """``fn(*args)`` run now, as a finished future (what the pool's ``submit`` returns)."""
        future: Future[TensorDict] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # raised again by result(), as from the pool
            future.set_exception(e)
        return future

    def close(self) -> None:
        """Release the colocated readers and their channels."""
        self._colocation.close()

    def colocated_shards(self, table: str) -> list[int]:
        """Shards whose ``table`` is read from its files here (a reader is open)."""
        return self._colocation.read_shards(table)

    def _sample_shard(
        self, shard: ShardHandle, table: str, n: int, wait: float | None, calls: CallSet
    ) -> TensorDict:
        """One shard's part; a shard busy with streams is asked again, with backoff, while
        the wait lasts (it refuses at once, to keep threads for probes)."""
        return while_busy(lambda w: self._sample_once(shard, table, n, w, calls), wait)

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
            shards = self._set.shards
            live = [s for s in shards if not s.down]
            if not live:  # ask them all now rather than wait for their retry time
                self._masses.refresh(table, shards)
                live = [s for s in shards if not s.down]
                if not live:
                    raise ShardUnavailableError(
                        f"sample {table!r}: all {len(shards)} shards are unavailable "
                        f"({', '.join(s.address for s in shards)})"
                    )
            unknown = [s for s in live if not self._masses.known(s, table)]
            if unknown:
                self._masses.refresh(table, unknown)
                continue
            masses = [self._masses.get(s, table) for s in live]
            if len(live) == 1 and masses[0] > 0:  # what split_batch gives, without its cost
                return [(live[0], n)]
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
            self._masses.refresh(table, live)
            refreshed = True
