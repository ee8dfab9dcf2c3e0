"""Batches sampled forever with requests kept in flight: what :meth:`ReplayClient.iterate`
yields.

A client with one shard streams (:meth:`SplitSampler.stream`): ``prefetch`` batches per
call, one call after another, its large batches received (or read from the table's files on
this host) one batch ahead on a thread of its own (:data:`READ_AHEAD_BYTES`), small ones
when they are asked for. With several shards, batches come from a pool of ``prefetch``
threads, each asking for the next batch as one is handed out. A queue table is asked one
batch at a time on one thread, so that batches keep the queue's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from tensordict import TensorDict

from millpond.learner.client._calls import CallSet
from millpond.learner.client._masses import ShardMasses
from millpond.learner.client._read_ahead import read_ahead
from millpond.learner.client._shards import ShardSet
from millpond.learner.client._split import SplitSampler
from millpond.spec import TableSpec

#: Batches of at least this many bytes are received or read one ahead, on a thread of their
#: own: their transfer, or their gather from the memory map, lets go of the GIL for long
#: enough to overlap the learner's update. Smaller ones are read when asked for: the hand-over between two threads
#: (and their turns at the GIL) would cost more than the read it hides (a CartPole batch of
#: 128 steps, ~6 KB: ~0.1-0.3 ms of CPU a batch more with the thread, of a ~2 ms DQN step).
READ_AHEAD_BYTES = 1 << 20


def iterate(
    shards: ShardSet,
    masses: ShardMasses,
    sampler: SplitSampler,
    table: str,
    batch_size: int,
    prefetch: int,
    timeout: float | None,
) -> Iterator[TensorDict]:
    """Batches of ``table`` in order, ``prefetch`` requests in flight; closing the generator
    cancels what is in flight and joins its threads."""
    config = masses.configs.get(table)
    if config is None or config.spec is None:  # the keys too: they size its batches
        masses.refresh(table, [s for s in shards.shards if not s.down])
        config = masses.configs.get(table)
    in_order = config is not None and config.sampler == "queue"
    calls = CallSet()
    streamed = None if in_order else sampler.stream(table, batch_size, prefetch, timeout, calls)
    if streamed is not None:
        spec = config.spec if config is not None else None
        if spec is not None and batch_bytes(spec, batch_size) < READ_AHEAD_BYTES:
            try:
                yield from streamed
            finally:
                calls.cancel()
        else:  # large batches, or a table whose keys are not known yet
            yield from read_ahead(streamed, calls.cancel, "millpond-read-ahead")
        return
    pool = ThreadPoolExecutor(
        max_workers=1 if in_order else prefetch, thread_name_prefix="millpond-prefetch"
    )
    pending: deque[Future[TensorDict]] = deque()

    def request() -> None:
        pending.append(pool.submit(sampler.sample, table, batch_size, timeout, calls))

    try:
        for _ in range(prefetch):
            request()
        while True:
            batch = pending.popleft().result()
            request()
            yield batch
    finally:
        calls.cancel()
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)


def batch_bytes(spec: TableSpec, batch_size: int) -> int:
    """Bytes of a batch of ``batch_size`` steps of ``spec`` (next observations included)."""
    return batch_size * (spec.slot_bytes + spec.observation_bytes)
