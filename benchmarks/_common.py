"""Helpers the benchmark scripts share: progress lines, settling, calibration, the code
version measured, server subprocesses that print ``ADDRESSES a,b`` once serving, the common
command-line options and report plumbing, and the synthetic experience (episode layout,
collector chunks, TorchRL's TED form) that the storage and service benchmarks generate."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

OBS = "observation"


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


def settle() -> None:
    """Collect garbage and write dirty pages back, so one measurement's writeback stays its own."""
    gc.collect()
    os.sync()


def cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU time (user + system) of process ``pid`` so far, with the processes under it
    unless ``children`` is false (Linux ``/proc``; 0 where it cannot be read): what a timed
    pass costs a server whose shards run in child processes."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            if not children:
                break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_split(servers: Sequence[int]) -> tuple[float, float]:
    """CPU seconds so far of this process alone and of the processes ``servers`` (their
    pids) with theirs: a client's and its servers' shares, the servers being this process's
    children."""
    return cpu_seconds(os.getpid(), children=False), sum(cpu_seconds(p) for p in servers)


def calibrate(fn: Callable[[], object], rep_seconds: float, at_least: int = 3) -> int:
    """Warm ``fn`` up and return how many calls make one repetition of ~``rep_seconds``."""
    t0 = time.perf_counter()
    n = 0
    while n < at_least or time.perf_counter() - t0 < min(0.3, rep_seconds):
        fn()
        n += 1
    per_call = (time.perf_counter() - t0) / n
    return max(at_least, int(rep_seconds / per_call))


#: The standard Atari preprocessing of the shipped configs: 84x84 grayscale, frame skip 4,
#: stacks of 4.
ATARI_WRAPPERS = [
    {
        "path": "gymnasium.wrappers:AtariPreprocessing",
        "kwargs": {"frame_skip": 4, "noop_max": 30, "terminal_on_life_loss": False},
    },
    {"path": "gymnasium.wrappers:FrameStackObservation", "kwargs": {"stack_size": 4}},
]


def collect_atari(game: str, lanes: int, chunk_len: int, chunks: int, seed: int) -> list:
    """``chunks`` TED batches ``[P, T]`` of real frames of ``game`` (random policy)."""
    from millpond.actors import Collector

    with Collector(
        game,
        None,
        num_envs=lanes,
        chunk_len=chunk_len,
        env_kwargs={"frameskip": 1},
        env_wrappers=ATARI_WRAPPERS,
        seed=seed,
    ) as collector:
        return [collector.collect() for _ in range(chunks)]


def fill_random(client, table: str, env_id: str, steps: int, seed: int = 0) -> None:
    """``steps`` or more transitions of ``env_id`` acted at random into ``table``, one
    ``client.extend`` per episode (TED rows)."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.action_space.seed(seed)
    written, episode = 0, 0
    while written < steps:
        obs, _ = env.reset(seed=seed + episode)
        rows: dict[str, list] = {
            k: [] for k in ("obs", "next", "action", "reward", "term", "trunc")
        }
        done = False
        while not done:
            action = env.action_space.sample()
            nxt, reward, term, trunc, _ = env.step(action)
            for key, value in zip(rows, (obs, nxt, action, reward, term, trunc)):
                rows[key].append(value)
            obs, done = nxt, term or trunc
        n = len(rows["action"])
        client.extend(
            table,
            TensorDict(
                {
                    "observation": torch.from_numpy(np.stack(rows["obs"])),
                    "action": torch.from_numpy(np.stack(rows["action"])),
                    "next": {
                        "observation": torch.from_numpy(np.stack(rows["next"])),
                        "reward": torch.tensor(rows["reward"]).float().unsqueeze(-1),
                        "terminated": torch.tensor(rows["term"]).unsqueeze(-1),
                        "truncated": torch.tensor(rows["trunc"]).unsqueeze(-1),
                    },
                },
                [n],
            ),
        )
        written += n
        episode += 1


def time_in_turns(
    systems: dict[str, Callable[[], object]],
    reps: int,
    calls: int,
    turns: Mapping[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
    servers: Sequence[int] = (),
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, tuple[float, float]]]:
    """``calls`` back-to-back calls of each system in turn, ``reps`` times over (so that a
    shared machine's slow phases fall on all alike): each call's latency, each system's
    total wall time, and the CPU time its calls took in this process and in the processes
    ``servers`` (their pids), in seconds.

    ``turns[name]()``, where given, is entered before that system's turn and left after it,
    untimed: a pipelined system (requests kept in flight) opens its stream there and closes
    it after, so that what it left in flight does not run during the next system's turn.
    """
    lat: dict[str, list[float]] = {name: [] for name in systems}
    wall: dict[str, float] = {name: 0.0 for name in systems}
    cpu: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in systems}
    turns = turns or {}
    for _ in range(reps):
        for name, fn in systems.items():
            with turns[name]() if name in turns else contextlib.nullcontext():
                start, cpu_start = time.perf_counter(), cpu_split(servers)
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn()
                    lat[name].append(time.perf_counter() - t0)
                wall[name] += time.perf_counter() - start
                cpu_end = cpu_split(servers)
                cpu[name] = tuple(c + e - b for c, b, e in zip(cpu[name], cpu_start, cpu_end))
    return lat, wall, cpu


def start_ray(num_cpus: int = 2) -> None:
    """``ray.init`` for a side-by-side run, tried twice: on a busy machine a node can time
    out while it starts."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            return
        except Exception as e:
            ray.shutdown()
            if attempt == 2:
                raise
            log(f"ray: {e}; trying once more")


def code_version(paths: Sequence[str]) -> str:
    """The git commit of the millpond code measured, and which of ``paths`` have local edits."""
    import millpond

    here = Path(millpond.__file__).resolve().parent.parent
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


class ServerProcess:
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

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def millpond_serve(root: Path, shards: int = 1) -> ServerProcess:
    """``millpond serve --shards N`` on free ports under ``root``."""
    d = root / f"serve-{shards}"
    cmd = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(d), "--port", "0"]
    cmd += ["--shards", str(shards)]
    return ServerProcess(cmd, root / f"serve-{shards}.log", f"millpond serve --shards {shards}")


