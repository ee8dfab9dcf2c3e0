"""Service benchmark: millpond over gRPC vs TorchRL's RayReplayBuffer vs a raw gRPC ceiling.

Everything runs on this machine, over loopback, in one run and on the same pre-generated
experience (P env lanes collected in chunks of T steps, cut into segments at episode ends and
chunk ends, as an actor does):

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
``iterate(prefetch=4)`` transitions/s with p50/p99 of the learner's wait per batch.

Run ``python benchmarks/service.py`` (about 6 minutes on 2 cores; see ``--help``), or
``--quick`` for a small smoke run (< 90 s).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

SYSTEMS = ("raw-grpc", "millpond", "torchrl-ray")
OBS = "observation"
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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    from millpond.service.segments import Segment, pack

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
    term = np.zeros((P, S), dtype=bool)
    trunc = np.zeros((P, S), dtype=bool)
    episode = np.zeros((P, S), dtype=np.int64)
    step_idx = np.zeros((P, S), dtype=np.int64)
    lo, hi = shape.episode_len
    n_episodes = 0
    for p in range(P):
        t = 0
        while t < S:
            length = int(rng.integers(lo, hi + 1))
            n = min(length, S - t)
            episode[p, t : t + n] = n_episodes
            step_idx[p, t : t + n] = np.arange(n)
            if n == length:
                (trunc if rng.random() < 0.2 else term)[p, t + n - 1] = True
            n_episodes += 1
            t += n
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
    false = torch.zeros(P * T, 1, dtype=torch.bool)
    for c in range(n_chunks):
        a0, b0 = c * T, (c + 1) * T
        for p in range(P):
            cuts = (np.flatnonzero((term | trunc)[p, a0:b0]) + a0).tolist()
            if not cuts or cuts[-1] != b0 - 1:
                cuts.append(b0 - 1)
            a = a0
            for e in cuts:
                b = e + 1
                steps_td = TensorDict(
                    {
                        OBS: obs[p, a:b],
                        "action": action[p, a:b],
                        "next": {
                            "reward": reward[p, a:b],
                            "terminated": term_t[p, a:b],
                            "truncated": trunc_t[p, a:b],
                        },
                    },
                    batch_size=[b - a],
                )
                tail_td = TensorDict({OBS: next_obs[p, e]}, batch_size=[])
                segments.append(
                    Seg(
                        p,
                        steps_td,
                        tail_td,
                        int(episode[p, a]),
                        int(step_idx[p, a]),
                        b - a,
                        wire(steps_td, tail_td, b - a),
                    )
                )
                a = b
        done_c = (term_t | trunc_t)[:, a0:b0].reshape(-1, 1)
        ted_chunks.append(
            TensorDict(
                {
                    OBS: obs[:, a0:b0].reshape(P * T, *shape.obs_shape),
                    "action": action[:, a0:b0].reshape(-1),
                    "done": false,
                    "terminated": false,
                    "truncated": false,
                    "next": {
                        OBS: next_obs[:, a0:b0].reshape(P * T, *shape.obs_shape),
                        "reward": reward[:, a0:b0].reshape(-1, 1),
                        "done": done_c,
                        "terminated": term_t[:, a0:b0].reshape(-1, 1),
                        "truncated": trunc_t[:, a0:b0].reshape(-1, 1),
                    },
                    "collector": {"traj_ids": torch.from_numpy(episode[:, a0:b0].reshape(-1))},
                },
                batch_size=[P * T],
            )
        )
    ted_bytes = sum(
        t.numel() * t.element_size()
        for td in ted_chunks
        for t in td.values(include_nested=True, leaves_only=True)
    )
    return Workload(shape, n_chunks * P * T, segments, ted_chunks, ted_bytes, n_episodes)


# -- processes -------------------------------------------------------------------------------
class Process:
    """A server subprocess that prints ``ADDRESSES a,b`` once serving; SIGTERM stops it."""

    def __init__(self, cmd: list[str], log_path: Path, label: str) -> None:
        self.label = label
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True
        )
        assert self.proc.stdout is not None
        self.addresses: list[str] = []
        for line in self.proc.stdout:
            if line.startswith("ADDRESSES "):
                self.addresses = line.split()[1].split(",")
                break
        if not self.addresses:
            code = self.proc.wait()
            self._log.close()
            raise RuntimeError(f"{label} exited ({code}) before serving:\n{self.tail()}")
        # Keep reading stdout so that a chatty child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        log(f"{label}: serving {','.join(self.addresses)} ({time.perf_counter() - t0:.1f} s)")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            if code != 0:
                log(f"{self.label}: exited with code {code}:\n{self.tail()}")
        self._log.close()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def millpond_serve(root: Path, shards: int) -> Process:
    d = root / f"serve-{shards}"
    cmd = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(d), "--port", "0"]
    cmd += ["--shards", str(shards)]
    return Process(cmd, root / f"serve-{shards}.log", f"millpond serve --shards {shards}")


def raw_serve(root: Path, index: int) -> Process:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-server"]
    return Process(cmd, root / f"raw-{index}.log", f"raw gRPC server {index}")


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
def settle() -> None:
    """Write dirty pages back so that one measurement's writeback does not slow the next."""
    gc.collect()
    os.sync()


