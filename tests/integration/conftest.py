"""Real ``millpond serve`` processes on loopback, and an independent reference to check against.

Servers are subprocesses of the real CLI (``python -m millpond.cli serve``); each one costs a
few seconds of start-up (torch import), so the plain one-shard and three-shard servers are
shared by the whole session and tests keep apart by using their own table names (the
``table_name`` fixture). Servers with special flags (a token file, a small message limit)
and servers a test kills are module- or function-scoped. Every process is stopped with
SIGTERM at teardown, and killed if it does not exit.

Helpers that tests need go through fixtures (``--import-mode=importlib``: test modules cannot
import each other or this file): ``server_process`` starts a server process that can be
SIGKILLed and restarted on the same port and directory; ``make_experience`` records
rollouts as the reference every sampled row is compared with, bit for bit.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from millpond import ReplayClient
from millpond.routing import writer_hash
from millpond.testing import (
    CountingDictEnv,
    SegmentRecord,
    chunk_segments,
    pattern,
    rollout,
)

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


# -- server processes ---------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``millpond serve`` process (one shard, or a ``--shards N`` supervisor).

    A one-shard server gets an explicit free port unless told otherwise, so that
    :meth:`restart` brings it back on the same port and directory after :meth:`kill`.
    Output goes to files under ``logs`` (a pipe nobody reads would block the server).
    """

    _ids = itertools.count()

    def __init__(
        self, dir: Path, logs: Path, *args: str, shards: int = 1, port: int | None = None
    ) -> None:
        self.dir = Path(dir)
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.shards = shards
        self.port = (free_port() if shards == 1 else 0) if port is None else port
        self.proc: subprocess.Popen | None = None
        self.addresses: list[str] = []
        self._stdout: Path | None = None
        self._stderr: Path | None = None

    @property
    def address(self) -> str:
        """The comma-separated address list a :class:`ReplayClient` takes."""
        return ",".join(self.addresses)

    def launch(self) -> None:
        """Start the process (without waiting for it to serve)."""
        n = next(self._ids)
        self._stdout = self.logs / f"server-{n}.out"
        self._stderr = self.logs / f"server-{n}.err"
        cmd = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(self.dir)]
        cmd += ["--port", str(self.port), *self.args]
        if self.shards > 1:
            cmd += ["--shards", str(self.shards)]
        with open(self._stdout, "w") as out, open(self._stderr, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> list[str]:
        """Wait for the ``ADDRESSES`` line; returns the addresses."""
        assert self.proc is not None and self._stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self._stdout.read_text().splitlines():
                if line.startswith("ADDRESSES "):
                    self.addresses = line.split()[1].split(",")
                    return self.addresses
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"millpond serve exited with {self.proc.returncode} before serving:\n"
                    + self.stderr()
                )
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"millpond serve did not start within {timeout} s:\n" + self.stderr())

    def start(self) -> list[str]:
        self.launch()
        return self.wait_ready()

    def stderr(self) -> str:
        return self._stderr.read_text()[-5000:] if self._stderr and self._stderr.exists() else ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process dies at once, no checkpoint, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode

    def restart(self, attempts: int = 20) -> list[str]:
        """Start again on the same port and directory (retrying while the port is busy)."""
        assert not self.running, "stop or kill the server first"
        for _ in range(attempts):
            self.launch()
            try:
                addresses = self.wait_ready()
            except RuntimeError:
                if "cannot bind" not in self.stderr():
                    raise
                time.sleep(0.25)
                continue
            assert addresses == [f"127.0.0.1:{self.port}"], addresses
            return addresses
        raise RuntimeError(f"could not restart on port {self.port}:\n{self.stderr()}")


def start_all(servers: Sequence[ServerProcess]) -> None:
    """Launch several servers at once (their start-up overlaps), then wait for each."""
    for server in servers:
        server.launch()
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


@pytest.fixture(scope="session")
def _session_servers(tmp_path_factory) -> Iterator[dict[int, ServerProcess]]:
    base = tmp_path_factory.mktemp("servers")
    servers = {
        1: ServerProcess(base / "one", base / "logs"),
        3: ServerProcess(base / "three", base / "logs", shards=3),
    }
    start_all(list(servers.values()))
    yield servers
    for server in servers.values():
        assert server.stop() == 0, server.stderr()


