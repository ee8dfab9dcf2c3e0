"""Sampling over the wire, Atari-shaped: the slot layout against the older form, and the
raw gRPC ceiling for the same bytes, in one run.

One server process fills two identical shards (the same segments, the same table seeds)
with Atari-shaped steps (``uint8[4, 84, 84]`` observations) and serves them on two ports:
one answering Sample in the slot layout (``SampleResponse.slot_observations``: each distinct
observation slot once), one in the older form (``next_rows``: the whole TED batch built,
the next observations compared away, then encoded). A third port is a bare gRPC server
(generic handler, identity serializers, no proto) that streams pre-built byte messages of
the size of a sample response. The client process calls ``ReplayClient.sample(table, B)``
(decoding included) on each millpond port in turn, and one ceiling call of each response
size, repetition after repetition, so that the load of a shared machine falls on all alike.

    python benchmarks/wire_sample.py                       # uniform and slices, ~1 minute
    python benchmarks/wire_sample.py --tables uniform --reps 5 --calls 40

Prints a Markdown table: transitions/s (steps per second of back-to-back calls) and the
p50/p99 latency of one call, pooled over repetitions.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
from _common import add_raw_source, grpc_options, raw_source, response_bytes, time_in_turns

MiB = 1 << 20
OBS_SHAPE = (4, 84, 84)
CAPACITY = 4096
SLICE_LEN = 8
TABLES = {"uniform": "uniform", "slices": "slices"}


def _fill(shard, tables: list[str]) -> None:
    import torch
    from tensordict import TensorDict

    from millpond.config import TableConfig

    for name in tables:
        if name == "uniform":
            config = TableConfig.uniform(name, CAPACITY, seed=0)
        else:
            config = TableConfig.slices(name, CAPACITY, SLICE_LEN, seed=0)
        table = shard.create_table(config)
        rng = np.random.default_rng(0)
        ep = 0
        while table.size < CAPACITY * 0.9:
            n = int(rng.integers(20, 128))
            obs = torch.from_numpy(rng.integers(0, 256, (n + 1, *OBS_SHAPE), dtype=np.uint8))
            term = torch.zeros(n, 1, dtype=torch.bool)
            term[-1] = True
            steps = TensorDict(
                {
                    "observation": obs[:-1],
                    "action": torch.from_numpy(rng.integers(0, 6, n)),
                    "next": {
                        "reward": torch.ones(n, 1),
                        "terminated": term,
                        "truncated": torch.zeros(n, 1, dtype=torch.bool),
                    },
                },
                [n],
            )
            table.insert(steps, TensorDict({"observation": obs[-1]}, []), ep, timeout=10)
            ep += 1


def serve(root: Path, tables: list[str]) -> int:
    """``--serve``: the two millpond servers and the raw one, until stdin closes."""
    from concurrent import futures

    import grpc

    from millpond.service.server import add_replay_servicer
    from millpond.service.servicer import ReplayServicer
    from millpond.service.shard import Shard
    from millpond.service.weights import WeightStore

    ports = []
    servers = []
    for mode in ("slots", "rows"):
        shard = Shard(root / mode)
        _fill(shard, tables)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=grpc_options())
        servicer = ReplayServicer(
            shard, WeightStore(root / mode / "weights"), 256 * MiB, slot_samples=mode == "slots"
        )
        add_replay_servicer(server, servicer)  # as `millpond serve` registers it
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
    raw = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=grpc_options())
    add_raw_source(raw)
    ports.append(raw.add_insecure_port("127.0.0.1:0"))
    raw.start()
    print("PORTS", *ports, flush=True)
    sys.stdin.read()
    for server in [*servers, raw]:
        server.stop(0)
    return 0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", default="uniform,slices")
    parser.add_argument("--batch", type=int, default=256, help="steps per batch")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="calls per system per repetition")
    parser.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tables = args.tables.split(",")
    from millpond.allocator import keep_freed_buffers

    keep_freed_buffers()  # as millpond's processes do; the ceiling's (same processes) alike
    if args.serve:
        from millpond.service.server import tune_shard_process

        tune_shard_process()  # as `millpond serve` does
        return serve(Path(args.serve), tables)

    import tempfile

    import grpc
    import torch

    from millpond import ReplayClient
    from millpond.protos import millpond_pb2 as pb

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp, "--tables", args.tables],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline().split()
            assert line and line[0] == "PORTS", line
            slots_port, rows_port, raw_port = (int(p) for p in line[1:])
            rows = _measure(args, tables, slots_port, rows_port, raw_port, ReplayClient, grpc, pb)
        finally:
            proc.stdin.close()
            proc.wait(30)
    load = os.getloadavg()
    print(
        f"\n{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__},"
        f" grpcio {grpc.__version__}; load average {load[0]:.1f}; batch {args.batch} steps"
        f" of uint8{list(OBS_SHAPE)}; {args.reps} reps x {args.calls} calls\n"
    )
    print("| table | system | response MiB | tr/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _measure(args, tables, slots_port, rows_port, raw_port, ReplayClient, grpc, pb):
    # On the wire even though the server is on this host (see colocated_sample.py for that).
    clients = {
        "millpond, slot layout": ReplayClient(
            f"127.0.0.1:{slots_port}", max_message_mb=256, colocated=False
        ),
        "millpond, older form": ReplayClient(
            f"127.0.0.1:{rows_port}", max_message_mb=256, colocated=False
        ),
    }
    ports = {"millpond, slot layout": slots_port, "millpond, older form": rows_port}
    raw_channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}", options=grpc_options())
    source = raw_source(raw_channel)
    out = []
    for table in tables:
        batch = args.batch // SLICE_LEN if table == "slices" else args.batch
        steps = batch * (SLICE_LEN if table == "slices" else 1)
        sizes = {}
        for name, port in ports.items():  # one response's bytes, read without decoding
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options())
            request = pb.SampleRequest(table=table, batch_size=batch, num_batches=1)
            sizes[name] = response_bytes(channel, request)
            channel.close()
        systems = {
            name: (lambda c=client, t=table, b=batch: c.sample(t, b, timeout_s=30))
            for name, client in clients.items()
        }
        for name in ports:
            size = sizes[name]
            label = f"raw gRPC ceiling, {name.split(', ')[1]} bytes"
            systems[label] = lambda s=size: source(s)
            sizes[label] = size
        for fn in systems.values():  # warm-up
            fn()
        lat, wall, _ = time_in_turns(systems, args.reps, args.calls)
        for name in systems:
            calls = args.reps * args.calls
            out.append(
                [
                    table,
                    name,
                    f"{sizes[name] / MiB:.2f}",
                    f"{calls * steps / wall[name]:,.0f}",
                    f"{_pct(lat[name], 50):.1f}",
                    f"{_pct(lat[name], 99):.1f}",
                ]
            )
    raw_channel.close()
    for client in clients.values():
        client.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