# -- command line, scratch space, report ----------------------------------------------------
# -- the raw gRPC ceiling ------------------------------------------------------------------
RAW_SERVICE = "bench.Raw"
MiB = 1 << 20


def _identity(b: bytes) -> bytes:
    return b


def grpc_options() -> list[tuple[str, int]]:
    """Message limits of 256 MiB each way, as the benchmarks' millpond clients have."""
    return [
        ("grpc.max_send_message_length", 256 * MiB),
        ("grpc.max_receive_message_length", 256 * MiB),
    ]


def add_raw_source(server) -> None:
    """``bench.Raw/Source`` on a gRPC ``server``: a request names a size (8 bytes, little
    endian) and is answered with one message of that many random bytes (made once per
    size): gRPC moving the bytes and nothing else, the ceiling for a response that size."""
    import grpc

    payloads: dict[int, bytes] = {}

    def source(request: bytes, context):
        size = int.from_bytes(request[:8], "little")
        if size not in payloads:
            payloads[size] = os.urandom(size)
        yield payloads[size]

    handler = grpc.unary_stream_rpc_method_handler(
        source, request_deserializer=_identity, response_serializer=_identity
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(RAW_SERVICE, {"Source": handler}),)
    )


def raw_source(channel) -> Callable[[int], list[bytes]]:
    """``fetch(size)``: one ``bench.Raw/Source`` call over ``channel``, its messages."""
    call = channel.unary_stream(
        f"/{RAW_SERVICE}/Source", request_serializer=_identity, response_deserializer=_identity
    )
    return lambda size: list(call(size.to_bytes(8, "little")))


def response_bytes(channel, request) -> int:
    """The bytes of the first answer of a millpond ``Sample`` ``request`` over ``channel``,
    as it travels (read without decoding)."""
    call = channel.unary_stream(
        "/millpond.v1.Replay/Sample",
        request_serializer=type(request).SerializeToString,
        response_deserializer=_identity,
    )
    return len(next(iter(call(request))))


