"""Collection benchmark: frames/s of millpond's env loop vs bare gymnasium and TorchRL's collector.

Everything runs on this machine in one run, with a random policy and P = 8 env lanes in one
gymnasium sync vector env with SAME_STEP autoreset (what the actor builds by default),
collected in chunks of T = 64 steps per lane (512 frames):

* ``gymnasium``: bare vector-env stepping, no sink — ``gymnasium.make_vec(env, 8, "sync")``,
  ``env.action_space.sample()``, ``env.step``. The ceiling.
* ``millpond-collect``: :meth:`millpond.actors.Collector.collect` only (the loop, no sink):
  a diagnostic row that separates the loop's cost from the writing.
* ``millpond-serve``: a :class:`~millpond.actors.Collector` in this process writing through
  ``client.writer(table)`` to a real ``millpond serve`` subprocess (one shard, loopback):
  the in-process actor. Each repetition ends with ``writer.flush()`` and counts it.
* ``millpond-table``: the same Collector writing into an in-process :class:`millpond.Table`
  through :class:`~millpond.actors.TableSink` (CartPole only; diagnostic).
* ``fleet-1``, ``fleet-2``: an :class:`~millpond.actors.fleet.ActorFleet` of 1 or 2 Ray env
  actors (``ray.init(num_cpus=2)``, one CPU each) writing to the same server; the
  frames the driver has been told about per wall-clock second. The bare rate these rows are
  compared with is measured interleaved with them (the actors idle meanwhile).
* ``torchrl-*``: TorchRL's ``torchrl.collectors.Collector`` with
  ``RandomPolicy(env.action_spec)`` and ``frames_per_batch = 512`` over three env kinds:
  ``SerialEnv(8, GymEnv("CartPole-v1"))`` (``serial``), ``GymWrapper`` of the same sync
  SAME_STEP gymnasium vector env (``vec``), and ``GymEnv("CartPole-v1", num_envs=8)``, which
  is a gymnasium ``AsyncVectorEnv`` of 8 subprocesses (``async``; not in ``--quick``). Each
  with no sink (iterate batches) and ``+rb``: every batch also ``extend``-ed into a
  ``ReplayBuffer(LazyMemmapStorage)``.

for two envs: ``CartPole-v1``, and an Atari-shaped synthetic env (uint8[4, 84, 84]
observations: a preallocated random frame; episodes of 100-1000 steps, uniform; 6 actions)
compared bare vs millpond (in-process and ``fleet-1``).

Measurement: each repetition runs whole chunks (batches) for about ``--seconds`` and counts
frames per second; the table reports the median (and the range) of the repetitions. The
in-process systems' repetitions are interleaved (one repetition of each system in turn), so
that a slow phase of the machine does not land on one system only; each system gets one
untimed warm-up repetition. After the run, the server's insert counters are checked against
the frames each millpond system wrote.

Run ``python benchmarks/collect.py`` (about 4 minutes on 2 cores; see ``--help``), or
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
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from _common import (
    add_common_args,
    emit_report,
    load_average,
    log,
    millpond_serve,
    quiet_torchrl,
    scratch_root,
    settle,
    status,
)
from _common import code_version as measured_code_version
from gymnasium.vector import AutoresetMode

LANES = 8  # P
CHUNK_LEN = 64  # T
CARTPOLE = "CartPole-v1"
SHAPES = ("cartpole", "atari")
INPROC = ("gymnasium", "millpond-collect", "millpond-serve", "millpond-table")
TORCHRL_ENVS = ("serial", "vec", "async")
FLEETS = ("fleet-1", "fleet-2")
SYSTEMS = (
    *INPROC,
    *FLEETS,
    *(f"torchrl-{k}{rb}" for k in TORCHRL_ENVS for rb in ("", "+rb")),
)
QUICK_SKIP = ("torchrl-async", "torchrl-async+rb")
ATARI_SYSTEMS = ("gymnasium", "millpond-collect", "millpond-serve", "fleet-1")
# Targets from the issue.
TARGET_VS_BARE = 0.7  # millpond actor frames/s, share of bare gymnasium stepping
TARGET_VS_TORCHRL = 5.0  # millpond actor frames/s vs TorchRL's collector


# -- envs ----------------------------------------------------------------------------------------
class AtariShapedEnv(gym.Env):
    """uint8[4, 84, 84] observations (one preallocated random frame), episodes of 100-1000 steps."""

    metadata = {"render_modes": []}

    def __init__(self, seed: int = 0) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.action_space = gym.spaces.Discrete(6)
        self._frame = np.random.default_rng(seed).integers(0, 256, (4, 84, 84), dtype=np.uint8)
        self._left = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._left = int(self.np_random.integers(100, 1001))
        return self._frame, {}

    def step(self, action):
        self._left -= 1
        return self._frame, 0.0, self._left <= 0, False, {}


def make_vector_env(shape: str, lanes: int = LANES) -> gym.vector.VectorEnv:
    """The vector env every system steps: sync, SAME_STEP autoreset (the actor's default)."""
    if shape == "cartpole":
        return gym.make_vec(
            CARTPOLE,
            num_envs=lanes,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
        )
    return gym.vector.SyncVectorEnv(
        [functools.partial(AtariShapedEnv, seed=i) for i in range(lanes)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )


# -- processes -----------------------------------------------------------------------------------
def capacity_of(shape: str) -> int:
    """Table capacity in slots: a ring the runs overwrite (Atari: ~460 MB of frames)."""
    return 1_000_000 if shape == "cartpole" else 16_384


# -- systems ---------------------------------------------------------------------------------
@dataclasses.dataclass
class System:
    """One thing to measure: ``rep(seconds) -> (frames, seconds taken)``."""

    name: str
    shape: str
    rep: Callable[[float], tuple[int, float]]
    close: Callable[[], None] = lambda: None
    check: Callable[[], str | None] = lambda: None  # an error message, or None
    rates: list[float] = dataclasses.field(default_factory=list)
    note: str = ""


def run_chunks(seconds: float, chunk: Callable[[], int]) -> tuple[int, float]:
    """Call ``chunk()`` (returns frames) until ``seconds`` have passed; (frames, elapsed)."""
    t0 = time.perf_counter()
    frames = 0
    while True:
        frames += chunk()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return frames, dt


def bare_system(shape: str, lanes: int, chunk_len: int, seed: int = 0) -> System:
    env = make_vector_env(shape, lanes)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    sample, step = env.action_space.sample, env.step

    def chunk() -> int:
        for _ in range(chunk_len):
            step(sample())
        return lanes * chunk_len

    return System("gymnasium", shape, functools.partial(run_chunks, chunk=chunk), close=env.close)


def collector_system(
    name: str, shape: str, lanes: int, chunk_len: int, sink=None, client=None, table=None
) -> System:
    from millpond.actors import Collector

    collector = Collector(
        functools.partial(make_vector_env, shape, lanes), sink, chunk_len=chunk_len, seed=0
    )
    frames = lanes * chunk_len

    def collect() -> int:
        collector.collect()
        return frames

    def collect_and_write() -> int:
        collector.run_chunk()
        return frames

    def rep(seconds: float) -> tuple[int, float]:
        t0 = time.perf_counter()
        n, _ = run_chunks(seconds, collect if sink is None else collect_and_write)
        if sink is not None:
            sink.flush()  # part of the repetition: what was written is stored
        return n, time.perf_counter() - t0

    def close() -> None:
        collector.close()
        if hasattr(sink, "close"):
            sink.close(60)

    def check() -> str | None:
        if sink is None:
            return None
        inserts = (
            client.info(table)["inserts"] if client is not None else sink.table.info()["inserts"]
        )
        if inserts != collector.steps_written:
            return (
                f"{name} [{shape}]: {inserts} inserts counted where the loop wrote "
                f"{collector.steps_written} steps"
            )
        return None

    return System(name, shape, rep, close=close, check=check)


def torchrl_systems(
    kind: str, lanes: int, chunk_len: int, root: Path
) -> tuple[list[System], Callable[[], None]]:
    """TorchRL's Collector over env ``kind``: no sink, and extending a memmap ReplayBuffer.

    Both systems share one collector (and its iterator); returns them and the closer.
    """
    from torchrl.collectors import Collector
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    from torchrl.envs import GymEnv, GymWrapper, SerialEnv
    from torchrl.envs.utils import RandomPolicy

    t0 = time.perf_counter()
    if kind == "serial":
        env = SerialEnv(lanes, functools.partial(GymEnv, CARTPOLE))
    elif kind == "vec":
        env = GymWrapper(make_vector_env("cartpole", lanes))
    else:
        env = GymEnv(CARTPOLE, num_envs=lanes)  # a gymnasium AsyncVectorEnv
    env.set_seed(0)
    frames = lanes * chunk_len
    collector = Collector(
        env, RandomPolicy(env.action_spec), frames_per_batch=frames, total_frames=-1
    )
    it = iter(collector)
    first = next(it)
    if first.numel() != frames:
        raise AssertionError(f"torchrl {kind}: a batch of {list(first.shape)}, expected {frames}")
    capacity = 1_000_000
    rb = ReplayBuffer(
        storage=LazyMemmapStorage(capacity, scratch_dir=str(root / f"torchrl-{kind}"))
    )
    log(f"torchrl-{kind}: ready, batches of {list(first.shape)} ({time.perf_counter() - t0:.1f} s)")
    extended = [0]

    def plain() -> int:
        return next(it).numel()

    def extend() -> int:
        batch = next(it)
        rb.extend(batch.reshape(-1))
        extended[0] += batch.numel()
        return batch.numel()

    def close() -> None:
        collector.shutdown()
        with contextlib.suppress(Exception):
            env.close()

    def check() -> str | None:
        held = min(extended[0], capacity)
        if len(rb) != held:
            return f"torchrl-{kind}+rb: the buffer holds {len(rb)} transitions, expected {held}"
        return None

    return [
        System(f"torchrl-{kind}", "cartpole", functools.partial(run_chunks, chunk=plain)),
        System(
            f"torchrl-{kind}+rb",
            "cartpole",
            functools.partial(run_chunks, chunk=extend),
            check=check,
        ),
    ], close


# -- measurement -----------------------------------------------------------------------------
def measure(systems: list[System], reps: int, seconds: float, label: str = "") -> None:
    """One untimed warm-up repetition each, then ``reps`` interleaved timed repetitions."""
    for sys_ in systems:
        settle()
        frames, dt = sys_.rep(min(seconds, 0.5))
        log(f"[{sys_.shape}] {sys_.name}{label}: warm-up {frames / dt:,.0f} frames/s")
    for rep in range(reps):
        for sys_ in systems:
            settle()
            frames, dt = sys_.rep(seconds)
            sys_.rates.append(frames / dt)
            log(
                f"[{sys_.shape}] {sys_.name}{label} rep {rep + 1}/{reps}: "
                f"{frames / dt:,.0f} frames/s ({frames:,} frames in {dt:.2f} s)"
            )


def fleet_rep(fleet, seconds: float) -> tuple[int, float]:
    """Keep the fleet busy for ``seconds``; frames reported per second, until the last report.

    The actors were idle at the start; at the end, the calls in flight finish on their own
    (their frames are not counted), so the caller waits a moment before measuring anything else.
    """
    start = fleet.status.frames
    t0 = time.perf_counter()
    t_last, frames = t0, start
    while time.perf_counter() - t0 < seconds or frames == start:
        if time.perf_counter() - t0 > seconds + 120:
            raise RuntimeError("the fleet reported no frames for two minutes")
        status = fleet.poll(timeout_s=1.0)
        if status.frames != frames:
            frames, t_last = status.frames, time.perf_counter()
    return frames - start, t_last - t0


def run_fleets(
    client,
    shapes: list[str],
    fleets: list[tuple[str, int]],
    bare: dict[str, System],
    reps: int,
    seconds: float,
    lanes: int,
    chunk_len: int,
    chunks_per_call: int = 1,
) -> list[tuple[System, System]]:
    """Each fleet in turn, its repetitions interleaved with fresh bare repetitions."""
    import ray

    from millpond import TableConfig
    from millpond.actors.fleet import ActorFleet
    from millpond.actors.ray_actor import ActorConfig

    out: list[tuple[System, System]] = []
    t0 = time.perf_counter()
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
    )
    log(f"ray: started ({time.perf_counter() - t0:.1f} s)")
    try:
        for shape, n in fleets:
            if shape not in shapes:
                continue
            name = f"fleet-{n}"
            table = f"{shape}-{name}"
            client.create_table(TableConfig.uniform(table, capacity_of(shape)))
            env = functools.partial(make_vector_env, shape, lanes) if shape == "atari" else CARTPOLE
            config = ActorConfig(env=env, table=table, num_envs=lanes, chunk_len=chunk_len, seed=0)
            t1 = time.perf_counter()
            fleet = ActorFleet(
                client, config, num_actors=n, num_cpus=1, chunks_per_call=chunks_per_call
            )
            try:
                # Warm-up: every actor started (imports, env, writer handshake) and ran chunks.
                warm = n * 3 * lanes * chunk_len
                status = fleet.run(frames=warm, timeout_s=180)
                if status.frames < warm:
                    raise RuntimeError(f"{name} [{shape}]: {status.frames} frames in 180 s")
                log(f"[{shape}] {name}: started and warm ({time.perf_counter() - t1:.1f} s)")
                time.sleep(0.5)
                ref = bare[shape]
                interleaved = System("gymnasium", shape, ref.rep, note=f"beside {name}")
                sys_ = System(name, shape, functools.partial(fleet_rep, fleet))
                for rep in range(reps):
                    for s in (interleaved, sys_):
                        settle()
                        frames, dt = s.rep(seconds)
                        s.rates.append(frames / dt)
                        log(
                            f"[{shape}] {s.name}{' (' + s.note + ')' if s.note else ''} "
                            f"rep {rep + 1}/{reps}: {frames / dt:,.0f} frames/s"
                        )
                        if s is sys_:  # let the calls in flight finish (their chunks)
                            time.sleep(0.3 * chunks_per_call)
            finally:
                final = fleet.stop()
            inserts = client.info(table)["inserts"]
            written = sum(a["steps_written"] for a in final.actors.values())
            if inserts != final.frames or written != final.frames:
                raise AssertionError(
                    f"{name} [{shape}]: {final.frames} frames collected, {written} written, "
                    f"{inserts} counted by the server"
                )
            log(f"[{shape}] {name}: {final.frames:,} frames, all stored; restarts {final.restarts}")
            out.append((sys_, interleaved))
    finally:
        ray.shutdown()
    return out


# -- report ----------------------------------------------------------------------------------
DESCRIPTIONS = {
    "gymnasium": "bare `make_vec(sync)` stepping, no sink",
    "millpond-collect": "`Collector.collect()` only, no sink",
    "millpond-serve": "`Collector` → `client.writer()` → `millpond serve`",
    "millpond-table": "`Collector` → `TableSink` (in-process `Table`)",
    "fleet-1": "`ActorFleet`, 1 Ray actor → `millpond serve`",
    "fleet-2": "`ActorFleet`, 2 Ray actors → `millpond serve`",
    "torchrl-serial": "TorchRL `Collector`, `SerialEnv(8 x GymEnv)`, no sink",
    "torchrl-serial+rb": "the same + `ReplayBuffer(LazyMemmapStorage).extend`",
    "torchrl-vec": "TorchRL `Collector`, `GymWrapper(make_vec(sync))`, no sink",
    "torchrl-vec+rb": "the same + `ReplayBuffer(LazyMemmapStorage).extend`",
    "torchrl-async": "TorchRL `Collector`, `GymEnv(num_envs=8)` (async, 8 processes), no sink",
    "torchrl-async+rb": "the same + `ReplayBuffer(LazyMemmapStorage).extend`",
}


def render(
    rows: list[tuple[System, System]],
    argv: list[str],
    load: tuple[tuple[float, ...], tuple[float, ...]],
    seconds: float,
    code_version: str,
    settings: str,
) -> str:
    """``rows``: (system, the bare system it is compared with)."""
    import ray
    import tensordict
    import torchrl

    cpu = platform.processor() or platform.machine()
    lines = [
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__} (1 intra-op thread), gymnasium {gym.__version__}, "
        f"tensordict {tensordict.__version__}, torchrl {torchrl.__version__}, ray {ray.__version__}. "
        f"{load_average(load)}. Run took {seconds:.0f} s.",
        "",
        f"millpond code: {code_version}. {settings}",
        "",
    ]
    torchrl_best = max(
        (s for s, _ in rows if s.name.startswith("torchrl-") and not s.name.endswith("+rb")),
        key=lambda s: statistics.median(s.rates),
        default=None,
    )
    lines.append(
        "| env | system | what | frames/s (median) | range | vs bare gymnasium | vs best TorchRL |"
    )
    lines.append("|" + "---|" * 7)
    for shape in SHAPES:
        for s, ref in rows:
            if s.shape != shape:
                continue
            med = statistics.median(s.rates)
            bare_med = statistics.median(ref.rates)
            vs_bare = f"{med / bare_med:.2f}x" + (" †" if ref.note else "")
            vs_tr = "-"
            if (
                torchrl_best is not None
                and shape == "cartpole"
                and not s.name.startswith("torchrl")
            ):
                vs_tr = f"{med / statistics.median(torchrl_best.rates):.1f}x"
            lines.append(
                f"| {shape} | {s.name} | {DESCRIPTIONS[s.name]} | {med:,.0f} "
                f"| {min(s.rates):,.0f}-{max(s.rates):,.0f} | {vs_bare} | {vs_tr} |"
            )
    notes = sorted(
        {
            f"{ref.shape} {ref.note}: {statistics.median(ref.rates):,.0f}"
            for _, ref in rows
            if ref.note
        }
    )
    if notes:
        lines.append("")
        lines.append(
            "† against bare gymnasium measured interleaved with that fleet's repetitions "
            "(median frames/s: " + "; ".join(notes) + ")."
        )
    if torchrl_best is not None:
        lines.append("")
        lines.append(
            f"Best TorchRL configuration without a sink: {torchrl_best.name} "
            f"({statistics.median(torchrl_best.rates):,.0f} frames/s)."
        )
    lines.append("")
    lines += targets(rows, torchrl_best)
    lines.append("")
    lines.append("Command: `python " + " ".join(["benchmarks/collect.py", *argv]) + "`")
    return "\n".join(lines) + "\n"


