"""Test hosts: a server and a client in network namespaces, joined through a switch.

``net_hosts`` builds three namespaces for one test: *server* (address ``10.201.0.2``),
*client* (``10.201.0.1``), and a *switch* between them (a bridge), each link a veth pair. The
server's namespace gets a hostname of its own, so a client never takes it for its own host
(and never reads its tables' files colocated). What the link does is set from here:

- ``delay(ms, jitter_ms)``: every packet held that long each way (``_shaper.py`` reads an
  iptables NFQUEUE in the server's namespace: the kernel has no ``sch_netem``);
- ``loss(p)``: each packet dropped with probability ``p``, each way (iptables ``statistic``);
- ``rate(mbit)``: a token bucket (``tc tbf``) on both ends of the link;
- ``partition()`` / ``heal()``: every packet dropped both ways, on arrival, so nobody
  sends a reset or learns anything; healing deletes the rules;
- ``vanish()``: the server's processes killed and its namespace deleted; the client's link
  stays up, so its packets go unanswered, as to a host that lost power.

``serve(...)`` starts a real ``millpond serve`` in the server's namespace;
``client(scenario, ...)`` runs ``_netclient.py`` in the client's, ``on_client(name, cmd)``
any command there (a ``millpond launch`` job). Whatever runs in a namespace when the hosts
close is killed. Nothing leaves the
machine. The fixture skips where it cannot run (not root, no ``ip netns``, no iptables).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SERVER_IP, CLIENT_IP = "10.201.0.2", "10.201.0.1"
SERVER_HOSTNAME = "millpond-test-server"
PORT = 50051
_ids = itertools.count()


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def why_not() -> str | None:
    """Why test hosts cannot be built here, or ``None`` when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, iptables, util-linux)"
    probe = f"mp-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        rule = ("-A", "INPUT", "-i", "lo", "-j", "NFQUEUE", "--queue-num", "9")
        added = _run("ip", "netns", "exec", probe, "iptables", *rule, check=False)
        if added.returncode != 0:
            return f"iptables NFQUEUE rules are refused: {added.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