@pytest.fixture(scope="session")
def server1(_session_servers) -> ServerProcess:
    """A one-shard server for the whole session (use your own table names)."""
    return _session_servers[1]


@pytest.fixture(scope="session")
def server3(_session_servers) -> ServerProcess:
    """A ``--shards 3`` server for the whole session (use your own table names)."""
    return _session_servers[3]


@pytest.fixture(params=[1, 3], ids=["1shard", "3shards"])
def server(request, _session_servers) -> ServerProcess:
    """The session's one-shard server, then its three-shard server."""
    return _session_servers[request.param]


@pytest.fixture
def client(server) -> Iterator[ReplayClient]:
    """A client of ``server``, closed at teardown."""
    c = ReplayClient(server.address, timeout_s=30)
    yield c
    c.close()


def _servers(base: Path) -> Iterator[Callable[..., ServerProcess]]:
    """A factory of :class:`ServerProcess` under ``base``; stops what it made at the end."""
    servers: list[ServerProcess] = []

    def make(*args: str, shards: int = 1, start: bool = True) -> ServerProcess:
        server = ServerProcess(base / f"s{len(servers)}", base / "logs", *args, shards=shards)
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """``module_server(*args, shards=1)``: a started server, stopped when the module ends."""
    yield from _servers(tmp_path_factory.mktemp("module-servers"))


@pytest.fixture
def server_process(tmp_path) -> Iterator[Callable[..., ServerProcess]]:
    """``server_process(*args, shards=1, start=True)``: a server for one test.

    Call ``.kill()`` / ``.restart()`` on it to crash it and bring it back on the same port
    and directory. With ``start=False`` it is only made (``.start()`` it later).
    """
    yield from _servers(tmp_path)


_table_ids = itertools.count()