def serve_raw_source() -> int:
    """A server process of ``bench.Raw/Source`` alone, on a free loopback port, announced as
    :class:`ServerProcess` expects, until SIGTERM. It keeps freed buffers for reuse, as
    millpond's shard processes do."""
    from concurrent import futures

    import grpc

    from millpond.allocator import keep_freed_buffers

    keep_freed_buffers()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=grpc_options())
    add_raw_source(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    print(f"ADDRESSES 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()
    return 0


def add_common_args(ap: argparse.ArgumentParser, quick_help: str) -> None:
    """``--quick``, ``--out``, ``--dir`` and ``--shapes``, as every side-by-side script takes them."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", type=Path, help="also write the table as markdown to this file")
    ap.add_argument("--dir", type=Path, help="parent of the temporary data directory (/tmp)")
    ap.add_argument("--shapes", default="cartpole,atari", help="comma-separated: cartpole,atari")


def quiet_torchrl() -> None:
    """Import torchrl with its UserWarnings off and its logger at WARNING."""
    warnings.filterwarnings("ignore", category=UserWarning, module="torchrl")
    import torchrl  # noqa: F401  (configures its logger on import; quieten it afterwards)

    logging.getLogger("torchrl").setLevel(logging.WARNING)


def disk_bytes(path: Path) -> int:
    """Bytes on disk of every file under ``path``: blocks really written (``st_blocks``),
    so a sparse memory map counts what it holds, not its size."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def scratch_root(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A temporary directory under ``parent`` (created if needed; default /tmp), removed after."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield root
    finally:
        with contextlib.suppress(Exception):
            shutil.rmtree(root)


def load_average(load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    """The load averages at a run's start and end, as the reports' machine line gives them."""
    start, end = ("/".join(f"{x:.2f}" for x in avg) for avg in load)
    return f"Load average (1/5/15 min) at start {start}, at end {end}"


def status(ok: bool) -> str:
    """A target's verdict in a report."""
    return "**met**" if ok else "**missed**"


def emit_report(report: str, out: Path | None, t0: float) -> None:
    """The report on stdout (and to ``out``), and the run's duration on stderr."""
    print(report)
    if out is not None:
        out.write_text(report)
    log(f"done in {time.perf_counter() - t0:.0f} s")


# -- synthetic experience -------------------------------------------------------------------
TRUNCATED_SHARE = 0.2  # of the episodes that end inside the data


@dataclasses.dataclass
class Episodes:
    """Consecutive episodes of random lengths on each of P lanes of S steps.

    Episodes are numbered lane after lane, in time order; ``lengths[e]`` is episode ``e``'s
    full length (the last episode of a lane may be cut short by the data's end, and then
    neither terminates nor truncates).
    """

    episode: np.ndarray  # [P, S] int64: the episode of each step
    step: np.ndarray  # [P, S] int64: its index within the episode
    terminated: np.ndarray  # [P, S] bool
    truncated: np.ndarray  # [P, S] bool
    lengths: np.ndarray  # [episodes] int64


def episode_layout(
    rng: np.random.Generator, lanes: int, steps: int, episode_len: tuple[int, int]
) -> Episodes:
    """Episodes of lengths uniform in ``episode_len`` (inclusive); ends inside the data are
    truncations with probability :data:`TRUNCATED_SHARE`, terminations otherwise."""
    P, S = lanes, steps
    lo, hi = episode_len
    episode = np.zeros((P, S), dtype=np.int64)
    step = np.zeros((P, S), dtype=np.int64)
    term = np.zeros((P, S), dtype=bool)
    trunc = np.zeros((P, S), dtype=bool)
    lengths: list[int] = []
    for p in range(P):
        t = 0
        while t < S:
            length = int(rng.integers(lo, hi + 1))
            n = min(length, S - t)
            episode[p, t : t + n] = len(lengths)
            step[p, t : t + n] = np.arange(n)
            if n == length:  # the episode ends inside the data
                (trunc if rng.random() < TRUNCATED_SHARE else term)[p, t + n - 1] = True
            lengths.append(length)
            t += n
    return Episodes(episode, step, term, trunc, np.array(lengths, dtype=np.int64))


def collector_batch(
    obs: torch.Tensor,
    next_obs: torch.Tensor,
    action: torch.Tensor,
    reward: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    traj_ids: torch.Tensor,
    step_count: torch.Tensor,
) -> TensorDict:
    """A chunk ``[P, T]`` as an env actor's collector hands it to
    :func:`millpond.segmenting.cut_batch` / ``pack_batch``: ``observation`` and ``action``,
    ``("next", "observation" | "reward" | "terminated" | "truncated")`` and
    ``("collector", "traj_ids" | "step_count")``."""
    return TensorDict(
        {
            OBS: obs,
            "action": action,
            "next": {
                OBS: next_obs,
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
            },
            "collector": {"traj_ids": traj_ids, "step_count": step_count},
        },
        batch_size=obs.shape[:2],
    )


def ted_chunk(batch: TensorDict) -> TensorDict:
    """The chunk ``[P, T]`` of :func:`collector_batch` flattened to ``[P*T]`` in TorchRL's TED
    layout, as a collector hands it to ``ReplayBuffer.extend``: root ``done``/``terminated``/
    ``truncated`` (all false), ``("next", "done")``, and ``("collector", "traj_ids")``."""
    n = batch.numel()
    flat = batch.reshape(n)
    nxt = flat["next"]
    false = torch.zeros(n, 1, dtype=torch.bool)
    return TensorDict(
        {
            OBS: flat[OBS],
            "action": flat["action"],
            "done": false,
            "terminated": false,
            "truncated": false,
            "next": {
                OBS: nxt[OBS],
                "reward": nxt["reward"],
                "done": nxt["terminated"] | nxt["truncated"],
                "terminated": nxt["terminated"],
                "truncated": nxt["truncated"],
            },
            "collector": {"traj_ids": flat["collector", "traj_ids"]},
        },
        batch_size=[n],
    )
