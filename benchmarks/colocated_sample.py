"""Colocated sampling, Atari-shaped: the wire, the colocated read, and a bare memory-map
gather of the same rows, in one run.

One ``millpond serve``-like server process fills a shard with Atari-shaped steps (``uint8[4, 84, 84]`` observations,
as :mod:`wire_sample` does) and serves it on loopback. The client process calls
``ReplayClient.sample(table, B)`` with ``colocated=False`` (observations on the wire) and
``colocated=True`` (the shard sends the sampled slots, the client reads the rows from the
table's memory-mapped files and checks their generations), ``sample`` call after call and
through ``iterate`` (requests kept in flight; each turn opens its own stream, primed before
the clock starts and closed after it stops, so that batches left in flight never run in
another system's turn), and, as the floor, gathers the
observations and next observations of the slots the colocated calls drew straight from the
column file (``np.memmap``, read-only: no RPC, no metadata, no checks). Each repetition runs
every system in turn, so that the load of a shared machine falls on all alike.

    python benchmarks/colocated_sample.py                  # uniform, batch 256, ~1 minute
    python benchmarks/colocated_sample.py --reps 5 --calls 40 --threads 4
    python benchmarks/colocated_sample.py --work-ms 3.5    # a learner's update per batch

Prints a Markdown table: transitions/s (steps per second of back-to-back calls, or of calls
each followed by ``--work-ms`` of torch work), the p50/p99 latency of one call (and its
work) pooled over repetitions, each system's time over the bare gather's, and the CPU time
per call of the client's process and of the shard's (on two cores their sum over two is a
floor under the time per call).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import time_in_turns
from wire_sample import OBS_SHAPE, _fill, _pct

MiB = 1 << 20
TABLE = "uniform"


def serve(root: Path) -> int:
    """``--serve``: one shard server (as ``millpond serve`` runs it) over a filled shard,
    until stdin closes."""
    from millpond.service.server import ServerConfig, create_server

    server, port = create_server(ServerConfig(dir=str(root / "shard")))
    _fill(server.shard, [TABLE])
    print("PORT", port, flush=True)
    sys.stdin.read()
    server.stop(grace=0)  # waits for the calls to end and closes the shard
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="steps per batch")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="calls per system per repetition")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the client")
    parser.add_argument("--prefetch", type=int, default=4, help="iterate's requests in flight")
    parser.add_argument(
        "--keep-freed-buffers",
        action="store_true",
        help="the client keeps freed buffers for reuse, as millpond's learners do "
        "(millpond.allocator); by default glibc's thresholds stay as they are",
    )
    parser.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="a learner's update after every batch: about this many ms of torch work on the "
        "client's thread (default 0: batches back to back)",
    )
    parser.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(Path(args.serve))

    import tempfile

    import grpc
    import torch

    torch.set_num_threads(args.threads)
    if args.keep_freed_buffers:
        from millpond.allocator import keep_freed_buffers

        keep_freed_buffers()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline().split()
            assert line and line[0] == "PORT", line
            rows = _measure(args, int(line[1]), proc.pid)
        finally:
            proc.stdin.close()
            proc.wait(30)
    load = os.getloadavg()
    print(
        f"\n{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__},"
        f" grpcio {grpc.__version__}, {args.threads} torch thread(s), "
        f"{f'{args.work_ms:g} ms of work after each batch, ' if args.work_ms else ''}"
        f"{'freed buffers kept' if args.keep_freed_buffers else 'default allocator'}; load average "
        f"{load[0]:.1f}; batch {args.batch} steps of uint8{list(OBS_SHAPE)} with next "
        f"observations; {args.reps} reps x {args.calls} calls\n"
    )
    print(
        "| system | tr/s | p50 ms | p99 ms | time / bare gather | CPU ms per call, client / shard |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _measure(args, port: int, server_pid: int) -> list[list[str]]:
    import contextlib
    import json
    from collections.abc import Iterator
    from typing import Any

    import grpc
    import torch

    from millpond import ReplayClient
    from millpond.protos import millpond_pb2 as pb
    from millpond.protos import millpond_pb2_grpc as pb_grpc
    from millpond.storage_format import COLUMN_INDEX, COLUMNS_DIR

    address = f"127.0.0.1:{port}"
    wire = ReplayClient(address, max_message_mb=256, colocated=False)
    colocated = ReplayClient(address, max_message_mb=256, colocated=True)
    info = colocated.info(TABLE)
    shard = info["shards"][0]
    capacity = info["config"].capacity
    directory = Path(shard["storage_dir"])
    index = json.loads((directory / COLUMNS_DIR / COLUMN_INDEX).read_text())
    file = next(c["file"] for c in index["columns"] if c["key"] == ["observation"])
    column = np.memmap(
        directory / COLUMNS_DIR / file, dtype=np.uint8, mode="r", shape=(capacity, *OBS_SHAPE)
    )
    drawn: list[np.ndarray] = []

    def sample_colocated() -> None:
        batch = colocated.sample(TABLE, args.batch, timeout_s=30)
        drawn.append(batch["index", "slot"].numpy())

    calls_done = [0]

    def bare() -> tuple:
        # The rows a colocated call of this repetition drew: observations and next
        # observations, both held as a batch holds them.
        slots = drawn[-args.calls + calls_done[0] % args.calls]
        calls_done[0] += 1
        obs = torch.from_numpy(np.take(column, slots, axis=0))
        nxt = torch.from_numpy(np.take(column, slots + 1, axis=0))
        return obs, nxt

    # The colocated request alone (the shard samples, counts and answers; nothing is read),
    # on a channel like the client's own for it: the floor under a colocated call.
    channel = grpc.insecure_channel(address, options=[("SingleThreadedUnaryStream", 1)])
    stub = pb_grpc.ReplayStub(channel)
    request = pb.SampleRequest(table=TABLE, batch_size=args.batch, num_batches=1, colocated=True)
    streams: dict[str, Any] = {}

    def streaming(name: str, client: ReplayClient) -> Callable[[], Any]:
        """A turn of ``client.iterate``: opened and primed (``prefetch`` batches taken)
        before the clock starts, closed after it stops, so that what it keeps in flight
        never runs in another system's turn."""

        @contextlib.contextmanager
        def turn() -> Iterator[None]:
            streams[name] = client.iterate(TABLE, args.batch, prefetch=args.prefetch, timeout_s=30)
            for _ in range(args.prefetch):
                next(streams[name])
            try:
                yield
            finally:
                streams.pop(name).close()

        return turn

    wire_iterate = f"wire, iterate (prefetch {args.prefetch})"
    colocated_iterate = f"colocated, iterate (prefetch {args.prefetch})"
    systems = {
        "wire, sample (colocated=False)": lambda: wire.sample(TABLE, args.batch, timeout_s=30),
        "colocated, sample (colocated=True)": sample_colocated,
        wire_iterate: lambda: next(streams[wire_iterate]),
        colocated_iterate: lambda: next(streams[colocated_iterate]),
        "bare memmap gather, same rows": bare,
        "colocated request alone (no read)": lambda: list(stub.Sample(request)),
    }
    if args.work_ms > 0:
        work = _work(args.work_ms)
        systems = {name: (lambda fn=fn: (fn(), work())[0]) for name, fn in systems.items()}
    turns = {wire_iterate: streaming(wire_iterate, wire)}
    turns[colocated_iterate] = streaming(colocated_iterate, colocated)
    for name, fn in list(systems.items())[:4]:  # warm-up: page cache, channels, readers
        with turns[name]() if name in turns else contextlib.nullcontext():
            for _ in range(max(3, args.calls)):
                fn()
    assert colocated._sampler._colocation._readers, "the colocated client must read the files"
    lat, wall, cpu = time_in_turns(systems, args.reps, args.calls, turns, [server_pid])
    channel.close()
    wire.close()
    colocated.close()
    calls = args.reps * args.calls
    floor = wall["bare memmap gather, same rows"]
    return [
        [
            name,
            f"{calls * args.batch / wall[name]:,.0f}",
            f"{_pct(lat[name], 50):.2f}",
            f"{_pct(lat[name], 99):.2f}",
            f"{wall[name] / floor:.2f}x",
            f"{cpu[name][0] / calls * 1e3:.2f} / {cpu[name][1] / calls * 1e3:.2f}",
        ]
        for name in systems
    ]


def _work(ms: float) -> Callable[[], object]:
    """About ``ms`` milliseconds of torch work (products and tanh of 256 x 256 matrices),
    as a learner's update between batches."""
    import time

    import torch

    w, x = torch.randn(256, 256), torch.randn(256, 256)

    def step() -> torch.Tensor:
        return torch.tanh(x @ w)

    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.3:
        step()
        n += 1
    reps = max(1, round(ms / 1000 / ((time.perf_counter() - started) / n)))

    def work() -> None:
        for _ in range(reps):
            step()

    return work


if __name__ == "__main__":
    sys.exit(main())