@pytest.fixture
def table_name(request) -> str:
    """A table name no other test uses (the session's servers are shared)."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name).strip("-")[:60]
    return f"{stem}-{next(_table_ids)}"


def writer_ids_covering(prefix: str, num_shards: int, per_shard: int = 1) -> list[str]:
    """Writer ids pinned so that every shard gets ``per_shard`` of them (shard order)."""
    by_shard: dict[int, list[str]] = {i: [] for i in range(num_shards)}
    for k in itertools.count():
        wid = f"{prefix}-{k}"
        pinned = by_shard[writer_hash(wid) % num_shards]
        if len(pinned) < per_shard:
            pinned.append(wid)
        if all(len(v) == per_shard for v in by_shard.values()):
            break
    return [w for i in range(num_shards) for w in by_shard[i]]


@pytest.fixture
def covering_writer_ids() -> Callable[..., list[str]]:
    """``covering_writer_ids(prefix, num_shards, per_shard=1)``: see :func:`writer_ids_covering`."""
    return writer_ids_covering


# -- multi-node Ray clusters on this machine ----------------------------------------------------

_RAY_START_ATTEMPTS = 3
#: How Ray says that its own processes (GCS, raylet) did not come up in time.
_RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def _ray_start_timed_out(error: BaseException) -> bool:
    return any(message in str(error) for message in _RAY_START_TIMEOUTS)


@pytest.fixture(scope="session")
def start_local_ray() -> Callable[..., object]:
    """``start_local_ray(**ray_init_kwargs)``: ``ray.init`` on this machine, tried again (at
    most three times) when Ray's own processes miss their start-up deadline, as they
    sometimes do on a loaded 2-core machine; the caller shuts it down."""
    import ray

    def start(**kwargs: object) -> object:
        for attempt in range(1, _RAY_START_ATTEMPTS + 1):
            try:
                return ray.init(**kwargs)
            except Exception as e:
                ray.shutdown()
                if not _ray_start_timed_out(e) or attempt == _RAY_START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    return start


def _start_cluster(head: dict, nodes: Sequence[dict]) -> tuple[object, list]:
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        added = [c.add_node(**node) for node in nodes]
        c.wait_for_nodes()
    except BaseException:
        c.shutdown()
        raise
    return c, added


@pytest.fixture
def ray_cluster(monkeypatch) -> Iterator[Callable[..., tuple[object, list]]]:
    """``ray_cluster(head_args, [node_args, ...])``: a ``ray.cluster_utils.Cluster`` and its
    added nodes, joined by ``ray.init``; shut down at teardown.

    Each node is a raylet that Ray gives 30 s to register; on a loaded 2-core machine one
    sometimes misses that, so a cluster that fails to start is torn down and started again
    (at most three times): the tests are about what the job does on a cluster, not about
    Ray's start-up time.
    """
    import ray

    # Cluster records its head as this machine's "current" Ray cluster, which every
    # address-less ray.init() on the machine would then join: this one is joined by address.
    monkeypatch.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
    monkeypatch.setattr(ray._common.utils, "reset_ray_address", lambda *a, **k: None)
    started: list = []

    def make(head: dict, nodes: Sequence[dict]) -> tuple[object, list]:
        for attempt in range(1, _RAY_START_ATTEMPTS + 1):
            try:
                c, added = _start_cluster(head, nodes)
                break
            except Exception as e:
                if not _ray_start_timed_out(e) or attempt == _RAY_START_ATTEMPTS:
                    raise
        started.append(c)
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        return c, added

    try:
        yield make
    finally:
        ray.shutdown()
        for c in started:
            c.shutdown()


# -- the reference ------------------------------------------------------------------------------
#: Keys a sampled batch carries besides the rollout's own.
SAMPLE_KEYS = {
    ("index", "slot"),
    ("index", "generation"),
    ("index", "shard"),
    ("episode_id",),
    ("step",),
    ("weight",),
    ("done",),
    ("terminated",),
    ("truncated",),
}


def _key(k: str | tuple[str, ...]) -> tuple[str, ...]:
    return (k,) if isinstance(k, str) else tuple(k)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, same shape, same bytes (so -0.0 != 0.0 and NaN == NaN of the same bits)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.detach().contiguous().cpu().numpy()
    b = expected.detach().contiguous().cpu().numpy()
    if a.tobytes() != b.tobytes():
        diff = np.flatnonzero((a != b).reshape(len(a), -1).any(axis=1)) if a.ndim else [0]
        raise AssertionError(f"{what}: rows {list(diff)[:10]} differ from the reference")


class Experience:
    """Recorded rollouts: the reference that sampled rows are checked against.

    Every row is indexed by ``(episode id, step)`` (the rollout's ``("collector",
    "traj_ids")`` and ``"step_count"``), so a sampled row is found by its ``episode_id`` and
    ``step`` and compared key by key: observations, ``("next", obs)`` (the true next
    observation, never a reset's), action, reward and the flags. ``step_count_stored``: the
    rollouts' ``"step_count"`` was sent too (``extend`` of whole TED rollouts stores every
    key).
    """

    def __init__(self, step_count_stored: bool = False) -> None:
        self.step_count_stored = step_count_stored
        self.teds: list[TensorDict] = []
        self.index: dict[tuple[int, int], int] = {}
        self.segments: list[list[tuple]] = []  # per rollout: [(Segment, SegmentRecord)]
        self._all: TensorDict | None = None

    def add(self, ted: TensorDict, chunks: list[list[tuple]] | None = None) -> TensorDict:
        base = sum(t.shape[0] for t in self.teds)
        eps = ted["collector", "traj_ids"].tolist()
        steps = ted["step_count"].reshape(-1).tolist()
        for i, key in enumerate(zip(eps, steps, strict=True)):
            assert key not in self.index, f"(episode, step) {key} recorded twice"
            self.index[key] = base + i
        self.teds.append(ted)
        self.segments.append([s for chunk in chunks or [] for s in chunk])
        self._all = None
        return ted

    def add_rollout(
        self,
        env: gym.Env,
        num_steps: int,
        *,
        seed: int,
        episode_offset: int,
        rng: np.random.Generator,
        max_chunk: int = 12,
    ) -> list[tuple]:
        """Record a :func:`rollout` and cut it into chunks of segments; returns the segments."""
        ted = rollout(env, num_steps, seed=seed, episode_offset=episode_offset)
        chunks = chunk_segments(ted, rng, max_chunk=max_chunk)
        self.add(ted, chunks)
        return self.segments[-1]

    @property
    def all(self) -> TensorDict:
        if self._all is None:
            self._all = torch.cat([t.exclude("collector") for t in self.teds])
        return self._all

    @property
    def keys(self) -> set[tuple[str, ...]]:
        keys = {_key(k) for k in self.all.keys(include_nested=True, leaves_only=True)}
        keys -= {("done",), ("terminated",), ("truncated",)}  # a TED's root flags: all False
        if not self.step_count_stored:  # the rollout's bookkeeping, not sent by writers
            keys.discard(("step_count",))
        return keys

    @property
    def num_steps(self) -> int:
        return len(self.index)

    def batches_to_cover(self, batch_size: int, slack: float = 12.0) -> int:
        """Uniform batches after which a step is still unsampled with probability <= e^-slack.

        Coupon collector: after ``n (ln n + c)`` uniform draws, the chance that any of the
        ``n`` steps was never drawn is at most ``e^-c``.
        """
        n = max(self.num_steps, 1)
        return math.ceil(n * (math.log(n) + slack) / batch_size)

    def records(self) -> list[SegmentRecord]:
        return [r for segs in self.segments for _, r in segs]

    def rows_of(self, batch: TensorDictBase) -> torch.Tensor:
        eps = batch["episode_id"].reshape(-1).tolist()
        steps = batch["step"].reshape(-1).tolist()
        missing = [k for k in zip(eps, steps, strict=True) if k not in self.index]
        assert not missing, f"sampled (episode, step) pairs never written: {missing[:5]}"
        return torch.tensor([self.index[k] for k in zip(eps, steps, strict=True)])

    def stops(self, batch: TensorDictBase, kind: str) -> torch.Tensor:
        """Where ``batch``'s trajectories stop (bool ``[N, 1]``), by the table ``kind``.

        ``"row"``: single transitions, every row; ``"slice"``: each slice's last step;
        ``"segment"``: queue batches, each written segment's last step.
        """
        if kind == "row":
            return torch.ones(batch.numel(), 1, dtype=torch.bool)
        if kind == "slice":
            stops = torch.zeros(batch.shape, dtype=torch.bool)
            stops[..., -1] = True
            return stops.reshape(-1, 1)
        assert kind == "segment", kind
        ends = {(r.episode_id, r.first_step + r.length - 1) for r in self.records()}
        assert ends, "segment stops need the rollouts' segments"
        keys = zip(batch["episode_id"].reshape(-1).tolist(), batch["step"].reshape(-1).tolist())
        return torch.tensor([[key in ends] for key in keys])

    def check(
        self, batch: TensorDictBase, *, weights: bool = False, stops: str | None = None
    ) -> list[tuple[int, int]]:
        """Assert every row of ``batch`` (``[B]`` or ``[B, K]``) equals its reference row.

        Where the batch's trajectory stops (``stops``, see :meth:`stops`; by default
        ``"slice"`` for ``[B, K]``, else ``"row"``) a step that did not terminate is
        truncated in the batch, so that value estimators stop there too. Returns the rows'
        ``(episode_id, step)`` in order.
        """
        flat = batch.reshape(-1)
        rows = self.rows_of(flat)
        ref = self.all[rows]
        got = {_key(k) for k in flat.keys(include_nested=True, leaves_only=True)}
        expected = self.keys | (SAMPLE_KEYS if weights else SAMPLE_KEYS - {("weight",)})
        assert got == expected, f"keys: extra {got - expected}, missing {expected - got}"
        stop = self.stops(batch, stops or ("slice" if batch.batch_dims == 2 else "row"))
        terminated = ref["next", "terminated"].reshape(-1, 1)
        truncated = ref["next", "truncated"].reshape(-1, 1) | (stop & ~terminated)
        flags = {("next", "truncated"): truncated, ("next", "done"): terminated | truncated}
        for key in sorted(self.keys):
            want = flags[key].reshape(ref[key].shape) if key in flags else ref[key]
            assert_bitwise_equal(flat[key], want, f"key {key}")
        n = flat.shape[0]
        for flag in ("done", "terminated", "truncated"):  # the root flags of a TED step
            assert_bitwise_equal(flat[flag], torch.zeros(n, 1, dtype=torch.bool), flag)
        if weights:
            w = flat["weight"]
            assert w.dtype == torch.float32 and bool(((w > 0) & (w <= 1)).all()), w
        return list(zip(flat["episode_id"].tolist(), flat["step"].tolist(), strict=True))


def cartpole(episode_offset: int = 0) -> gym.Env:
    """CartPole-v1 cut at 15 steps: terminations, truncations, float32 observations."""
    return gym.make("CartPole-v1", max_episode_steps=15)


def dict_env(episode_offset: int = 0) -> gym.Env:
    """:class:`CountingDictEnv`: dict observations, uint8 pixels; episode ids from the offset."""
    return CountingDictEnv(
        pixel_shape=(3, 8, 8),
        terminate_prob=0.08,
        min_len=3,
        max_len=20,
        episode_offset=episode_offset,
    )


ENVS = {"cartpole": cartpole, "dict": dict_env}


@pytest.fixture
def make_experience() -> Callable[[], Experience]:
    """A new :class:`Experience` (the reference of one test's data)."""
    return Experience


@pytest.fixture
def envs() -> dict[str, Callable[..., gym.Env]]:
    """``{"cartpole": CartPole-v1 (15-step limit), "dict": CountingDictEnv (uint8 pixels)}``."""
    return ENVS


@pytest.fixture
def bitwise() -> Callable[[torch.Tensor, torch.Tensor, str], None]:
    """:func:`assert_bitwise_equal`."""
    return assert_bitwise_equal


def write_experience(
    client: ReplayClient,
    table: str,
    experience: Experience,
    writer_ids: Sequence[str],
    *,
    max_in_flight: int = 64,
) -> None:
    """Send rollout ``i``'s segments through a writer with ``writer_ids[i]``; flush and close."""
    assert len(writer_ids) == len(experience.segments)
    for wid, segments in zip(writer_ids, experience.segments, strict=True):
        with client.writer(table, writer_id=wid, max_in_flight=max_in_flight) as w:
            for seg, _ in segments:
                w.write_segment(seg.steps, seg.tail, seg.episode_id, seg.first_step)
            w.flush(timeout_s=30)


@pytest.fixture
def write() -> Callable[..., None]:
    """:func:`write_experience`."""
    return write_experience


# -- patterned segments: every value a function of (episode, step) ------------------------------
class Patterned:
    """Segments whose every value encodes ``(episode, step)``, so any row read back can be
    checked on its own (a torn, stale or misplaced row shows at once). Cheap to make in bulk,
    for tests that stream many segments."""

    OBS = (24,)
    L = 4  # steps per segment

    @classmethod
    def segment(cls, episode: int, first_step: int = 0, length: int | None = None):
        """``(steps, tail)`` of one segment; its last step is truncated (the episode ends)."""
        length = cls.L if length is None else length
        steps = torch.arange(first_step, first_step + length)
        eps = torch.full((length,), episode)
        ended = torch.zeros(length, 1, dtype=torch.bool)
        ended[-1] = True
        td = TensorDict(
            {
                "observation": pattern(eps, steps, cls.OBS),
                "action": eps * 1000 + steps,
                "next": {
                    "reward": (eps * 1000 + steps).float().unsqueeze(-1),
                    "terminated": torch.zeros(length, 1, dtype=torch.bool),
                    "truncated": ended,
                },
            },
            [length],
        )
        tail = TensorDict({"observation": pattern(episode, first_step + length, cls.OBS)}, [])
        return td, tail

    @classmethod
    def check(cls, batch: TensorDictBase) -> list[tuple[int, int]]:
        """Assert each row is the one its ``(episode_id, step)`` says; returns those pairs."""
        eps, steps = batch["episode_id"], batch["step"]
        assert torch.equal(batch["observation"], pattern(eps, steps, cls.OBS))
        assert torch.equal(batch["next", "observation"], pattern(eps, steps + 1, cls.OBS))
        assert torch.equal(batch["action"], eps * 1000 + steps)
        assert torch.equal(batch["next", "reward"], (eps * 1000 + steps).float().unsqueeze(-1))
        return list(zip(eps.reshape(-1).tolist(), steps.reshape(-1).tolist(), strict=True))

    @classmethod
    def drain(cls, client: ReplayClient, table: str, steps: int) -> list[tuple[int, int]]:
        """Sample ``steps`` steps of a queue table (checking each row), then find it empty."""
        got: list[tuple[int, int]] = []
        while len(got) < steps:
            got += cls.check(client.sample(table, min(512, steps - len(got)), timeout_s=10))
        assert client.info(table)["size"] == 0
        return got


@pytest.fixture
def patterned() -> type[Patterned]:
    """:class:`Patterned`: self-checking segments."""
    return Patterned


@pytest.fixture
def certificate(tmp_path) -> tuple[Path, Path]:
    """A self-signed certificate and key for 127.0.0.1 and localhost (PEM files)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