class NetHosts:
    """A server and a client host in network namespaces (see the module docstring)."""

    def __init__(self, workdir: Path) -> None:
        tag = f"{os.getpid()}-{next(_ids)}"
        self.workdir = workdir
        self.server_ns, self.client_ns, self.switch_ns = (f"mp-{r}-{tag}" for r in "scw")
        self.server_if, self.client_if = "s0", "c0"
        self.address = f"{SERVER_IP}:{PORT}"
        self._procs: list[subprocess.Popen] = []
        self._shaper: subprocess.Popen | None = None
        self._server: subprocess.Popen | None = None
        self._partitioned = False
        self._loss: float | None = None
        self.vanished = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- topology ------------------------------------------------------------------------
    def _build(self) -> None:
        s, c, w = self.server_ns, self.client_ns, self.switch_ns
        for ns in (s, c, w):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", w, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", w, "link", "set", "br0", "up")
        for ns, name, ip, port in ((s, "s0", SERVER_IP, "ws"), (c, "c0", CLIENT_IP, "wc")):
            _run(
                "ip",
                "link",
                "add",
                name,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                w,
            )
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", name)
            _run("ip", "-n", ns, "link", "set", name, "up")
            _run("ip", "-n", w, "link", "set", port, "master", "br0")
            _run("ip", "-n", w, "link", "set", port, "up")

    def exec(self, ns: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def _iptables(self, ns: str, *rule: str) -> None:
        _run(*self.exec(ns, "iptables", "-w", *rule))

    # -- processes -----------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return env

    def _spawn(self, cmd: list[str], name: str, **kwargs) -> subprocess.Popen:
        out = open(self.workdir / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self._env(), **kwargs
        )
        out.close()
        self._procs.append(proc)
        return proc

    def serve(self, *args: str, timeout: float = 90.0) -> str:
        """Start ``millpond serve`` on the server host (its own hostname); returns its address."""
        data = self.workdir / "shard"
        serve = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(data)]
        serve += ["--host", SERVER_IP, "--port", str(PORT), *args]
        script = f'hostname {SERVER_HOSTNAME} && exec "$@"'
        cmd = self.exec(self.server_ns, "unshare", "--uts", "sh", "-c", script, "sh", *serve)
        self._server = self._spawn(cmd, "server")
        log = self.workdir / "server.out"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ADDRESSES " in log.read_text():
                return self.address
            if self._server.poll() is not None:
                raise RuntimeError(f"millpond serve exited: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"millpond serve did not start: {log.read_text()[-3000:]}")

    def stop_server(self) -> int | None:
        """SIGTERM the server (it checkpoints), SIGKILL if it does not exit."""
        proc = self._server
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(30)

    @property
    def server_log(self) -> str:
        path = self.workdir / "server.out"
        return path.read_text() if path.exists() else ""

    def on_client(self, name: str, *cmd: str) -> subprocess.Popen:
        """Run ``cmd`` on the client host from the project's root, its output (stdout and
        stderr) in ``workdir/NAME.out``; ended with the hosts, with whatever it started."""
        return self._spawn(self.exec(self.client_ns, *cmd), name, cwd=str(HERE.parents[2]))

    def client(self, scenario: str, **params: object) -> subprocess.Popen:
        """Start ``_netclient.py SCENARIO`` on the client host, its stdin and stdout piped.

        The scenario reads its parameters as JSON from its first argument, prints progress
        lines, and writes its report (JSON) to ``params["out"]``."""
        cmd = self.exec(
            self.client_ns,
            sys.executable,
            str(HERE / "_netclient.py"),
            scenario,
            json.dumps({"address": self.address, **params}),
        )
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.workdir / f"client-{scenario}.err", "w"),  # noqa: SIM115
            env=self._env(),
            text=True,
        )
        self._procs.append(proc)
        return proc

    # -- faults --------------------------------------------------------------------------
    def delay(self, ms: float, jitter_ms: float = 0.0) -> None:
        """Hold every packet ``ms ± jitter_ms`` each way (no reordering)."""
        assert self._shaper is None, "one delay per test hosts"
        cmd = self.exec(
            self.server_ns,
            sys.executable,
            str(HERE / "_shaper.py"),
            "--queues",
            "0,1",
            "--delay-ms",
            str(ms),
            "--jitter-ms",
            str(jitter_ms),
        )
        self._shaper = self._spawn(cmd, "shaper")
        log = self.workdir / "shaper.out"
        deadline = time.monotonic() + 30
        while "SHAPING" not in log.read_text():
            if self._shaper.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the delay shaper did not start: {log.read_text()}")
            time.sleep(0.05)
        # Appended: the loss and partition rules (inserted) drop packets before they wait.
        self._iptables(
            self.server_ns, "-A", "INPUT", "-i", "s0", "-j", "NFQUEUE", "--queue-num", "0"
        )
        self._iptables(
            self.server_ns, "-A", "OUTPUT", "-o", "s0", "-j", "NFQUEUE", "--queue-num", "1"
        )

    def _loss_rules(self, p: float) -> list[tuple[str, tuple[str, ...]]]:
        drop = ("-m", "statistic", "--mode", "random", "--probability", str(p), "-j", "DROP")
        return [
            (self.server_ns, ("INPUT", "-i", "s0", *drop)),
            (self.client_ns, ("INPUT", "-i", "c0", *drop)),
        ]

    def loss(self, p: float) -> None:
        """Drop each packet with probability ``p``, each way, on arrival."""
        if self._loss is not None:
            for ns, rule in self._loss_rules(self._loss):
                self._iptables(ns, "-D", *rule)
        self._loss = p
        for ns, rule in self._loss_rules(p):
            self._iptables(ns, "-I", *rule)

    def rate(self, mbit: float) -> None:
        """Limit both ends of the link to ``mbit`` Mbit/s (token bucket, 400 ms queue)."""
        for ns, dev in ((self.server_ns, "s0"), (self.client_ns, "c0")):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{mbit}mbit", "burst", "32kbit", "latency", "400ms")  # fmt: skip

    def _partition_rules(self) -> list[tuple[str, tuple[str, ...]]]:
        return [
            (self.server_ns, ("INPUT", "-i", "s0", "-j", "DROP")),
            (self.client_ns, ("INPUT", "-i", "c0", "-j", "DROP")),
        ]

    def partition(self) -> None:
        """Drop every packet both ways, silently (no reset, no ICMP)."""
        assert not self._partitioned
        for ns, rule in self._partition_rules():
            self._iptables(ns, "-I", *rule)
        self._partitioned = True

    def heal(self) -> None:
        """Undo :meth:`partition`."""
        assert self._partitioned
        for ns, rule in self._partition_rules():
            self._iptables(ns, "-D", *rule)
        self._partitioned = False

    def vanish(self) -> None:
        """The server's host is gone, as if it lost power: its link goes silent first (the
        dying processes' sockets send no reset), then its processes are killed and its
        namespace deleted."""
        self._iptables(self.server_ns, "-I", "OUTPUT", "-o", "s0", "-j", "DROP")
        self._iptables(self.server_ns, "-I", "INPUT", "-i", "s0", "-j", "DROP")
        for proc in (self._server, self._shaper):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
        _run("ip", "netns", "del", self.server_ns)
        self.vanished = True

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        self.stop_server()
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for ns in (self.client_ns, self.switch_ns, self.server_ns):
            if ns == self.server_ns and self.vanished:
                continue
            # What the processes started in it left running (a job's Ray instance): a
            # namespace deleted does not end them.
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="session")
def _net_hosts_possible() -> None:
    reason = why_not()
    if reason is not None:
        pytest.skip(f"test hosts in network namespaces: {reason}")


@pytest.fixture
def net_hosts(_net_hosts_possible, tmp_path) -> Iterator[NetHosts]:
    """A server and a client host joined by a link this test shapes (see the module)."""
    hosts = NetHosts(tmp_path)
    try:
        yield hosts
    finally:
        hosts.close()
