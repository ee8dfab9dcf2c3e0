"""Service benchmark: millpond over gRPC vs TorchRL's RayReplayBuffer vs a raw gRPC ceiling.

Everything runs on this machine, over loopback, in one run and on the same pre-generated
experience (P env lanes collected in chunks of T steps, cut into segments at episode ends and
chunk ends by :func:`millpond.segmenting.cut_batch`, as an actor does):

* ``millpond``: real ``millpond serve`` processes (``--shards 1`` and ``--shards 2``) and a
  :class:`~millpond.ReplayClient` in this process. Inserts go through ``client.writer(...)``
  writers, each owning whole env lanes (as an actor does) and driven by its own thread: one
  writer per shard, and a few per shard. Samples: ``client.sample(table, 256)`` (uniform
  table) and ``client.iterate(table, 256, prefetch=4)``.
* ``torchrl-ray``: TorchRL's ``RayReplayBuffer`` (a ``ReplayBuffer`` in a Ray actor) over a
  ``LazyMemmapStorage`` in TED layout (``("next", "observation")`` stored), ``RandomSampler``;
  each chunk is one ``extend`` of ``P*T`` transitions; ``sample()`` of 256.
* ``raw-grpc``: the ceiling. A trivial gRPC server (generic handlers, identity serializers, no
  proto, started from this file as its own process) with a stream-unary ``Sink`` that drops
  what it receives and a unary-stream ``Source``. The client streams exactly the bytes
  millpond's insert puts on the wire, in messages of the same sizes (one per segment, as the
  writer sends them when segments are large), on as many streams and servers; and reads
  messages of a sample response's size, one call per batch.

for two step shapes (CartPole-like: float32[4] observations; Atari-like: uint8[4, 84, 84]).

Metrics: insert transitions/s and MB/s (payload bytes on the wire per second: serialized
``InsertRequest`` segments for millpond, the TED chunk's tensor bytes for TorchRL), insert as
a share of the raw ceiling, ``sample(256)`` transitions/s with p50/p99 latency per call, and
``iterate(prefetch=4)`` transitions/s with p50/p99 of the learner's wait per batch. Every
system is started first; each insert repetition and each sampling repetition then runs every
system in turn, so that the slow phases of a shared machine fall on all of them alike, and
the report gives the medians and, for the targets, the ratios of repetitions run side by side.
Every process keeps freed message-sized buffers for reuse
(:func:`millpond.allocator.keep_freed_buffers`, what millpond's own processes do), the raw
ceiling's too.

Run ``python benchmarks/service.py`` (about 4 minutes on 2 cores; see ``--help``), or
``--quick`` for a small smoke run (< 90 s).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _common import (
    OBS,
    ServerProcess,
    add_common_args,
    calibrate,
    code_version,
    collector_batch,
    cpu_split,
    emit_report,
    episode_layout,
    load_average,
    log,
    millpond_serve,
    quiet_torchrl,
    scratch_root,
    settle,
    status,
    ted_chunk,
)
from tensordict import TensorDict

from millpond.allocator import keep_freed_buffers

SYSTEMS = ("raw-grpc", "millpond", "torchrl-ray")
BATCH = 256
PREFETCH = 4
MiB = 1024 * 1024
MESSAGE_MB = 256  # message size limit of every channel and server (millpond's default)
# Ceiling server: the generic service and its two methods.
RAW_SERVICE = "millpondbench.Raw"
RAW_SINK = f"/{RAW_SERVICE}/Sink"
RAW_SOURCE = f"/{RAW_SERVICE}/Source"
# Targets from the issue.
TARGET_CEILING = 0.60  # Atari-shaped insert MB/s, share of the raw gRPC ceiling
TARGET_INSERT = 1.5  # CartPole-shaped insert transitions/s, vs RayReplayBuffer
TARGET_SAMPLE = 3.0  # CartPole-shaped sample(256) transitions/s, vs RayReplayBuffer


# -- configuration ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    obs_shape: tuple[int, ...]
    obs_dtype: torch.dtype
    episode_len: tuple[int, int]  # uniform in [lo, hi]
    lanes: int  # P: env lanes per chunk
    chunk_len: int  # T: steps per lane per chunk (the longest segment)
    steps: int  # transitions per insert pass
    quick_steps: int


SHAPES = {
    "cartpole": Shape("cartpole", (4,), torch.float32, (20, 200), 8, 128, 131_072, 16_384),
    "atari": Shape("atari", (4, 84, 84), torch.uint8, (100, 1000), 4, 128, 8_192, 1_024),
}


@dataclasses.dataclass
class Settings:
    shards: list[int]
    writers: list[int]  # writers per shard (millpond) / concurrent callers (TorchRL, raw)
    insert_reps: int  # timed insert passes after the warm-up pass
    sample_reps: int
    sample_rep_seconds: float
    quick: bool
    write: str = "segments"  # millpond writers: "segments" (one call each), "chunks", "packed"


# -- data ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Seg:
    """One segment as an actor sends it (the tensors are views into the workload's arrays)."""

    lane: int
    steps: TensorDict  # [L]: observation, action; next: reward, terminated, truncated
    tail: TensorDict  # []: the observation after the last step
    episode: int  # episode number within the workload (an id offset is added per pass)
    first_step: int
    length: int
    wire: int  # bytes of this segment in a serialized InsertRequest
    chunk: int = 0  # the chunk it was cut from


@dataclasses.dataclass
class Workload:
    shape: Shape
    num_steps: int
    segments: list[Seg]  # chunk after chunk, lane after lane
    ted_chunks: list[TensorDict]  # [P*T] TED chunks (next observation stored), for TorchRL
    ted_bytes: int  # tensor bytes of all TED chunks
    num_episodes: int

    @property
    def wire_bytes(self) -> int:
        return sum(s.wire for s in self.segments)


def make_workload(shape: Shape, steps: int, seed: int = 0) -> Workload:
    """P lanes of episodes (random lengths) in chunks of T steps, cut into segments."""
    from millpond.protos import millpond_pb2 as pb
    from millpond.protos.codec import to_tensor_map
    from millpond.segmenting import cut_batch
    from millpond.segments import Segment, pack

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    P, T = shape.lanes, shape.chunk_len
    n_chunks = max(1, -(-steps // (P * T)))
    S = n_chunks * T

    def rand_obs(*lead: int) -> torch.Tensor:
        size = (*lead, *shape.obs_shape)
        if shape.obs_dtype.is_floating_point:
            return torch.randn(size, generator=gen, dtype=shape.obs_dtype)
        return torch.randint(0, 256, size, generator=gen, dtype=shape.obs_dtype)

    # Per lane: a stream of S + 1 observations; next_obs[t] = obs[t + 1] inside an episode
    # and a fresh final observation where the episode ends (the next one starts at t + 1).
    obs = rand_obs(P, S + 1)
    next_obs = obs[:, 1:].clone()
    obs = obs[:, :S]
    eps = episode_layout(rng, P, S, shape.episode_len)
    episode, step_idx, term, trunc = eps.episode, eps.step, eps.terminated, eps.truncated
    n_episodes = len(eps.lengths)
    ends = torch.from_numpy(np.argwhere(term | trunc))
    if len(ends):
        next_obs[ends[:, 0], ends[:, 1]] = rand_obs(len(ends))
    action = torch.from_numpy(rng.integers(0, 18, size=(P, S)))
    reward = torch.from_numpy(rng.standard_normal((P, S, 1)).astype(np.float32))
    term_t = torch.from_numpy(term).unsqueeze(-1)
    trunc_t = torch.from_numpy(trunc).unsqueeze(-1)

    wire_of: dict[int, int] = {}

    def wire(steps_td: TensorDict, tail_td: TensorDict, length: int) -> int:
        """Bytes of the segment in a serialized InsertRequest (as the writer encodes it)."""
        if length not in wire_of:
            packed = pack([Segment(steps_td, tail_td, 0, 0)])
            msg = pb.Segment(
                sequence=1_000_000,
                episode_id=2**40,
                first_step=1000,
                steps=to_tensor_map(packed.steps, batch_size=[length]),
                tail=to_tensor_map({k: v[0] for k, v in packed.tails.items()}, batch_size=[]),
            )
            wire_of[length] = pb.InsertRequest(segments=[msg]).ByteSize()
        return wire_of[length]

    segments: list[Seg] = []
    ted_chunks: list[TensorDict] = []
    for c in range(n_chunks):
        a0, b0 = c * T, (c + 1) * T
        # Contiguous, so that the segments and the TED chunk are views of the same copy.
        batch = collector_batch(
            obs[:, a0:b0],
            next_obs[:, a0:b0],
            action[:, a0:b0],
            reward[:, a0:b0],
            term_t[:, a0:b0],
            trunc_t[:, a0:b0],
            torch.from_numpy(episode[:, a0:b0]),
            torch.from_numpy(step_idx[:, a0:b0]),
        ).contiguous()
        start = 0  # row of the segment's first step in the lane-major chunk
        for seg in cut_batch(batch):
            length = seg.steps.batch_size[0]
            segments.append(
                Seg(
                    start // T,
                    seg.steps,
                    seg.tail,
                    seg.episode_id,
                    seg.first_step,
                    length,
                    wire(seg.steps, seg.tail, length),
                    c,
                )
            )
            start += length
        ted_chunks.append(ted_chunk(batch))
    ted_bytes = sum(
        t.numel() * t.element_size()
        for td in ted_chunks
        for t in td.values(include_nested=True, leaves_only=True)
    )
    return Workload(shape, n_chunks * P * T, segments, ted_chunks, ted_bytes, n_episodes)


# -- processes -------------------------------------------------------------------------------
def raw_serve(root: Path, index: int) -> ServerProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-server"]
    return ServerProcess(cmd, root / f"raw-{index}.log", f"raw gRPC server {index}")


# -- the raw gRPC ceiling ----------------------------------------------------------------------
def _identity(b: bytes) -> bytes:
    return b


def _channel_options() -> list[tuple[str, int]]:
    size = MESSAGE_MB * MiB
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def run_raw_server() -> int:
    """``--raw-server``: serve Sink (stream-unary) and Source (unary-stream) until SIGTERM."""
    import grpc

    payloads: dict[int, bytes] = {}

    def sink(request_iterator, context) -> bytes:
        n = 0
        for message in request_iterator:
            n += len(message)
        return n.to_bytes(8, "little")

    def source(request: bytes, context):
        size = int.from_bytes(request[:8], "little")
        count = int.from_bytes(request[8:16], "little")
        payload = payloads.get(size)
        if payload is None:
            payload = payloads[size] = bytes(size)
        for _ in range(count):
            yield payload

    handler = grpc.method_handlers_generic_handler(
        RAW_SERVICE,
        {
            "Sink": grpc.stream_unary_rpc_method_handler(
                sink, request_deserializer=_identity, response_serializer=_identity
            ),
            "Source": grpc.unary_stream_rpc_method_handler(
                source, request_deserializer=_identity, response_serializer=_identity
            ),
        },
    )
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=_channel_options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ADDRESSES 127.0.0.1:{port}", flush=True)
    stop.wait()
    server.stop(1).wait()
    return 0


class RawClient:
    """Streams bytes to / reads bytes from the ceiling servers."""

    def __init__(self, addresses: Sequence[str]) -> None:
        import grpc

        self.channels = [grpc.insecure_channel(a, options=_channel_options()) for a in addresses]
        self.sinks = [
            ch.stream_unary(RAW_SINK, request_serializer=_identity, response_deserializer=_identity)
            for ch in self.channels
        ]
        self.sources = [
            ch.unary_stream(
                RAW_SOURCE, request_serializer=_identity, response_deserializer=_identity
            )
            for ch in self.channels
        ]
        self.pool = ThreadPoolExecutor(max_workers=8)
        self._payloads: dict[int, bytes] = {}

    def payload(self, size: int) -> bytes:
        if size not in self._payloads:
            self._payloads[size] = bytes(size)
        return self._payloads[size]

    def stream(self, server: int, sizes: list[int]) -> None:
        """One client stream of messages of ``sizes`` bytes to ``server``."""
        expected = sum(sizes)
        got = int.from_bytes(self.sinks[server](self.payload(n) for n in sizes), "little")
        if got != expected:
            raise AssertionError(f"the sink received {got} bytes, expected {expected}")

    def fetch(self, sizes: list[int]) -> None:
        """One batch: one call per server (``sizes[i]`` bytes from server i), in parallel."""

        def one(i: int) -> None:
            request = sizes[i].to_bytes(8, "little") + (1).to_bytes(8, "little")
            for message in self.sources[i](request):
                if len(message) != sizes[i]:
                    raise AssertionError("short message from the source")

        if len(sizes) == 1:
            one(0)
        else:
            for f in [self.pool.submit(one, i) for i in range(len(sizes))]:
                f.result()

    def close(self) -> None:
        self.pool.shutdown()
        for ch in self.channels:
            ch.close()


# -- measurement -----------------------------------------------------------------------------
def run_parallel(jobs: list[Callable[[], None]]) -> float:
    """Run ``jobs`` in one thread each, started together; returns the wall time."""
    if len(jobs) == 1:
        t0 = time.perf_counter()
        jobs[0]()
        return time.perf_counter() - t0
    barrier = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []

    def wrap(job: Callable[[], None]) -> None:
        barrier.wait()
        try:
            job()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


def lanes_of(n_lanes: int, n_streams: int) -> list[list[int]]:
    """Lanes owned by each of ``n_streams`` writers (round-robin: balanced when it divides)."""
    return [[p for p in range(n_lanes) if p % n_streams == k] for k in range(n_streams)]


class Sampler:
    """One way of drawing batches of ``BATCH``, timed call by call.

    ``call`` (a function) or ``iterator`` (a factory of iterators, one opened per
    repetition and closed after it; its first ``PREFETCH`` batches are drawn before the
    clock starts, so that a repetition measures the steady state with ``PREFETCH`` requests
    in flight).
    """

    def __init__(
        self,
        key: str,
        call: Callable[[], object] | None = None,
        iterator: Callable[[], object] | None = None,
    ) -> None:
        self.key = key  # "sample" or "iterate"
        self.call = call
        self.iterator = iterator
        self.n = 0
        self.rates: list[float] = []
        self.latencies: list[float] = []

    def calibrate(self, rep_seconds: float) -> None:
        if self.call is not None:
            self.n = calibrate(self.call, rep_seconds)
            return
        it = self.iterator()  # type: ignore[misc]
        try:
            self.n = calibrate(lambda: next(it), rep_seconds, at_least=4 * PREFETCH)  # type: ignore[call-overload]
        finally:
            it.close()  # type: ignore[attr-defined]

    def rep(self) -> float:
        it = None
        if self.call is not None:
            fn = self.call
        else:
            it = self.iterator()  # type: ignore[misc]
            for _ in range(PREFETCH):
                next(it)  # type: ignore[call-overload]
            fn = functools.partial(next, it)
        try:
            t_rep = time.perf_counter()
            for _ in range(self.n):
                t0 = time.perf_counter()
                fn()
                self.latencies.append(time.perf_counter() - t0)
            self.rates.append(BATCH * self.n / (time.perf_counter() - t_rep))
        finally:
            if it is not None:
                it.close()  # type: ignore[attr-defined]
        return self.rates[-1]

    def summary(self) -> dict[str, object]:
        p50, p99 = np.percentile(np.array(self.latencies) * 1e3, [50, 99])
        k = self.key
        return {
            f"{k}_tps": statistics.median(self.rates),
            f"{k}_p50": p50,
            f"{k}_p99": p99,
            f"{k}_rates": list(self.rates),
        }


class Runner:
    """One system under test, with its insert configurations (writer / caller / stream counts)."""

    system: str
    shards: int
    label: str

    def __init__(self, streams: list[int]) -> None:
        self.streams = streams
        self.times: dict[int, list[float]] = {n: [] for n in streams}
        # CPU seconds of each timed pass: this (the writers') process, the server processes.
        self.cpu: dict[int, list[tuple[float, float]]] = {n: [] for n in streams}
        self.first_fill_tps: float | None = None
        self.samplers_made: list[Sampler] = []

    def setup(self, wl: Workload) -> None:
        """Prepare for ``wl`` (tables, writers, buffers)."""

    def insert(self, streams: int) -> float:
        """One insert pass of the workload with ``streams`` writers; returns its wall time."""
        raise NotImplementedError

    def server_pids(self) -> list[int]:
        """The processes serving this system (their CPU time is the server's share)."""
        return []

    def timed_insert(self, streams: int) -> float:
        """:meth:`insert`, its CPU time kept (writers' process, servers); returns its wall time."""
        pids = self.server_pids()
        before = cpu_split(pids)
        dt = self.insert(streams)
        after = cpu_split(pids)
        self.cpu[streams].append((after[0] - before[0], after[1] - before[1]))
        return dt

    def first_fill(self) -> None:
        dt = self.insert(self.streams[0])
        self.first_fill_tps = self.wl.num_steps / dt
        log(
            f"[{self.wl.shape.name}] {self.label}: first fill (warm-up) "
            f"{self.wl.num_steps / dt:,.0f} transitions/s, {self.payload / dt / 1e6:,.0f} MB/s"
        )

    @property
    def payload(self) -> int:
        """Bytes one insert pass moves (for MB/s)."""
        return self.wl.wire_bytes

    def samplers(self) -> list[Sampler]:
        return []

    def teardown(self) -> None:
        pass

    def results(self) -> list[dict]:
        out = []
        extra: dict[str, object] = {}
        for sampler in self.samplers_made:
            extra.update(sampler.summary())
        for n in self.streams:
            dt = statistics.median(self.times[n])
            r = {
                "system": self.system,
                "shape": self.wl.shape.name,
                "shards": self.shards,
                "streams": n,
                "num_steps": self.wl.num_steps,
                "insert_tps": self.wl.num_steps / dt,
                "insert_mbps": self.payload / dt / 1e6,
                "insert_rates": [self.wl.num_steps / t for t in self.times[n]],
                **extra,
            }
            if self.cpu[n] and self.server_pids():
                mb = self.payload / 1e6
                r["insert_cpu_ms_per_mb"] = tuple(
                    statistics.median(c[i] for c in self.cpu[n]) / mb * 1e3 for i in (0, 1)
                )
            if n == self.streams[0] and self.first_fill_tps is not None:
                r["first_fill_tps"] = self.first_fill_tps
            out.append(r)
        return out

    wl: Workload


# -- raw gRPC ------------------------------------------------------------------------------------
class RawRunner(Runner):
    """The ceiling: the same bytes in messages of the same sizes, on as many streams/servers."""

    system = "raw-grpc"

    def __init__(
        self, client: RawClient, shards: int, writers: list[int], pids: Sequence[int] = ()
    ) -> None:
        super().__init__([shards * w for w in writers])
        self.pids = list(pids)
        self.client = client
        self.shards = shards
        self.label = f"raw gRPC, {shards} server(s)"
        self.response_bytes = 0  # of one millpond sample response, for the same shards

    def setup(self, wl: Workload) -> None:
        self.wl = wl
        self.jobs: dict[int, list[Callable[[], None]]] = {}
        for n in self.streams:
            lanes = lanes_of(wl.shape.lanes, n)
            # Stream k goes to server k % shards, as writer k is pinned to shard k % shards.
            sizes = [[g.wire for g in wl.segments if g.lane in set(lanes[k])] for k in range(n)]
            self.jobs[n] = [
                functools.partial(self.client.stream, k % self.shards, sizes[k]) for k in range(n)
            ]

    def insert(self, streams: int) -> float:
        return run_parallel(self.jobs[streams])

    def server_pids(self) -> list[int]:
        return self.pids

    def first_fill(self) -> None:
        self.insert(self.streams[0])  # warm-up: connections, allocator

    def samplers(self) -> list[Sampler]:
        per = [self.response_bytes // self.shards] * self.shards
        self.samplers_made = [Sampler("sample", functools.partial(self.client.fetch, per))]
        return self.samplers_made


# -- millpond --------------------------------------------------------------------------------
def pinned_writer_ids(prefix: str, shards: int, count: int) -> list[str]:
    """``count`` writer ids, the k-th pinned to shard ``k % shards``."""
    from millpond.routing import writer_hash

    ids = []
    for k in range(count):
        i = 0
        while writer_hash(f"{prefix}-{k}-{i}") % shards != k % shards:
            i += 1
        ids.append(f"{prefix}-{k}-{i}")
    return ids


class MillpondRunner(Runner):
    """``millpond serve --shards N`` and a ReplayClient; writers each own whole env lanes."""

    system = "millpond"

    def __init__(
        self, server: ServerProcess, shards: int, writers: list[int], write: str = "segments"
    ) -> None:
        from millpond import ReplayClient

        super().__init__([shards * w for w in writers])
        self.write = write
        self.server = server
        self.shards = shards
        self.label = f"millpond, {shards} shard(s)"
        # The wire, as a learner on another host samples: the same host would read the
        # rows from the table's files (colocated sampling; benchmarks/colocated_sample.py).
        self.client = ReplayClient(server.addresses, timeout_s=300, colocated=False)
        self.passes = 0

    def setup(self, wl: Workload) -> None:
        from millpond import TableConfig

        self.wl = wl
        self.table = wl.shape.name
        slots = wl.num_steps + len(wl.segments)
        # Each shard's ring holds its share of one pass (plus slack): the timed passes
        # overwrite it, the steady state of a full replay table.
        capacity = -(-slots // self.shards) + 2 * (wl.shape.chunk_len + 1)
        self.client.create_table(TableConfig.uniform(self.table, capacity))
        self.writers: dict[int, list] = {}
        for n in self.streams:
            ids = pinned_writer_ids(f"bench-{self.table}-{self.shards}x{n}", self.shards, n)
            self.writers[n] = [self.client.writer(self.table, i) for i in ids]
            assert [w.shard_index for w in self.writers[n]] == [k % self.shards for k in range(n)]

    def insert(self, streams: int) -> float:
        """Every segment once, writer k writing its lanes' segments in its own thread; flushed.

        Each pass gets fresh episode ids, as new experience would.
        """
        wl, off = self.wl, self.passes * self.wl.num_episodes
        self.passes += 1

        def job(writer, mine: set[int]) -> None:
            if self.write == "packed":  # as an env actor does: a chunk's columns as they are
                for packed in self.packed[id(writer)]:
                    writer.write_packed(
                        dataclasses.replace(packed, episode_ids=packed.episode_ids + off)
                    )
            elif self.write == "chunks":  # one write_segments call per chunk
                for group in self._chunks(mine, off):
                    writer.write_segments(group)
            else:
                for g in wl.segments:
                    if g.lane in mine:
                        writer.write_segment(g.steps, g.tail, off + g.episode, g.first_step)
            writer.flush(300)

        lanes = lanes_of(wl.shape.lanes, streams)
        writers = self.writers[streams]
        if self.write == "packed":
            self._pack_chunks(writers, lanes)
        return run_parallel([functools.partial(job, w, set(ls)) for w, ls in zip(writers, lanes)])

    def server_pids(self) -> list[int]:
        return [self.server.proc.pid]

    def _pack_chunks(self, writers: list, lanes: list[list[int]]) -> None:
        """Each writer's chunks as the columns an env actor hands its writer
        (:func:`millpond.segmenting.pack_batch`: one contiguous block per chunk), built
        once, before any pass is timed."""
        from millpond.segments import pack

        self.packed = getattr(self, "packed", {})
        for writer, mine in zip(writers, lanes):
            if id(writer) not in self.packed:
                self.packed[id(writer)] = [pack(group) for group in self._chunks(set(mine), 0)]

    def _chunks(self, lanes: set[int], episode_offset: int) -> list[list]:
        """The segments of ``lanes``, chunk by chunk, episode ids moved by ``episode_offset``."""
        from millpond.segments import Segment

        chunks: dict[int, list[Segment]] = {}
        for g in self.wl.segments:
            if g.lane in lanes:
                seg = Segment(g.steps, g.tail, episode_offset + g.episode, g.first_step)
                chunks.setdefault(g.chunk, []).append(seg)
        return list(chunks.values())

    def sample_bytes(self) -> int:
        """The bytes of one sample response (a batch of 256 split over the shards)."""
        import grpc

        from millpond.protos import millpond_pb2 as pb
        from millpond.protos import millpond_pb2_grpc as pb_grpc

        total = 0
        for address in self.server.addresses:
            with grpc.insecure_channel(address, options=_channel_options()) as ch:
                request = pb.SampleRequest(
                    table=self.table, batch_size=BATCH // self.shards, num_batches=1
                )
                total += sum(m.ByteSize() for m in pb_grpc.ReplayStub(ch).Sample(request))
        return total

    def check(self) -> None:
        info = self.client.info(self.table)
        if info["inserts"] != self.passes * self.wl.num_steps:
            raise AssertionError(
                f"{self.label}: the shards counted {info['inserts']} inserted steps, "
                f"expected {self.passes * self.wl.num_steps}"
            )

    def samplers(self) -> list[Sampler]:
        c, t = self.client, self.table
        self.samplers_made = [
            Sampler("sample", lambda: c.sample(t, BATCH)),
            Sampler("iterate", iterator=lambda: c.iterate(t, BATCH, prefetch=PREFETCH)),
        ]
        return self.samplers_made

    def teardown(self) -> None:
        for writers in self.writers.values():
            for w in writers:
                w.close(60)

    def close(self) -> None:
        self.client.close()


# -- TorchRL ---------------------------------------------------------------------------------
class TorchRLRunner(Runner):
    """``RayReplayBuffer`` over ``LazyMemmapStorage`` (TED, next observation stored)."""

    system = "torchrl-ray"
    shards = 1
    label = "torchrl-ray"

    def __init__(self, root: Path, callers: list[int]) -> None:
        super().__init__(callers)
        self.root = root

    def setup(self, wl: Workload) -> None:
        from torchrl.data import LazyMemmapStorage, RandomSampler, RayReplayBuffer

        self.wl = wl
        self.scratch = self.root / f"torchrl-{wl.shape.name}"
        self.scratch.mkdir()
        t0 = time.perf_counter()
        self.rb = RayReplayBuffer(
            storage=functools.partial(
                LazyMemmapStorage, wl.num_steps, scratch_dir=str(self.scratch)
            ),
            sampler=RandomSampler,
            batch_size=BATCH,
            remote_config={"num_cpus": 1},
        )
        len(self.rb)  # the actor process has started (not part of the first fill)
        log(f"[{wl.shape.name}] torchrl-ray: actor ready ({time.perf_counter() - t0:.1f} s)")

    @property
    def payload(self) -> int:
        return self.wl.ted_bytes

    def insert(self, streams: int) -> float:
        """Every TED chunk once (one ``extend`` each), dealt round-robin to the callers."""
        rb, chunks = self.rb, self.wl.ted_chunks

        def job(k: int) -> None:
            for c in range(k, len(chunks), streams):
                rb.extend(chunks[c])

        return run_parallel([functools.partial(job, k) for k in range(streams)])

    def check(self) -> None:
        if len(self.rb) != self.wl.num_steps:
            raise AssertionError(
                f"torchrl holds {len(self.rb)} steps, expected {self.wl.num_steps}"
            )
        batch = self.rb.sample()
        if ("next", OBS) not in batch.keys(True) or batch.batch_size[0] != BATCH:
            raise AssertionError("RayReplayBuffer.sample() returned an unexpected batch")

    def samplers(self) -> list[Sampler]:
        self.samplers_made = [Sampler("sample", self.rb.sample)]
        return self.samplers_made

    def teardown(self) -> None:
        self.rb.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def run_shape(wl: Workload, runners: list[Runner], s: Settings) -> list[dict]:
    """Insert passes, then samples, with the repetitions alternating between the systems.

    Alternating keeps the slow phases of a shared machine from landing on one system only.
    """
    name = wl.shape.name
    done: list[Runner] = []
    try:
        for r in runners:
            r.setup(wl)
            done.append(r)
        for r in runners:
            settle()
            r.first_fill()
        for rep in range(s.insert_reps):
            line = []
            for r in runners:
                for n in r.streams:
                    settle()
                    dt = r.timed_insert(n)
                    r.times[n].append(dt)
                    line.append(f"{r.label} x{n} {wl.num_steps / dt:,.0f}")
            log(f"[{name}] insert rep {rep + 1}/{s.insert_reps}: " + " | ".join(line) + " tr/s")
        for r in runners:
            if isinstance(r, MillpondRunner | TorchRLRunner):
                r.check()
        sizes = {r.shards: r.sample_bytes() for r in runners if isinstance(r, MillpondRunner)}
        for r in runners:
            if isinstance(r, RawRunner):
                r.response_bytes = sizes.get(r.shards, 0)
        settle()
        samplers = [
            (f"{r.label} {sp.key}", sp)
            for r in runners
            if not (isinstance(r, RawRunner) and not r.response_bytes)
            for sp in r.samplers()
        ]
        for _, sp in samplers:
            sp.calibrate(s.sample_rep_seconds)
        for rep in range(s.sample_reps):
            line = [f"{label} {sp.rep():,.0f}" for label, sp in samplers]
            log(f"[{name}] sample({BATCH}) rep {rep + 1}/{s.sample_reps}: " + " | ".join(line))
        return [row for r in runners for row in r.results()]
    finally:
        for r in done:
            r.teardown()


# -- report ----------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def render(
    results: list[dict],
    workloads: dict[str, Workload],
    s: Settings,
    argv: list[str],
    load: tuple[tuple[float, ...], tuple[float, ...]],
    seconds: float,
) -> str:
    import grpc
    import ray
    import torchrl

    lines = []
    cpu = platform.processor() or platform.machine()
    lines.append(
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, grpcio {grpc.__version__}, torchrl {torchrl.__version__}, "
        f"ray {ray.__version__}; everything on loopback. {load_average(load)}."
        f" Run took {seconds:.0f} s. GLIBC_TUNABLES: {os.environ.get('GLIBC_TUNABLES') or 'unset'}."
    )
    lines.append("")
    lines.append(
        f"millpond code: {code_version(['service', 'learner', 'protos', 'millpond'])}. "
        f"millpond writers: {s.write} (`--write`)."
    )
    lines.append("")
    for name, wl in workloads.items():
        sizes = [g.wire for g in wl.segments]
        lines.append(
            f"- {name}: {wl.num_steps:,} transitions per insert pass, {wl.shape.lanes} lanes x "
            f"{wl.shape.chunk_len} steps per chunk, {len(wl.segments):,} segments "
            f"(mean {wl.num_steps / len(wl.segments):.1f} steps, "
            f"{statistics.mean(sizes) / 1024:,.1f} KiB on the wire); "
            f"{wl.wire_bytes / wl.num_steps:,.1f} wire bytes per transition for millpond, "
            f"{wl.ted_bytes / wl.num_steps:,.1f} TED bytes per transition for TorchRL."
        )
    lines.append("")
    lines.append(
        "| shape | system | shards | writers | insert tr/s | insert MB/s | vs raw ceiling "
        "| insert CPU ms/MB, writers / server "
        "| sample(256) tr/s | sample p50 / p99 ms | iterate tr/s | iterate p50 / p99 ms |"
    )
    lines.append("|" + "---|" * 12)
    raw = {(r["shape"], r["shards"], r["streams"]): r for r in results if r["system"] == "raw-grpc"}
    for shape in workloads:
        for r in results:
            if r["shape"] != shape:
                continue
            ceiling = raw.get((shape, r["shards"], r["streams"]))
            vs = (
                f"{r['insert_mbps'] / ceiling['insert_mbps']:.0%}"
                if ceiling and r["system"] == "millpond"
                else ("100%" if r["system"] == "raw-grpc" else "-")
            )
            system = {"raw-grpc": "raw gRPC (ceiling)"}.get(r["system"], r["system"])
            it = (
                f"{_f(r.get('iterate_p50'), '.1f')} / {_f(r.get('iterate_p99'), '.1f')}"
                if "iterate_p50" in r
                else "-"
            )
            cpu = r.get("insert_cpu_ms_per_mb")
            cpu_text = f"{cpu[0]:.2f} / {cpu[1]:.2f}" if cpu else "-"
            lines.append(
                f"| {shape} | {system} | {r['shards']} | {r['streams']} "
                f"| {_f(r.get('insert_tps'))} | {_f(r.get('insert_mbps'), ',.1f')} | {vs} "
                f"| {cpu_text} | {_f(r.get('sample_tps'))} "
                f"| {_f(r.get('sample_p50'), '.1f')} / {_f(r.get('sample_p99'), '.1f')} "
                f"| {_f(r.get('iterate_tps'))} | {it} |"
            )
    lines.append("")
    lines.append(
        "Writers: millpond writers (one thread each, each owning whole env lanes) in all; "
        "for TorchRL the number of threads calling `extend`; for the ceiling, client streams. "
        "Insert CPU: the median pass's CPU time per MB moved, of this process (the writers) "
        "and of the server processes (TorchRL's run in Ray: not counted). "
        "The raw ceiling's sample columns read one message per call of the size of millpond's "
        "sample response (split over the servers), not a sample. TorchRL has no iterate."
    )
    firsts = [r for r in results if "first_fill_tps" in r]
    if firsts:
        lines.append("")
        lines.append(
            "First fill (warm-up pass, not in the table), transitions/s: "
            + "; ".join(
                f"{r['shape']} / {r['system']}"
                + (f" {r['shards']} shard(s)" if r["system"] == "millpond" else "")
                + f" {r['first_fill_tps']:,.0f}"
                for r in firsts
            )
        )
    lines.append("")
    lines += targets(results)
    lines.append("")
    lines.append("Command: `python " + " ".join(["benchmarks/service.py", *argv]) + "`")
    return "\n".join(lines) + "\n"


def targets(results: list[dict]) -> list[str]:
    def pick(system: str, shape: str, shards: int | None = None, streams: int | None = None):
        return [
            r
            for r in results
            if r["system"] == system
            and r["shape"] == shape
            and (shards is None or r["shards"] == shards)
            and (streams is None or r["streams"] == streams)
        ]

    def per_rep(a: list[float], b: list[float]) -> str:
        """Median and range of the ratios of repetitions run side by side."""
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        return (
            f"per-repetition median {statistics.median(ratios):.2f}x "
            f"(range {min(ratios):.2f}-{max(ratios):.2f}x)"
        )

    out = ["Targets:", ""]
    mp = pick("millpond", "atari")
    if mp and pick("raw-grpc", "atari"):
        parts = []
        best = 0.0
        for r in mp:
            c = pick("raw-grpc", "atari", r["shards"], r["streams"])
            if not c:
                continue
            share = r["insert_mbps"] / c[0]["insert_mbps"]
            best = max(best, share)
            ratios = [x / y for x, y in zip(r["insert_rates"], c[0]["insert_rates"], strict=True)]
            parts.append(
                f"{r['shards']} shard(s) x {r['streams']} writer(s) {share:.0%} "
                f"({r['insert_mbps']:,.0f} of {c[0]['insert_mbps']:,.0f} MB/s; per repetition "
                f"{statistics.median(ratios):.0%}, range {min(ratios):.0%}-{max(ratios):.0%})"
            )
        out.append(
            f"- Atari-shaped insert >= {TARGET_CEILING:.0%} of the raw gRPC ceiling (same shards "
            f"and streams; best configuration): {status(best >= TARGET_CEILING)} — "
            + "; ".join(parts)
            + "."
        )
    mp = pick("millpond", "cartpole")
    tr = pick("torchrl-ray", "cartpole")
    if mp and tr:
        best_mp = max(mp, key=lambda r: r["insert_tps"])
        best_tr = max(tr, key=lambda r: r["insert_tps"])
        one_mp = pick("millpond", "cartpole", 1, 1)
        one_tr = pick("torchrl-ray", "cartpole", 1, 1)
        ratio = best_mp["insert_tps"] / best_tr["insert_tps"]
        text = (
            f"- CartPole-shaped insert >= {TARGET_INSERT}x RayReplayBuffer: {status(ratio >= TARGET_INSERT)}"
            f" — best vs best {ratio:.2f}x ({best_mp['insert_tps']:,.0f} tr/s with "
            f"{best_mp['shards']} shard(s) x {best_mp['streams']} writer(s) vs "
            f"{best_tr['insert_tps']:,.0f} with {best_tr['streams']} caller(s))"
        )
        if one_mp and one_tr:
            text += (
                f"; one writer vs one caller "
                f"{one_mp[0]['insert_tps'] / one_tr[0]['insert_tps']:.2f}x, "
                + per_rep(one_mp[0]["insert_rates"], one_tr[0]["insert_rates"])
            )
        out.append(text + ".")
        best_s = max(mp, key=lambda r: r["sample_tps"])
        one = pick("millpond", "cartpole", 1)
        ratio = best_s["sample_tps"] / tr[0]["sample_tps"]
        text = (
            f"- CartPole-shaped sample(256) >= {TARGET_SAMPLE}x RayReplayBuffer: "
            f"{status(ratio >= TARGET_SAMPLE)} — {ratio:.2f}x with {best_s['shards']} shard(s) "
            f"({best_s['sample_tps']:,.0f} vs {tr[0]['sample_tps']:,.0f} tr/s; "
            + per_rep(best_s["sample_rates"], tr[0]["sample_rates"])
            + ")"
        )
        if one and one[0] is not best_s and one[0]["shards"] != best_s["shards"]:
            text += f"; 1 shard {one[0]['sample_tps'] / tr[0]['sample_tps']:.2f}x"
        it = max(mp, key=lambda r: r.get("iterate_tps", 0))
        if "iterate_tps" in it:
            text += (
                f"; iterate(prefetch={PREFETCH}) {it['iterate_tps'] / tr[0]['sample_tps']:.2f}x "
                f"({it['shards']} shard(s); "
                + per_rep(it["iterate_rates"], tr[0]["sample_rates"])
                + ")"
            )
        out.append(text + ".")
    return out


def run_all(
    root: Path, workloads: dict[str, Workload], systems: list[str], s: Settings
) -> list[dict]:
    """Start every system's processes, then measure shape after shape, systems side by side."""
    results: list[dict] = []
    with contextlib.ExitStack() as stack:
        raw_client = None
        if "raw-grpc" in systems:
            servers = [stack.enter_context(raw_serve(root, i)) for i in range(max(s.shards))]
            raw_client = RawClient([a for p in servers for a in p.addresses])
            stack.callback(raw_client.close)
        mp_servers = {}
        if "millpond" in systems:
            for shards in s.shards:
                mp_servers[shards] = stack.enter_context(millpond_serve(root, shards))
        if "torchrl-ray" in systems:
            import ray

            t0 = time.perf_counter()
            for attempt in (1, 2):
                try:
                    ray.init(
                        num_cpus=2,
                        include_dashboard=False,
                        log_to_driver=False,
                        logging_level=logging.WARNING,
                    )
                    break
                except Exception as e:  # a node that timed out starting on a busy machine
                    ray.shutdown()
                    if attempt == 2:
                        raise
                    log(f"ray: {e}; trying once more")
            stack.callback(ray.shutdown)
            log(f"ray: started ({time.perf_counter() - t0:.1f} s)")
        for wl in workloads.values():
            runners: list[Runner] = []
            if raw_client is not None:
                runners += [
                    RawRunner(raw_client, n, s.writers, [p.proc.pid for p in servers[:n]])
                    for n in s.shards
                ]
            for shards, server in mp_servers.items():
                runners.append(MillpondRunner(server, shards, s.writers, s.write))
                stack.callback(runners[-1].close)
            if "torchrl-ray" in systems:
                runners.append(TorchRLRunner(root, s.writers))
            results += run_shape(wl, runners, s)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "small smoke run (< 90 s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--shards", default="1,2", help="millpond shard counts (default 1,2)")
    ap.add_argument(
        "--writers",
        default=None,
        help="writers per shard (millpond), extend threads (TorchRL), streams per server "
        "(ceiling); comma-separated (default 1,2; quick 1)",
    )
    ap.add_argument(
        "--reps", type=int, help="timed repetitions (default: 5 insert / 5 sample; quick 1 / 2)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in this (client) process (default 1)",
    )
    ap.add_argument(
        "--write",
        choices=("segments", "chunks", "packed"),
        default="segments",
        help="millpond writers call write_segment per segment (default), write_segments "
        "per chunk (its segments concatenated into columns), or write_packed per chunk with "
        "the columns built beforehand, as env actors hand them over (pack_batch)",
    )
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # As millpond's own processes do (its shards call it too): on both sides of the
    # ceiling alike, the raw server's process included.
    keep_freed_buffers()
    if args.raw_server:
        return run_raw_server()
    shapes = [SHAPES[x] for x in args.shapes.split(",") if x]
    systems = [x for x in args.systems.split(",") if x]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    quick = args.quick
    s = Settings(
        shards=[int(x) for x in args.shards.split(",") if x],
        writers=[int(x) for x in (args.writers or ("1" if quick else "1,2")).split(",") if x],
        insert_reps=args.reps or (1 if quick else 5),
        sample_reps=args.reps or (2 if quick else 5),
        sample_rep_seconds=0.2 if quick else 0.5,
        quick=quick,
        write=args.write,
    )
    quiet_torchrl()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with scratch_root(args.dir, "millpond-svc-bench-") as root:
        workloads = {}
        for shape in shapes:
            t1 = time.perf_counter()
            wl = make_workload(shape, shape.quick_steps if quick else shape.steps)
            workloads[shape.name] = wl
            log(
                f"[{shape.name}] {wl.num_steps:,} transitions, {len(wl.segments):,} segments, "
                f"{wl.wire_bytes / 1e6:,.1f} MB on the wire per pass "
                f"({time.perf_counter() - t1:.1f} s)"
            )
        results = run_all(root, workloads, systems, s)
    order = {name: i for i, name in enumerate(SYSTEMS)}
    shape_order = {shape.name: i for i, shape in enumerate(shapes)}
    results.sort(
        key=lambda r: (shape_order[r["shape"]], order[r["system"]], r["shards"], r["streams"])
    )
    report = render(
        results, workloads, s, argv, (load_before, os.getloadavg()), time.perf_counter() - t0
    )
    emit_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