def calibrate(fn: Callable[[], object], rep_seconds: float, at_least: int = 3) -> int:
    """Warm ``fn`` up and return how many calls make one repetition of ~``rep_seconds``."""
    t0 = time.perf_counter()
    n = 0
    while n < at_least or time.perf_counter() - t0 < min(0.3, rep_seconds):
        fn()
        n += 1
    per_call = (time.perf_counter() - t0) / n
    return max(at_least, int(rep_seconds / per_call))


def timed_calls(
    label: str, fn: Callable[[], object], items: int, s: Settings
) -> tuple[float, float, float]:
    """(median items/s over repetitions, p50 ms, p99 ms of single calls)."""
    calls = calibrate(fn, s.sample_rep_seconds)
    rates: list[float] = []
    lat: list[float] = []
    for rep in range(s.sample_reps):
        t_rep = time.perf_counter()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t0)
        rates.append(items * calls / (time.perf_counter() - t_rep))
        log(f"{label} rep {rep + 1}/{s.sample_reps}: {rates[-1]:,.0f} transitions/s")
    p50, p99 = np.percentile(np.array(lat) * 1e3, [50, 99])
    return statistics.median(rates), float(p50), float(p99)


def timed_iterate(
    label: str, make_iter: Callable[[], object], items: int, s: Settings
) -> tuple[float, float, float]:
    """Like :func:`timed_calls` for an iterator: the wait for each ``next`` is one latency.

    A repetition takes at least ``4 * PREFETCH`` batches, so that the batches already in
    flight when it starts do not inflate its rate.
    """
    it = make_iter()
    try:
        calls = calibrate(
            lambda: next(it),  # type: ignore[call-overload]
            s.sample_rep_seconds,
            at_least=4 * PREFETCH,
        )
        rates: list[float] = []
        lat: list[float] = []
        for rep in range(s.sample_reps):
            t_rep = time.perf_counter()
            for _ in range(calls):
                t0 = time.perf_counter()
                next(it)  # type: ignore[call-overload]
                lat.append(time.perf_counter() - t0)
            rates.append(items * calls / (time.perf_counter() - t_rep))
            log(f"{label} rep {rep + 1}/{s.sample_reps}: {rates[-1]:,.0f} transitions/s")
    finally:
        it.close()  # type: ignore[attr-defined]
    p50, p99 = np.percentile(np.array(lat) * 1e3, [50, 99])
    return statistics.median(rates), float(p50), float(p99)


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


def new_result(system: str, shape: str, shards: int, streams: int, wl: Workload) -> dict:
    return {
        "system": system,
        "shape": shape,
        "shards": shards,
        "streams": streams,
        "num_steps": wl.num_steps,
    }


