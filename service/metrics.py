"""A shard's Prometheus metrics (``millpond serve --metrics-port P``).

Two kinds, in one registry per shard server (several shards may share a process):

* what the tables already count — steps inserted, sampled and evicted, size, capacity,
  achieved samples per insert, callers the rate limiter holds back, queue depth, bytes on
  disk — read from the tables when Prometheus scrapes (:class:`_TableCollector`), so the
  insert and sample paths pay nothing for them;
* what only the RPC edge sees — sample latency and batch sizes, bytes on the wire, errors
  by status code — recorded by the servicer as calls go (:class:`ServiceMetrics`).

Names follow Prometheus conventions (``millpond_<what>_<unit>``, ``_total`` for
counters); every table metric has a ``table`` label. docs/observability.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Sample latency buckets, seconds: a CartPole batch takes ~1 ms, an Atari batch tens.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
#: Batch size buckets, steps.
BATCH_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384)


class ServiceMetrics:
    """The metrics of one shard server, in a registry of their own (:attr:`registry`).

    Args:
        tables: returns the shard's open tables by name, each with ``metrics()`` (see
            :meth:`millpond.service.table.Table.metrics`); read at every scrape.
    """

    def __init__(self, tables: Callable[[], Mapping[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_TableCollector(tables))
        self.sample_seconds = Histogram(
            "millpond_sample_latency_seconds",
            "Time the shard takes to draw, read and encode one sampled batch "
            "(rate-limiter waits included).",
            ["table"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_steps = Histogram(
            "millpond_sample_batch_steps",
            "Steps per sampled batch.",
            ["table"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.wire_bytes = Counter(
            "millpond_wire_bytes",
            "Bytes of insert requests received and sample responses sent.",
            ["method", "direction"],
            registry=self.registry,
        )
        self.wire_messages = Counter(
            "millpond_wire_messages",
            "Insert requests received and sample responses sent (with the bytes: their mean size).",
            ["method", "direction"],
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "millpond_rpc_errors",
            "Calls answered with an error, by method and gRPC status code (waits that ran "
            "out and calls their clients cancelled are not errors).",
            ["method", "code"],
            registry=self.registry,
        )
        self.rate_limiter_timeouts = Counter(
            "millpond_rate_limiter_timeouts",
            "Calls answered DEADLINE_EXCEEDED because the rate limiter (or a queue short of "
            "steps) held them back for the whole timeout their client gave.",
            ["method"],
            registry=self.registry,
        )

    def sampled(self, table: str, seconds: float, steps: int, nbytes: int) -> None:
        """One sampled batch sent."""
        self.sample_seconds.labels(table).observe(seconds)
        self.batch_steps.labels(table).observe(steps)
        self.wire_bytes.labels("Sample", "out").inc(nbytes)
        self.wire_messages.labels("Sample", "out").inc()

    def received(self, method: str, nbytes: int) -> None:
        """One request of ``nbytes`` received."""
        self.wire_bytes.labels(method, "in").inc(nbytes)
        self.wire_messages.labels(method, "in").inc()

    def error(self, method: str, code: str) -> None:
        """One call answered with an error."""
        self.rpc_errors.labels(method, code).inc()

    def timed_out(self, method: str) -> None:
        """One call held back by the rate limiter until its timeout ran out."""
        self.rate_limiter_timeouts.labels(method).inc()


_C, _G = CounterMetricFamily, GaugeMetricFamily
#: (kind, name, the key of ``Table.metrics()``, help): one series per table of each.
_TABLE_METRICS = (
    (_C, "millpond_inserted_steps", "inserted", "Steps inserted."),
    (_C, "millpond_sampled_steps", "sampled", "Steps sampled, as the rate limiter counts them."),
    (_C, "millpond_evicted_steps", "evicted", "Steps dropped to make room, or found damaged."),
    (_G, "millpond_table_size_steps", "size", "Steps that can be sampled now."),
    (_G, "millpond_table_capacity_slots", "capacity", "Slots of the table's ring."),
    (_G, "millpond_samples_per_insert", "samples_per_insert", "Sampled per inserted step."),
    (
        _G,
        "millpond_samples_per_insert_target",
        "samples_per_insert_target",
        "The configured samples per insert (NaN: none).",
    ),
    (
        _G,
        "millpond_blocked_writers",
        "blocked_inserts",
        "Inserts the table holds back now (rate limiter, full queue).",
    ),
    (
        _G,
        "millpond_blocked_samplers",
        "blocked_samples",
        "Samples the table holds back now (rate limiter, too few steps).",
    ),
    (_G, "millpond_queue_depth_steps", "queue_depth", "Steps waiting in a queue table."),
    (_G, "millpond_disk_bytes", "bytes_on_disk", "Bytes the table's files occupy on disk."),
    (_C, "millpond_dropped_segments", "dropped_segments", "Segments dropped as damaged."),
    (
        _G,
        "millpond_unverified_segments",
        "unverified_segments",
        "Segments of a reopened table whose checksums are not checked yet.",
    ),
)


class _TableCollector(Collector):
    """The tables' own counts, read when Prometheus scrapes."""

    def __init__(self, tables: Callable[[], Mapping[str, Any]]) -> None:
        self._tables = tables

    def describe(self) -> list[Metric]:
        return []  # the series come and go with the tables: nothing to declare up front

    def collect(self) -> Iterator[Metric]:
        snapshots = [(name, table.metrics()) for name, table in sorted(self._tables().items())]
        for kind, name, key, doc in _TABLE_METRICS:
            family = kind(name, doc, labels=["table"])
            for table, values in snapshots:
                family.add_metric([table], values[key])
            yield family