def targets(rows: list[tuple[System, System]], torchrl_best: System | None) -> list[str]:
    out = ["Targets (CartPole):", ""]
    by = {(s.name, s.shape): (s, ref) for s, ref in rows}
    for name in ("millpond-serve", "fleet-1"):
        if (name, "cartpole") not in by:
            continue
        s, ref = by[name, "cartpole"]
        med, bare_med = statistics.median(s.rates), statistics.median(ref.rates)
        ratio = med / bare_med
        out.append(
            f"- {name} >= {TARGET_VS_BARE}x bare gymnasium: {status(ratio >= TARGET_VS_BARE)} — "
            f"{ratio:.2f}x ({med:,.0f} vs {bare_med:,.0f} frames/s)."
        )
        if torchrl_best is not None:
            tr = statistics.median(torchrl_best.rates)
            ratio = med / tr
            out.append(
                f"- {name} >= {TARGET_VS_TORCHRL:.0f}x TorchRL's collector: "
                f"{status(ratio >= TARGET_VS_TORCHRL)} — {ratio:.1f}x the best TorchRL "
                f"configuration ({torchrl_best.name}, {tr:,.0f} frames/s)."
            )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "small smoke run (< 90 s)")
    ap.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; quick: all but "
        "torchrl-async)",
    )
    ap.add_argument("--lanes", type=int, default=LANES, help="env lanes P (default 8)")
    ap.add_argument("--chunk-len", type=int, default=CHUNK_LEN, help="steps T per lane per chunk")
    ap.add_argument("--reps", type=int, help="timed repetitions (default 5; quick 2)")
    ap.add_argument("--seconds", type=float, help="seconds per repetition (default 1.5; quick 0.4)")
    ap.add_argument(
        "--chunks-per-call",
        type=int,
        default=1,
        help="chunks each fleet actor collects per Ray call (ActorFleet's default: 1)",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads in this process (1)"
    )
    args = ap.parse_args(argv)
    quick = args.quick
    shapes = [x for x in args.shapes.split(",") if x]
    if unknown := set(shapes) - set(SHAPES):
        ap.error(f"unknown shape(s) {sorted(unknown)}; choose from {SHAPES}")
    if args.systems is None:
        systems = [x for x in SYSTEMS if not (quick and x in QUICK_SKIP)]
    else:
        systems = [x for x in args.systems.split(",") if x]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    reps = args.reps or (2 if quick else 5)
    seconds = args.seconds or (0.4 if quick else 1.5)
    lanes, chunk_len = args.lanes, args.chunk_len

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    quiet_torchrl()
    torch.set_num_threads(args.threads)
    from millpond import ReplayClient, Table, TableConfig
    from millpond.service import TableSink

    code_version = measured_code_version(["actors", "learner", "service", "protos", "millpond"])
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    inproc: list[System] = []
    closers: list[Callable[[], None]] = []
    server = client = None
    with scratch_root(args.dir, "millpond-collect-bench-") as root:
        try:
            server = millpond_serve(root)
            client = ReplayClient(server.addresses, timeout_s=300)
            bare: dict[str, System] = {}
            for shape in shapes:
                bare[shape] = bare_system(shape, lanes, chunk_len)
                inproc.append(bare[shape])
                if "millpond-collect" in systems:
                    inproc.append(collector_system("millpond-collect", shape, lanes, chunk_len))
                if "millpond-serve" in systems:
                    table = f"{shape}-collector"
                    client.create_table(TableConfig.uniform(table, capacity_of(shape)))
                    writer = client.writer(table, f"bench-{shape}")
                    inproc.append(
                        collector_system(
                            "millpond-serve", shape, lanes, chunk_len, writer, client, table
                        )
                    )
                if "millpond-table" in systems and shape == "cartpole":
                    t = Table.create(root / f"table-{shape}", TableConfig.uniform("t", 1_000_000))
                    inproc.append(
                        collector_system("millpond-table", shape, lanes, chunk_len, TableSink(t))
                    )
                if shape == "cartpole":
                    for kind in TORCHRL_ENVS:
                        if f"torchrl-{kind}" in systems or f"torchrl-{kind}+rb" in systems:
                            pair, close = torchrl_systems(kind, lanes, chunk_len, root)
                            closers.append(close)
                            inproc += [p for p in pair if p.name in systems]
            measure(inproc, reps, seconds)
            rows = [(s, bare[s.shape]) for s in inproc]
            fleets = [(sh, int(f.split("-")[1])) for sh in shapes for f in FLEETS if f in systems]
            fleets = [(sh, n) for sh, n in fleets if sh == "cartpole" or n == 1]
            if fleets:
                for s, ref in run_fleets(
                    client,
                    shapes,
                    fleets,
                    bare,
                    reps,
                    seconds,
                    lanes,
                    chunk_len,
                    args.chunks_per_call,
                ):
                    rows.append((s, ref))
            errors = [e for s in inproc if (e := s.check()) is not None]
            if errors:
                raise AssertionError("; ".join(errors))
        finally:
            for close in [s.close for s in inproc] + closers:
                with contextlib.suppress(Exception):
                    close()
            if client is not None:
                client.close()
            if server is not None:
                server.stop()
    order = {name: i for i, name in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (SHAPES.index(r[0].shape), order[r[0].name]))
    settings_line = (
        f"P = {lanes} lanes, T = {chunk_len} steps per chunk ({lanes * chunk_len} frames), "
        f"{reps} repetitions of ~{seconds} s per system (median, min-max shown); fleet actors "
        f"collect {args.chunks_per_call} chunk(s) per Ray call."
    )
    report = render(
        rows,
        argv,
        (load_before, os.getloadavg()),
        time.perf_counter() - t0,
        code_version,
        settings_line,
    )
    emit_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
