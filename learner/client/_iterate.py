"""Batches sampled forever with requests kept in flight: what :meth:`ReplayClient.iterate`
yields.

A client with one shard streams (:meth:`SplitSampler.stream`): ``prefetch`` batches per
call, one call after another, its large batches (:func:`~._split.small_batches`) received,
or read from the table's files on this host, one batch ahead on a thread of its own, small
ones when they are asked for. With several shards, batches come from a pool of ``prefetch``
threads, each asking for the next batch as one is handed out. A queue table is asked one
batch at a time on one thread, so that batches keep the queue's order. Over a table that
holds nothing yet (a learner started beside its actors), the first batch is sampled on its
own: the batches' bytes, which choose among these, are known once it has arrived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.learner.client._calls import CallSet
from millpond.learner.client._masses import ShardMasses
from millpond.learner.client._read_ahead import read_ahead
from millpond.learner.client._shards import ShardSet
from millpond.learner.client._split import SplitSampler, small_batches


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

    def refreshed() -> TableConfig | None:
        masses.refresh(table, [s for s in shards.shards if not s.down])
        return masses.configs.get(table)

    config = masses.configs.get(table)
    if config is None or config.spec is None:  # the keys too: they size its batches
        config = refreshed()
    in_order = config is not None and config.sampler == "queue"
    calls = CallSet()
    first = None
    if config is not None and config.spec is None and not in_order:
        # Nothing stored yet, so the batches' bytes, which choose how they are drawn (joined
        # or not, read ahead or when asked for), are unknown: a learner started with its
        # actors would otherwise draw the slow way for good. The first batch is sampled on
        # its own (it waits for the table to fill); once it is here, the keys are known.
        first = sampler.sample(table, batch_size, timeout, calls)
        config = refreshed()
    streamed = None if in_order else sampler.stream(table, batch_size, prefetch, timeout, calls)
    if first is not None:
        yield first
    if streamed is not None:
        if small_batches(config, batch_size):
            try:
                yield from streamed
            finally:
                calls.cancel()
        else:  # large batches, or a table whose config the shards did not give
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
