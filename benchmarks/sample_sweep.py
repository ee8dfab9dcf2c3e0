"""Sampling throughput against batch size, Atari-shaped: millpond over the wire, millpond
colocated, TorchRL's RayReplayBuffer and (optionally) DeepMind Reverb, side by side in one run.

Every system holds ~4096 Atari-shaped transitions (``uint8[4, 84, 84]`` random-byte
observations, int64 action, float32 reward, bool terminated/truncated) and is sampled
uniformly, batch after batch, from this process:

* ``millpond wire``: a ``millpond serve`` process (one shard), a uniform table of capacity
  4096 filled with 100-step episodes; ``ReplayClient(addr, colocated=False).sample(table, B)``
  (observations and next observations on the wire, the TED batch decoded).
* ``millpond colocated``: the same table, ``ReplayClient(addr, colocated=True).sample(table,
  B)`` (the shard answers with slots, the client reads the rows from the table's
  memory-mapped files on this host).
* ``bare memmap gather``: the floor under the colocated read: the observations and next
  observations of colocated batches' slots (32 batches in turn, as random as sampled rows)
  gathered straight from the column file
  (``np.take`` on a read-only ``np.memmap``; no RPC, no metadata, no checks).
* ``raw gRPC, millpond wire's bytes``: the ceiling: a gRPC server process doing nothing but
  send one message as large as millpond's wire answer for that batch size (random bytes,
  no decoding), one call per batch.
* ``torchrl-ray``: TorchRL's ``RayReplayBuffer`` (a ``ReplayBuffer`` in a Ray actor) over a
  ``LazyMemmapStorage`` in TED layout (``("next", "observation")`` stored), ``RandomSampler``,
  ``sample(B)``; filled with one ``extend`` per episode.
* ``reverb`` (``--reverb-python``): a ``reverb.Server`` in its own process (a Uniform table,
  max_size 4096, ``MinSize(1)``) filled with single-step items (observation, action, reward,
  done: no next observation, as Reverb users store transitions), sampled by a client process
  run under that interpreter (reverb, numpy and tensorflow only) through
  ``reverb.TrajectoryDataset.from_table_signature(...).batch(B).as_numpy_iterator()``
  (samples kept in flight, so it pipelines where the others are one synchronous call) and
  through ``Client.sample(table, num_samples=B)`` with the items stacked by numpy.

The batch of millpond and TorchRL carries the next observations (twice the observation bytes
of Reverb's). Reverb's dataset uses one worker and, unless ``--reverb-in-flight`` says, the
fastest ``max_in_flight_samples_per_worker`` of 64, 256, B and 2B, tried for each batch size.
Each repetition measures every batch size and, within it, every system in turn (the order
rotating from one repetition to the next), so that the load of a shared machine falls on all
alike; each measurement starts with a few untimed calls, so that a pipelined source does not
count what it buffered meanwhile. The report gives, per system and batch size, the medians
over repetitions of transitions/s (steps per second of back-to-back calls) and of the p50/p99
latency of one call.

    python benchmarks/sample_sweep.py --quick                  # smoke run, < 90 s
    python benchmarks/sample_sweep.py --reverb-python PYTHON --out sweep.md \
        --plot docs/sample_sweep.png                           # ~5 minutes

Prints the command line, the machine line and a Markdown table; ``--plot`` writes a figure
(log-x batch size, transitions/s, one line per system).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

MiB = 1 << 20
OBS_SHAPE = (4, 84, 84)
CAPACITY = 4096
EPISODE_LEN = 100
TABLE = "uniform"
BATCH_SIZES = "32,64,128,256,512,1024"
REF_BATCH = 256


def _stats(wall: float, lat: list[float], steps: int) -> dict[str, float]:
    a = np.asarray(lat)
    return {
        "trs": len(lat) * steps / wall,
        "p50": float(np.percentile(a, 50)) * 1e3,
        "p99": float(np.percentile(a, 99)) * 1e3,
    }


def _timed(fn: Callable[[], object], calls: int, steps: int) -> dict[str, float]:
    """``calls`` back-to-back calls of ``fn``: transitions/s and the p50/p99 latency (ms).

    A quarter as many calls (at least 2) go first, untimed: what a pipelined source (Reverb's
    dataset) buffered while the other systems were measured is used up before the clock
    starts, and every system starts warm alike.
    """
    for _ in range(max(2, calls // 4)):
        fn()
    lat = []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return _stats(time.perf_counter() - start, lat, steps)


def _calls_for(fn: Callable[[], object], seconds: float, at_least: int = 3) -> int:
    """Warm ``fn`` up and return how many calls take ~``seconds`` (as ``_common.calibrate``)."""
    t0 = time.perf_counter()
    n = 0
    while n < at_least or time.perf_counter() - t0 < min(0.3, seconds):
        fn()
        n += 1
    return max(at_least, int(seconds / ((time.perf_counter() - t0) / n)))


# -- Reverb (run under the interpreter of --reverb-python: reverb, numpy, tensorflow only) --
REVERB_KEYS = ("observation", "action", "reward", "done")


def _reverb_signature():
    import tensorflow as tf

    return {
        "observation": tf.TensorSpec(OBS_SHAPE, tf.uint8),
        "action": tf.TensorSpec([], tf.int64),
        "reward": tf.TensorSpec([], tf.float32),
        "done": tf.TensorSpec([], tf.bool),
    }


def reverb_server() -> int:
    """``--reverb-server``: a Reverb server (one Uniform table) until stdin closes."""
    import reverb

    table = reverb.Table(
        TABLE,
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Fifo(),
        max_size=CAPACITY,
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature=_reverb_signature(),
    )
    server = reverb.Server([table], port=None)
    print("PORT", server.port, flush=True)
    sys.stdin.read()
    server.stop()
    return 0


def reverb_worker(in_flight: int | None) -> int:
    """``--reverb-worker``: start a Reverb server process, fill it, then answer commands.

    Reads JSON lines ``{"batch": B, "path": "dataset" | "client", "seconds": s}`` on stdin
    and answers each with a JSON line ``{"trs", "p50", "p99", ...}`` on stdout; the first
    command of a (batch, path) also warms up and calibrates the number of calls.
    """
    import reverb

    server = subprocess.Popen(
        [sys.executable, __file__, "--reverb-server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline().split()
        assert line and line[0] == "PORT", line
        address = f"127.0.0.1:{line[1]}"
        client = reverb.Client(address)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:
            for i in range(CAPACITY):
                writer.append(
                    {
                        "observation": rng.integers(0, 256, OBS_SHAPE, dtype=np.uint8),
                        "action": np.int64(rng.integers(0, 6)),
                        "reward": np.float32(1.0),
                        "done": np.bool_((i + 1) % EPISODE_LEN == 0),
                    }
                )
                writer.create_item(TABLE, 1.0, {k: writer.history[k][-1] for k in REVERB_KEYS})
                if i % 16 == 15:
                    writer.flush()
            writer.flush()
        size = client.server_info()[TABLE].current_size
        print(
            json.dumps({"ready": size, "fill_s": time.perf_counter() - t0, "address": address}),
            flush=True,
        )
        chosen: dict[int, int] = {}
        calls: dict[tuple[int, str], int] = {}
        current: list[object] = []

        def make_iterator(batch: int, flight: int) -> Callable[[], object]:
            # A fresh iterator for every measurement: tf.data prefetches in the background
            # (autotuned), and one kept across measurements would hand out what it buffered
            # while the other systems ran.
            current.clear()
            gc.collect()
            ds = reverb.TrajectoryDataset.from_table_signature(
                address,
                TABLE,
                max_in_flight_samples_per_worker=flight,
                num_workers_per_iterator=1,
            )
            it = ds.batch(batch).as_numpy_iterator()
            current.append(it)
            return lambda: next(it)

        def dataset_fn(batch: int, seconds: float) -> Callable[[], object]:
            if batch not in chosen:
                # max_in_flight_samples_per_worker: the one given, else the fastest of a few.
                best = (0.0, 0)
                for flight in [in_flight] if in_flight else sorted({64, 256, batch, 2 * batch}):
                    fn = make_iterator(batch, flight)
                    trs = _timed(fn, _calls_for(fn, seconds), batch)["trs"]
                    best = max(best, (trs, flight))
                chosen[batch] = best[1]
            return make_iterator(batch, chosen[batch])

        def client_fn(batch: int) -> Callable[[], object]:
            def fn():
                samples = list(client.sample(TABLE, num_samples=batch, emit_timesteps=False))
                cols = zip(*(s.data for s in samples), strict=True)
                return [np.stack(c) for c in cols]

            return fn

        for command in sys.stdin:
            cmd = json.loads(command)
            batch, path = int(cmd["batch"]), cmd["path"]
            seconds = float(cmd["seconds"])
            fn = dataset_fn(batch, seconds) if path == "dataset" else client_fn(batch)
            if (batch, path) not in calls:
                calls[batch, path] = _calls_for(fn, seconds)
            out = _timed(fn, calls[batch, path], batch)
            if path == "dataset":
                out["in_flight"] = chosen[batch]
            print(json.dumps({"batch": batch, "path": path, **out}), flush=True)
            del fn  # the iterator with it, before the next one starts
        current.clear()
        client = None
    finally:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


class ReverbProxy:
    """The client side of ``--reverb-worker`` run under another interpreter."""

    def __init__(self, python: str, log_path: Path, in_flight: int | None) -> None:
        from _common import log

        cmd = [python, __file__, "--reverb-worker"]
        if in_flight:
            cmd += ["--reverb-in-flight", str(in_flight)]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        first = self.proc.stdout.readline()
        if not first:
            self.close()
            raise RuntimeError(f"the Reverb worker exited:\n{self.tail()}")
        info = json.loads(first)
        log(
            f"reverb: {info['ready']} items filled in {info['fill_s']:.1f} s "
            f"({time.perf_counter() - t0:.1f} s with start-up)"
        )

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def measure(self, batch: int, path: str, seconds: float) -> dict[str, float]:
        self.proc.stdin.write(json.dumps({"batch": batch, "path": path, "seconds": seconds}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Reverb worker exited:\n{self.tail()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- millpond and TorchRL -------------------------------------------------------------------
def make_episodes(n: int, seed: int = 0):
    """``n`` episodes of :data:`EPISODE_LEN` steps: (observations ``[L+1, 4, 84, 84]``,
    actions, terminated) each; the last observation is the one after the last step."""
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        obs = torch.from_numpy(rng.integers(0, 256, (EPISODE_LEN + 1, *OBS_SHAPE), dtype=np.uint8))
        action = torch.from_numpy(rng.integers(0, 6, EPISODE_LEN))
        term = torch.zeros(EPISODE_LEN, 1, dtype=torch.bool)
        term[-1] = True
        out.append((obs, action, term))
    return out


def fill_millpond(client, episodes) -> int:
    import torch
    from tensordict import TensorDict

    from millpond import TableConfig

    client.create_table(TableConfig.uniform(TABLE, CAPACITY, seed=0))
    with client.writer(TABLE, "sweep-0") as writer:
        for e, (obs, action, term) in enumerate(episodes):
            steps = TensorDict(
                {
                    "observation": obs[:-1],
                    "action": action,
                    "next": {
                        "reward": torch.ones(EPISODE_LEN, 1),
                        "terminated": term,
                        "truncated": torch.zeros(EPISODE_LEN, 1, dtype=torch.bool),
                    },
                },
                [EPISODE_LEN],
            )
            writer.write_segment(steps, TensorDict({"observation": obs[-1]}, []), e, 0)
        writer.flush(300)
    return int(client.info(TABLE)["size"])


def fill_torchrl(rb, episodes) -> None:
    """One ``extend`` per episode of TED chunks (next observation stored)."""
    import torch
    from _common import collector_batch, ted_chunk

    L = EPISODE_LEN
    for e, (obs, action, term) in enumerate(episodes):
        batch = collector_batch(
            obs[None, :-1],
            obs[None, 1:],
            action[None],
            torch.ones(1, L, 1),
            term[None],
            torch.zeros(1, L, 1, dtype=torch.bool),
            torch.full((1, L), e, dtype=torch.int64),
            torch.arange(L)[None],
        )
        rb.extend(ted_chunk(batch))


#: Batches of slots the bare gather cycles through: rows as random as the sampled ones (one
#: batch gathered over and over would stay in the CPU's caches).
BARE_BATCHES = 32


def bare_gather(colocated, batch: int) -> Callable[[], object]:
    """The observations and next observations of colocated batches' slots (a new batch's
    each call, :data:`BARE_BATCHES` in turn), gathered straight from the table's column
    file, held as tensors as a batch holds them."""
    import torch

    from millpond.storage_format import COLUMN_INDEX, COLUMNS_DIR

    info = colocated.info(TABLE)
    directory = Path(info["shards"][0]["storage_dir"])
    index = json.loads((directory / COLUMNS_DIR / COLUMN_INDEX).read_text())
    file = next(c["file"] for c in index["columns"] if c["key"] == ["observation"])
    column = np.memmap(
        directory / COLUMNS_DIR / file,
        dtype=np.uint8,
        mode="r",
        shape=(info["config"].capacity, *OBS_SHAPE),
    )
    drawn = [colocated.sample(TABLE, batch)["index", "slot"].numpy() for _ in range(BARE_BATCHES)]
    calls = [0]

    def fn():
        slots = drawn[calls[0] % BARE_BATCHES]
        calls[0] += 1
        obs = torch.from_numpy(np.take(column, slots, axis=0))
        nxt = torch.from_numpy(np.take(column, slots + 1, axis=0))
        return obs, nxt

    return fn


def raw_ceiling(channel, address: str, batch: int) -> Callable[[], object]:
    """One message as large as millpond's wire answer to ``sample(table, batch)`` (its bytes
    measured once, undecoded), sent by a gRPC server doing nothing else: the ceiling the
    wire path is held to."""
    import grpc
    from _common import grpc_options, raw_source, response_bytes

    from millpond.protos import millpond_pb2 as pb

    with grpc.insecure_channel(address, options=grpc_options()) as probe:
        request = pb.SampleRequest(table=TABLE, batch_size=batch, num_batches=1)
        size = response_bytes(probe, request)
    fetch = raw_source(channel)
    return lambda: fetch(size)


# -- the run --------------------------------------------------------------------------------
PREFETCH = 4  # iterate's requests in flight
WIRE = "millpond wire"
COLOCATED = "millpond colocated"
WIRE_ITERATE = "millpond wire, iterate"
COLOCATED_ITERATE = "millpond colocated, iterate"
BARE = "bare memmap gather"
RAW = "raw gRPC, millpond wire's bytes"
TORCHRL = "torchrl-ray"
REVERB_DS = "reverb TrajectoryDataset"
REVERB_CLIENT = "reverb Client.sample"
ORDER = [
    WIRE,
    COLOCATED,
    WIRE_ITERATE,
    COLOCATED_ITERATE,
    BARE,
    RAW,
    TORCHRL,
    REVERB_DS,
    REVERB_CLIENT,
]


def run(args, batches: list[int], root: Path) -> dict[tuple[str, int], list[dict[str, float]]]:
    import contextlib
    import functools

    import grpc
    from _common import ServerProcess, grpc_options, log, millpond_serve, quiet_torchrl, start_ray

    from millpond import ReplayClient

    quiet_torchrl()
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        episodes = make_episodes(CAPACITY // (EPISODE_LEN + 1))
        log(f"{len(episodes)} episodes of {EPISODE_LEN} steps ({time.perf_counter() - t0:.1f} s)")
        server = stack.enter_context(millpond_serve(root))
        address = server.addresses[0]
        wire = ReplayClient(address, max_message_mb=256, colocated=False, timeout_s=60)
        stack.callback(wire.close)
        colocated = ReplayClient(address, max_message_mb=256, colocated=True, timeout_s=60)
        stack.callback(colocated.close)
        raw = stack.enter_context(
            ServerProcess(
                [sys.executable, __file__, "--raw-server"], root / "raw.log", "raw gRPC source"
            )
        )
        raw_channel = grpc.insecure_channel(raw.addresses[0], options=grpc_options())
        stack.callback(raw_channel.close)
        t0 = time.perf_counter()
        size = fill_millpond(wire, episodes)
        log(f"millpond: {size} transitions filled ({time.perf_counter() - t0:.1f} s)")

        def iterating(client, b: int) -> Callable[[], object]:
            """Batches of ``client.iterate`` (4 requests in flight, as Reverb's dataset keeps
            samples in flight): the learner's wait for each."""
            batches = client.iterate(TABLE, b, prefetch=PREFETCH)
            stack.callback(batches.close)
            return lambda: next(batches)

        systems: dict[str, Callable[[int], Callable[[], object]]] = {
            WIRE: lambda b: lambda: wire.sample(TABLE, b),
            COLOCATED: lambda b: lambda: colocated.sample(TABLE, b),
            WIRE_ITERATE: lambda b: iterating(wire, b),
            COLOCATED_ITERATE: lambda b: iterating(colocated, b),
            BARE: lambda b: bare_gather(colocated, b),
            RAW: lambda b: raw_ceiling(raw_channel, address, b),
        }
        if "torchrl" not in args.skip:
            import ray
            from torchrl.data import LazyMemmapStorage, RandomSampler, RayReplayBuffer

            t0 = time.perf_counter()
            start_ray()
            stack.callback(ray.shutdown)
            scratch = root / "torchrl"
            scratch.mkdir()
            rb = RayReplayBuffer(
                storage=functools.partial(LazyMemmapStorage, CAPACITY, scratch_dir=str(scratch)),
                sampler=RandomSampler,
                batch_size=REF_BATCH,
                remote_config={"num_cpus": 1},
            )
            stack.callback(rb.close)
            fill_torchrl(rb, episodes)
            log(f"torchrl-ray: {len(rb)} transitions filled ({time.perf_counter() - t0:.1f} s)")
            systems[TORCHRL] = lambda b: lambda: rb.sample(b)
        del episodes
        reverb = None
        if args.reverb_python:
            reverb = ReverbProxy(args.reverb_python, root / "reverb.log", args.reverb_in_flight)
            stack.callback(reverb.close)

        first = colocated.sample(TABLE, REF_BATCH)
        assert colocated._sampler._colocation._readers, "the colocated client must read files"
        for batch in (first, wire.sample(TABLE, REF_BATCH)):
            assert batch["next", "observation"].shape == (REF_BATCH, *OBS_SHAPE), batch
        if TORCHRL in systems:
            check = rb.sample(REF_BATCH)
            assert check["next", "observation"].shape == (REF_BATCH, *OBS_SHAPE), check

        fns: dict[tuple[str, int], Callable[[], object]] = {}
        calls: dict[tuple[str, int], int] = {}
        names = list(systems) + ([REVERB_DS, REVERB_CLIENT] if reverb else [])
        for rep in range(args.reps):
            t_rep = time.perf_counter()
            for batch in batches:
                shift = rep % len(names)
                for name in names[shift:] + names[:shift]:
                    key = (name, batch)
                    if name in (REVERB_DS, REVERB_CLIENT):
                        path = "dataset" if name == REVERB_DS else "client"
                        out = reverb.measure(batch, path, args.rep_seconds)
                    else:
                        if key not in fns:
                            fns[key] = systems[name](batch)
                            calls[key] = _calls_for(fns[key], args.rep_seconds)
                        out = _timed(fns[key], calls[key], batch)
                    results.setdefault(key, []).append(out)
            log(f"repetition {rep + 1}/{args.reps} ({time.perf_counter() - t_rep:.0f} s)")
    return results