# -- raw gRPC ------------------------------------------------------------------------------------
def bench_raw(
    root: Path,
    workloads: dict[str, Workload],
    sample_bytes: dict[tuple[str, int], int],
    s: Settings,
) -> list[dict]:
    out: list[dict] = []
    servers: list[Process] = []
    try:
        for i in range(max(s.shards)):
            servers.append(raw_serve(root, i))
        client = RawClient([a for p in servers for a in p.addresses])
        try:
            for name, wl in workloads.items():
                for shards in s.shards:
                    configs = []
                    for w in s.writers:
                        n = shards * w
                        lanes = lanes_of(wl.shape.lanes, n)
                        # Stream k goes to server k % shards (as writer k is pinned to a shard).
                        per_stream = [
                            [g.wire for g in wl.segments if g.lane in set(lanes[k])]
                            for k in range(n)
                        ]
                        jobs = [
                            functools.partial(client.stream, k % shards, per_stream[k])
                            for k in range(n)
                        ]
                        r = new_result("raw-grpc", name, shards, n, wl)
                        r["times"] = []
                        configs.append((r, jobs))
                    run_parallel(configs[0][1])  # warm-up: connections, allocator
                    for rep in range(s.insert_reps):
                        for r, jobs in configs:
                            dt = run_parallel(jobs)
                            r["times"].append(dt)
                            log(
                                f"[{name}] raw gRPC sink, {shards} server(s), {r['streams']} "
                                f"stream(s), rep {rep + 1}/{s.insert_reps}: "
                                f"{wl.wire_bytes / dt / 1e6:,.0f} MB/s"
                            )
                    size = sample_bytes.get((name, shards))
                    for r, _ in configs:
                        dt = statistics.median(r["times"])
                        r["insert_tps"] = wl.num_steps / dt
                        r["insert_mbps"] = wl.wire_bytes / dt / 1e6
                        if size is not None:
                            # The sample ceiling depends on the servers only: same for each
                            # stream count; measured once per shard count below.
                            r["sample_bytes"] = size
                    if size is not None:
                        per = [size // shards] * shards
                        tps, p50, p99 = timed_calls(
                            f"[{name}] raw gRPC source {size / MiB:.2f} MiB/batch, "
                            f"{shards} server(s)",
                            functools.partial(client.fetch, per),
                            BATCH,
                            s,
                        )
                        for r, _ in configs:
                            r.update(sample_tps=tps, sample_p50=p50, sample_p99=p99)
                    out += [r for r, _ in configs]
        finally:
            client.close()
    finally:
        for p in servers:
            p.stop()
    return out


# -- millpond --------------------------------------------------------------------------------
def pinned_writer_ids(prefix: str, shards: int, count: int) -> list[str]:
    """``count`` writer ids, the k-th pinned to shard ``k % shards``."""
    from millpond.service.table import writer_hash

    ids = []
    for k in range(count):
        i = 0
        while writer_hash(f"{prefix}-{k}-{i}") % shards != k % shards:
            i += 1
        ids.append(f"{prefix}-{k}-{i}")
    return ids


def millpond_pass(wl: Workload, writers: list, lanes: list[list[int]], pass_no: int) -> float:
    """Every segment once, writer k writing its lanes' segments in its own thread; flushed.

    Each pass gets fresh episode ids, as new experience would.
    """
    off = pass_no * wl.num_episodes

    def job(writer, mine: set[int]) -> None:
        for g in wl.segments:
            if g.lane in mine:
                writer.write_segment(g.steps, g.tail, off + g.episode, g.first_step)
        writer.flush(300)

    return run_parallel([functools.partial(job, w, set(ls)) for w, ls in zip(writers, lanes)])


def bench_millpond(
    root: Path, workloads: dict[str, Workload], shards: int, s: Settings
) -> tuple[list[dict], dict[str, int]]:
    """Insert and sample through ``millpond serve --shards N``; also the sample wire sizes."""
    import grpc

    from millpond import ReplayClient, TableConfig
    from millpond.protos import millpond_pb2 as pb
    from millpond.protos import millpond_pb2_grpc as pb_grpc

    out: list[dict] = []
    sample_bytes: dict[str, int] = {}
    with millpond_serve(root, shards) as server:
        client = ReplayClient(server.addresses, timeout_s=300)
        try:
            for name, wl in workloads.items():
                T = wl.shape.chunk_len
                slots = wl.num_steps + len(wl.segments)
                capacity = -(-slots // shards) + 2 * (T + 1)
                client.create_table(TableConfig.uniform(name, capacity))
                passes = 0
                configs = []
                for w in s.writers:
                    n = shards * w
                    ids = pinned_writer_ids(f"bench-{name}-{shards}x{w}", shards, n)
                    writers = [client.writer(name, i) for i in ids]
                    assert [x.shard_index for x in writers] == [k % shards for k in range(n)]
                    r = new_result("millpond", name, shards, n, wl)
                    r["times"] = []
                    configs.append((r, writers, lanes_of(wl.shape.lanes, n)))
                try:
                    # Warm-up: the first fill (files grow, pages fault in), with the first
                    # writer set; the timed passes then overwrite the ring (the steady state).
                    settle()
                    dt = millpond_pass(wl, configs[0][1], configs[0][2], passes)
                    passes += 1
                    log(
                        f"[{name}] millpond {shards} shard(s): first fill "
                        f"{wl.num_steps / dt:,.0f} transitions/s, "
                        f"{wl.wire_bytes / dt / 1e6:,.0f} MB/s"
                    )
                    configs[0][0]["first_fill_tps"] = wl.num_steps / dt
                    for rep in range(s.insert_reps):
                        for r, writers, lanes in configs:
                            settle()
                            dt = millpond_pass(wl, writers, lanes, passes)
                            passes += 1
                            r["times"].append(dt)
                            log(
                                f"[{name}] millpond insert, {shards} shard(s), {r['streams']} "
                                f"writer(s), rep {rep + 1}/{s.insert_reps}: "
                                f"{wl.num_steps / dt:,.0f} transitions/s, "
                                f"{wl.wire_bytes / dt / 1e6:,.0f} MB/s"
                            )
                finally:
                    for _, writers, _ in configs:
                        for x in writers:
                            x.close(60)
                for r, _, _ in configs:
                    dt = statistics.median(r["times"])
                    r["insert_tps"] = wl.num_steps / dt
                    r["insert_mbps"] = wl.wire_bytes / dt / 1e6
                info = client.info(name)
                if info["inserts"] != passes * wl.num_steps:
                    raise AssertionError(
                        f"the shards counted {info['inserts']} inserted steps, "
                        f"expected {passes * wl.num_steps}"
                    )
                log(f"[{name}] millpond {shards} shard(s): {info['size']:,} steps stored")

                # The bytes of one sample response (batch 256 split over the shards).
                total = 0
                for address in server.addresses:
                    with grpc.insecure_channel(address, options=_channel_options()) as ch:
                        resp = pb_grpc.ReplayStub(ch).Sample(
                            pb.SampleRequest(table=name, batch_size=BATCH // shards, num_batches=1)
                        )
                        total += sum(m.ByteSize() for m in resp)
                sample_bytes[name] = total

                settle()
                label = f"[{name}] millpond {shards} shard(s)"
                tps, p50, p99 = timed_calls(
                    f"{label} sample({BATCH})",
                    lambda name=name: client.sample(name, BATCH),
                    BATCH,
                    s,
                )
                it_tps, it50, it99 = timed_iterate(
                    f"{label} iterate({BATCH}, prefetch={PREFETCH})",
                    lambda name=name: client.iterate(name, BATCH, prefetch=PREFETCH),
                    BATCH,
                    s,
                )
                for r, _, _ in configs:
                    r.update(
                        sample_tps=tps,
                        sample_p50=p50,
                        sample_p99=p99,
                        iterate_tps=it_tps,
                        iterate_p50=it50,
                        iterate_p99=it99,
                        sample_bytes=total,
                    )
                out += [r for r, _, _ in configs]
        finally:
            client.close()
    return out, sample_bytes


# -- TorchRL ---------------------------------------------------------------------------------
def torchrl_pass(rb, wl: Workload, callers: int) -> float:
    """Every TED chunk once (one ``extend`` each), chunks dealt round-robin to the callers."""

    def job(k: int) -> None:
        for c in range(k, len(wl.ted_chunks), callers):
            rb.extend(wl.ted_chunks[c])

    return run_parallel([functools.partial(job, k) for k in range(callers)])


def bench_torchrl(root: Path, workloads: dict[str, Workload], s: Settings) -> list[dict]:
    import ray
    from torchrl.data import LazyMemmapStorage, RandomSampler, RayReplayBuffer

    out: list[dict] = []
    t0 = time.perf_counter()
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
    )
    log(f"ray: started ({time.perf_counter() - t0:.1f} s)")
    try:
        for name, wl in workloads.items():
            scratch = root / f"torchrl-{name}"
            scratch.mkdir()
            rb = RayReplayBuffer(
                storage=functools.partial(
                    LazyMemmapStorage, wl.num_steps, scratch_dir=str(scratch)
                ),
                sampler=RandomSampler,
                batch_size=BATCH,
                remote_config={"num_cpus": 1},
            )
            try:
                t1 = time.perf_counter()
                len(rb)  # the actor process has started (not part of the first fill)
                log(f"[{name}] torchrl-ray: actor ready ({time.perf_counter() - t1:.1f} s)")
                configs = []
                for w in s.writers:
                    r = new_result("torchrl-ray", name, 1, w, wl)
                    r["times"] = []
                    configs.append(r)

                settle()
                dt = torchrl_pass(rb, wl, 1)
                log(
                    f"[{name}] torchrl-ray: first fill {wl.num_steps / dt:,.0f} transitions/s, "
                    f"{wl.ted_bytes / dt / 1e6:,.0f} MB/s"
                )
                configs[0]["first_fill_tps"] = wl.num_steps / dt
                for rep in range(s.insert_reps):
                    for r in configs:
                        settle()
                        dt = torchrl_pass(rb, wl, r["streams"])
                        r["times"].append(dt)
                        log(
                            f"[{name}] torchrl-ray extend, {r['streams']} caller(s), "
                            f"rep {rep + 1}/{s.insert_reps}: "
                            f"{wl.num_steps / dt:,.0f} transitions/s, "
                            f"{wl.ted_bytes / dt / 1e6:,.0f} MB/s"
                        )
                for r in configs:
                    dt = statistics.median(r["times"])
                    r["insert_tps"] = wl.num_steps / dt
                    r["insert_mbps"] = wl.ted_bytes / dt / 1e6
                if len(rb) != wl.num_steps:
                    raise AssertionError(f"torchrl holds {len(rb)} steps, expected {wl.num_steps}")
                settle()
                batch = rb.sample()
                if ("next", OBS) not in batch.keys(True) or batch.batch_size[0] != BATCH:
                    raise AssertionError("RayReplayBuffer.sample() returned an unexpected batch")
                tps, p50, p99 = timed_calls(
                    f"[{name}] torchrl-ray sample({BATCH})", rb.sample, BATCH, s
                )
                for r in configs:
                    r.update(sample_tps=tps, sample_p50=p50, sample_p99=p99)
                out += configs
            finally:
                rb.close()
                shutil.rmtree(scratch, ignore_errors=True)
    finally:
        ray.shutdown()
    return out


# -- report ----------------------------------------------------------------------------------
def _code_version() -> str:
    """The git commit of the millpond code measured (and whether it has local edits)."""
    import millpond

    here = Path(millpond.__file__).resolve().parent.parent
    paths = ["service", "learner", "protos", "millpond"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
    except OSError:
        return f"{here} (no git)"
    if not head:
        return f"{here} (not a git checkout)"
    edited = sorted({line[3:] for line in dirty if line[3:].endswith(".py")})
    return f"commit {head}" + (f" with local edits in {', '.join(edited)}" if edited else "")


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
        f"ray {ray.__version__}; everything on loopback. Load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.2f}' for x in load[0])}, at end {'/'.join(f'{x:.2f}' for x in load[1])}."
        f" Run took {seconds:.0f} s. GLIBC_TUNABLES: {os.environ.get('GLIBC_TUNABLES') or 'unset'}."
    )
    lines.append("")
    lines.append(f"millpond code: {_code_version()}.")
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
        "| sample(256) tr/s | sample p50 / p99 ms | iterate tr/s | iterate p50 / p99 ms |"
    )
    lines.append("|" + "---|" * 11)
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
            lines.append(
                f"| {shape} | {system} | {r['shards']} | {r['streams']} "
                f"| {_f(r.get('insert_tps'))} | {_f(r.get('insert_mbps'), ',.1f')} | {vs} "
                f"| {_f(r.get('sample_tps'))} "
                f"| {_f(r.get('sample_p50'), '.1f')} / {_f(r.get('sample_p99'), '.1f')} "
                f"| {_f(r.get('iterate_tps'))} | {it} |"
            )
    lines.append("")
    lines.append(
        "Writers: millpond writers (one thread each, each owning whole env lanes) in all; "
        "for TorchRL the number of threads calling `extend`; for the ceiling, client streams. "
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

    def status(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    out = ["Targets:", ""]
    mp = pick("millpond", "atari")
    if mp and pick("raw-grpc", "atari"):
        parts = []
        ok_all = True
        for r in mp:
            c = pick("raw-grpc", "atari", r["shards"], r["streams"])
            if not c:
                continue
            share = r["insert_mbps"] / c[0]["insert_mbps"]
            ok_all &= share >= TARGET_CEILING
            parts.append(
                f"{r['shards']} shard(s) x {r['streams']} writer(s) {share:.0%} "
                f"({r['insert_mbps']:,.0f} of {c[0]['insert_mbps']:,.0f} MB/s)"
            )
        out.append(
            f"- Atari-shaped insert >= {TARGET_CEILING:.0%} of the raw gRPC ceiling: "
            f"{status(ok_all)} — " + "; ".join(parts) + "."
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
            text += f"; one writer vs one caller {one_mp[0]['insert_tps'] / one_tr[0]['insert_tps']:.2f}x"
        out.append(text + ".")
        best_s = max(mp, key=lambda r: r["sample_tps"])
        one = pick("millpond", "cartpole", 1)
        ratio = best_s["sample_tps"] / tr[0]["sample_tps"]
        text = (
            f"- CartPole-shaped sample(256) >= {TARGET_SAMPLE}x RayReplayBuffer: "
            f"{status(ratio >= TARGET_SAMPLE)} — {ratio:.2f}x with {best_s['shards']} shard(s) "
            f"({best_s['sample_tps']:,.0f} vs {tr[0]['sample_tps']:,.0f} tr/s)"
        )
        if one and one[0] is not best_s and one[0]["shards"] != best_s["shards"]:
            text += f"; 1 shard {one[0]['sample_tps'] / tr[0]['sample_tps']:.2f}x"
        it = max(mp, key=lambda r: r.get("iterate_tps", 0))
        if "iterate_tps" in it:
            text += (
                f"; iterate(prefetch={PREFETCH}) {it['iterate_tps'] / tr[0]['sample_tps']:.2f}x "
                f"({it['shards']} shard(s))"
            )
        out.append(text + ".")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 90 s)")
    ap.add_argument("--out", type=Path, help="also write the table as markdown to this file")
    ap.add_argument("--dir", type=Path, help="parent of the temporary data directory (/tmp)")
    ap.add_argument("--shapes", default="cartpole,atari", help="comma-separated: cartpole,atari")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--shards", default="1,2", help="millpond shard counts (default 1,2)")
    ap.add_argument(
        "--writers",
        default=None,
        help="writers per shard (millpond), extend threads (TorchRL), streams per server "
        "(ceiling); comma-separated (default 1,2; quick 1)",
    )
    ap.add_argument(
        "--reps", type=int, help="timed repetitions (default: 3 insert / 5 sample; quick 1 / 2)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in this (client) process (default 1)",
    )
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
        insert_reps=args.reps or (1 if quick else 3),
        sample_reps=args.reps or (2 if quick else 5),
        sample_rep_seconds=0.2 if quick else 0.5,
        quick=quick,
    )
    warnings.filterwarnings("ignore", category=UserWarning, module="torchrl")
    import torchrl  # noqa: F401  (configures its logger on import; quieten it afterwards)

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="millpond-svc-bench-", dir=args.dir))
    t0 = time.perf_counter()
    try:
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
        results: list[dict] = []
        sample_bytes: dict[tuple[str, int], int] = {}
        if "millpond" in systems:
            for shards in s.shards:
                rows, sizes = bench_millpond(root, workloads, shards, s)
                results += rows
                sample_bytes.update({(name, shards): n for name, n in sizes.items()})
        if "raw-grpc" in systems:
            results = bench_raw(root, workloads, sample_bytes, s) + results
        if "torchrl-ray" in systems:
            results += bench_torchrl(root, workloads, s)
    finally:
        with contextlib.suppress(Exception):
            shutil.rmtree(root)
    order = {name: i for i, name in enumerate(SYSTEMS)}
    shape_order = {shape.name: i for i, shape in enumerate(shapes)}
    results.sort(
        key=lambda r: (shape_order[r["shape"]], order[r["system"]], r["shards"], r["streams"])
    )
    report = render(
        results, workloads, s, argv, (load_before, os.getloadavg()), time.perf_counter() - t0
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