def summarize(results) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    for key, reps in results.items():
        out[key] = {m: float(np.median([r[m] for r in reps])) for m in ("trs", "p50", "p99")}
        if "in_flight" in reps[0]:
            out[key]["in_flight"] = reps[0]["in_flight"]
    return out


def render(summary, batches, args, argv, load, seconds) -> str:
    import grpc
    import torch
    from _common import code_version, load_average

    versions = [
        f"Python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"grpcio {grpc.__version__}",
    ]
    if any(k[0] == TORCHRL for k in summary):
        import ray
        import torchrl

        versions += [f"torchrl {torchrl.__version__}", f"ray {ray.__version__}"]
    if args.reverb_python:
        out = subprocess.run(
            [
                args.reverb_python,
                "-c",
                "import importlib.metadata as m; print(m.version('dm-reverb'), "
                "m.version('tensorflow'))",
            ],
            capture_output=True,
            text=True,
        ).stdout.split()
        if len(out) == 2:
            versions += [f"dm-reverb {out[0]}", f"tensorflow {out[1]}"]
    cpu = platform.processor() or platform.machine()
    machine = (
        f"{os.cpu_count()} cores ({cpu}), {', '.join(versions)}; everything on loopback. "
        f"{load_average(load)}."
    )
    names = [n for n in ORDER if (n, batches[0]) in summary]
    if args.reverb_in_flight:
        in_flight = f"{args.reverb_in_flight} (`--reverb-in-flight`)"
    else:
        picks = ", ".join(
            f"{summary[REVERB_DS, b]['in_flight']} at B={b}"
            for b in batches
            if (REVERB_DS, b) in summary
        )
        in_flight = f"the fastest of 64, 256, B and 2B for each B: {picks}"
    lines = [
        f"Command: `python benchmarks/sample_sweep.py {' '.join(argv)}`",
        "",
        f"Machine: {machine} Run took {seconds:.0f} s.",
        "",
        f"millpond code: {code_version(['service', 'learner', 'protos', 'millpond'])}. "
        f"~{CAPACITY} transitions of uint8{list(OBS_SHAPE)} in {EPISODE_LEN}-step episodes; "
        f"median of {args.reps} repetitions (~{args.rep_seconds} s of back-to-back calls per "
        "system and batch size each); millpond and TorchRL batches include the next "
        "observation, Reverb's items do not (half the observation bytes). Reverb's "
        "TrajectoryDataset keeps samples in flight (one worker; "
        f"max_in_flight_samples_per_worker {in_flight}), as millpond's `iterate` keeps "
        f"{PREFETCH} requests in flight; the others are one synchronous call per batch.",
        "",
        "| B | system | transitions/s | p50 ms | p99 ms | p99/p50 | vs millpond wire |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        ref = summary[WIRE, batch]["trs"]
        for name in names:
            s = summary[name, batch]
            lines.append(
                f"| {batch} | {name} | {s['trs']:,.0f} | {s['p50']:.2f} | {s['p99']:.2f} | "
                f"{s['p99'] / s['p50']:.2f} | {s['trs'] / ref:.2f}x |"
            )
    if REF_BATCH in batches:
        b = REF_BATCH
        ref = summary[WIRE, b]["trs"]
        lines += ["", f"At B={b}:", ""]
        for name in names:
            s = summary[name, b]
            lines.append(
                f"- {name}: {s['trs']:,.0f} transitions/s, {s['trs'] / ref:.2f}x millpond wire, "
                f"p99/p50 {s['p99'] / s['p50']:.2f}"
            )
        col, bare = summary[COLOCATED, b]["trs"], summary[BARE, b]["trs"]
        lines.append(
            f"- millpond colocated reaches {col / bare:.2f} of the bare memmap gather's "
            f"transitions/s (its time per batch is {bare / col:.2f}x the gather's)"
        )
        rv = [n for n in (REVERB_DS, REVERB_CLIENT) if n in names]
        if rv:
            best = max(rv, key=lambda n: summary[n, b]["trs"])
            mine = {
                n: summary[n, b]["trs"] / summary[best, b]["trs"]
                for n in (WIRE, WIRE_ITERATE, COLOCATED, COLOCATED_ITERATE)
                if (n, b) in summary
            }
            lines.append(
                f"- Reverb's best path is {best}; against it: "
                + ", ".join(f"{n} {r:.2f}x" for n, r in mine.items())
            )
            if BARE in names:
                lines.append(
                    f"- the bare memmap gather (no RPC, no checks) is "
                    f"{summary[BARE, b]['trs'] / summary[best, b]['trs']:.2f}x {best}"
                )
            if RAW in names:
                lines.append(
                    f"- raw gRPC moving millpond's wire bytes is "
                    f"{summary[RAW, b]['trs'] / summary[best, b]['trs']:.2f}x {best}"
                )
        if RAW in names:
            raw = summary[RAW, b]["trs"]
            lines.append(
                f"- millpond wire reaches {summary[WIRE, b]['trs'] / raw:.2f} of the raw gRPC "
                f"ceiling for its bytes ({raw:,.0f} transitions/s)"
                + (
                    f", `iterate` {summary[WIRE_ITERATE, b]['trs'] / raw:.2f}"
                    if WIRE_ITERATE in names
                    else ""
                )
            )
    return "\n".join(lines) + "\n", machine


def plot(summary, batches, machine: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    styles = {BARE: ":", RAW: ":", REVERB_CLIENT: "--"}
    for name in ORDER:
        if (name, batches[0]) not in summary:
            continue
        ys = [summary[name, b]["trs"] for b in batches]
        ax.plot(batches, ys, styles.get(name, "-"), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size B (transitions per sample call)")
    ax.set_ylabel("transitions/s (median over repetitions)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    title = (
        "Atari-shaped sampling (uint8[4,84,84]; next observation included except Reverb). "
        + machine
    )
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 90 s)")
    ap.add_argument("--out", type=Path, help="also write the table as markdown to this file")
    ap.add_argument("--dir", type=Path, help="parent of the temporary data directory (/tmp)")
    ap.add_argument("--plot", type=Path, help="write the figure (PNG) to this path")
    ap.add_argument("--batch-sizes", default=None, help=f"comma-separated (default {BATCH_SIZES})")
    ap.add_argument("--reps", type=int, help="repetitions (default 5; quick 1)")
    ap.add_argument(
        "--rep-seconds", type=float, help="seconds per system, batch and repetition (0.5)"
    )
    ap.add_argument("--skip", default="", help="comma-separated systems to leave out: torchrl")
    ap.add_argument(
        "--reverb-python",
        help="a Python interpreter with dm-reverb and tensorflow: adds Reverb (a worker "
        "process under it runs this file with --reverb-worker)",
    )
    ap.add_argument(
        "--reverb-in-flight",
        type=int,
        help="TrajectoryDataset's max_in_flight_samples_per_worker (default: the fastest of "
        "64, 256, B and 2B, tried for each batch size B)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (1)")
    ap.add_argument("--reverb-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reverb-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_server:
        from _common import serve_raw_source

        return serve_raw_source()
    if args.reverb_server:
        return reverb_server()
    if args.reverb_worker:
        return reverb_worker(args.reverb_in_flight)

    import torch
    from _common import emit_report, log, scratch_root

    from millpond.allocator import keep_freed_buffers

    keep_freed_buffers()  # as millpond's processes (learners included) do
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in (args.batch_sizes or BATCH_SIZES).split(",") if x]
    if args.quick and args.batch_sizes is None:
        batches = [32, 256, 1024]
    args.reps = args.reps or (1 if args.quick else 5)
    args.rep_seconds = args.rep_seconds or (0.15 if args.quick else 0.5)
    args.skip = {x for x in args.skip.split(",") if x}
    print(f"$ python benchmarks/sample_sweep.py {' '.join(argv)}", file=sys.stderr)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with scratch_root(args.dir, "millpond-sweep-") as root:
        results = run(args, batches, root)
    summary = summarize(results)
    report, machine = render(
        summary, batches, args, argv, (load_before, os.getloadavg()), time.perf_counter() - t0
    )
    if args.plot:
        plot(summary, batches, machine, args.plot)
        log(f"plot: {args.plot}")
    emit_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
