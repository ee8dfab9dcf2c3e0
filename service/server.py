"""The replay shard server: ``create_server(config) -> (server, port)`` and ``millpond serve``.

``millpond serve --dir DIR --port PORT`` serves one shard from DIR; ``--shards N`` runs N
shard processes on consecutive ports (DIR/shard-0, DIR/shard-1, ...) and prints the address
list a client takes. SIGTERM or SIGINT: stop accepting calls, let in-flight ones finish,
checkpoint, exit 0. Restarting on the same DIR resumes every table.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from millpond.allocator import keep_freed_buffers
from millpond.config import TableConfig
from millpond.errors import InvalidConfigError
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.service.admission import AdmissionInterceptor
from millpond.service.auth import TokenAuthInterceptor, load_tokens
from millpond.service.servicer import DEFAULT_MAX_WEIGHTS_BYTES, ReplayServicer
from millpond.service.shard import Shard
from millpond.service.verifier import VERIFY_MODES, check_verify_settings
from millpond.service.weights import WeightStore

log = logging.getLogger("millpond.server")
SERVICE_NAME = "millpond.v1.Replay"
#: Clients ping every 2 s, also on idle channels and while nothing is sent, to notice a
#: silent link in seconds: allow it (gRPC's default answers such pings with GOAWAY
#: "too_many_pings"). The shard pings its clients too, less often, so that the streams of
#: a client whose host vanished (each holds a thread) end within about 15 s.
KEEPALIVE_OPTIONS = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),  # 0: never close a connection for its pings
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


@dataclass(frozen=True)
class ServerConfig:
    """How to run one shard server.

    Attributes:
        dir: the shard directory (its checkpoint); created if missing, resumed if not.
        host: interface to bind; loopback unless told otherwise.
        port: TCP port; 0 picks a free one (``create_server`` returns it).
        tables: tables to create at start (identical existing ones are kept).
        fsync: flush every insert and weights publication to disk before acknowledging it.
        tls_cert: PEM certificate chain file, with ``tls_key``, to serve TLS.
        tls_key: PEM private key file.
        token_file: file of ``ROLE TOKEN`` lines; every call then needs a bearer token.
        max_message_mb: largest message accepted or sent, in MiB.
        max_workers: threads serving calls. Each open stream holds one, so Insert streams
            take at most ``max_workers - max(2, max_workers // 8)`` and all streams at most
            ``max_workers - 1``: health checks, Info and learners' calls always find a
            thread, and a stream past the bound is refused as "shard busy" (writers retry).
        max_weights_mb: the largest weights PublishWeights takes, in MiB.
        metrics_port: serve Prometheus metrics over HTTP on this port of ``host`` (0: a
            free port, :attr:`ShardServer.metrics_port` says which); ``None``: not at all.
        verify: when reopened tables check their segments' data against their checksums:
            ``background`` (after the open, in a thread; reads check what they touch
            first), ``reads`` (only what reads touch), ``open`` (before serving).
        verify_rate_mb: the background check's bound, MiB/s (0: none).
    """

    dir: str
    host: str = "127.0.0.1"
    port: int = 0
    tables: tuple[TableConfig, ...] = field(default_factory=tuple)
    fsync: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    max_message_mb: int = 256
    max_workers: int = 64
    max_weights_mb: int = DEFAULT_MAX_WEIGHTS_BYTES >> 20
    metrics_port: int | None = None
    verify: str = "background"
    verify_rate_mb: float = 0.0

    def __post_init__(self) -> None:
        check_verify_settings(self.verify, self.verify_rate_mb)
        if not 0 <= self.port < 65536:
            raise InvalidConfigError(f"port ({self.port}) must be in [0, 65535]")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidConfigError(f"metrics port ({self.metrics_port}) must be in [0, 65535]")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidConfigError("--tls-cert and --tls-key go together")
        if self.max_message_mb < 1:
            raise InvalidConfigError(f"max_message_mb ({self.max_message_mb}) must be >= 1")
        if self.max_workers < 2:
            raise InvalidConfigError(f"max_workers ({self.max_workers}) must be >= 2")
        if self.max_weights_mb < 1:
            raise InvalidConfigError(f"max_weights_mb ({self.max_weights_mb}) must be >= 1")


class ShardServer:
    """A running shard: the gRPC server, the shard and its weight store."""

    def __init__(
        self,
        server: grpc.Server,
        port: int,
        shard: Shard,
        health: health.HealthServicer,
        metrics_http: Any = None,
    ):
        self.server = server
        self.port = port
        self.shard = shard
        self._health = health
        self._metrics_http = metrics_http
        self._stopped = False

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint (``/metrics``), ``None`` without one."""
        return None if self._metrics_http is None else self._metrics_http.server_port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let in-flight ones finish for ``grace`` s, checkpoint, close."""
        if self._stopped:
            return
        self._stopped = True
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self._health.enter_graceful_shutdown()
        event = self.server.stop(grace)
        self.shard.close()  # wakes blocked samples and inserts with ClosedError
        event.wait(grace + 1)


def tune_shard_process() -> None:
    """Settings for a process that serves a shard, made before it serves: freed
    message-sized buffers kept for reuse (:func:`~millpond.allocator.keep_freed_buffers`),
    and one torch thread per operation. A shard runs many calls at once, each gathering or
    concatenating megabytes; torch's intra-op threads for each of them only contend with
    the calls' own threads (and the clients' on a small host): Atari-shaped inserts went
    from 33% to 52% of the raw gRPC ceiling on 2 cores with one thread."""
    keep_freed_buffers()
    torch.set_num_threads(1)


def create_server(config: ServerConfig) -> tuple[ShardServer, int]:
    """Build and start a shard server; returns it and the port it bound."""
    shard = Shard(
        config.dir,
        fsync=config.fsync,
        verify=config.verify,
        verify_rate_mb=config.verify_rate_mb,
    )
    for table_config in config.tables:
        shard.create_table(table_config)
    weights = WeightStore(Path(config.dir) / "weights", fsync=config.fsync)
    limit = config.max_message_mb * 1024 * 1024
    interceptors: list[grpc.ServerInterceptor] = []
    if config.token_file is not None:  # first: a call without a token takes no stream place
        interceptors.append(TokenAuthInterceptor(load_tokens(config.token_file)))
    interceptors.append(AdmissionInterceptor(config.max_workers))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="millpond"),
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_OPTIONS,
        ],
        maximum_concurrent_rpcs=config.max_workers * 4,
    )
    servicer = ReplayServicer(
        shard, weights, limit, max_weights_bytes=config.max_weights_mb * 1024 * 1024
    )
    add_replay_servicer(server, servicer)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    try:
        if config.tls_cert is not None:
            credentials = tls_credentials(config.tls_cert, config.tls_key)  # type: ignore[arg-type]
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except InvalidConfigError:
        shard.close()
        raise
    except RuntimeError as e:  # gRPC says only "Failed to bind": the TLS files were checked
        shard.close()
        raise InvalidConfigError(f"cannot bind {address} (in use?): {e}") from None
    if port == 0:
        shard.close()
        raise InvalidConfigError(f"cannot bind {address} (in use?)")
    metrics_http = None
    if config.metrics_port is not None:
        try:
            metrics_http, _ = start_http_server(
                config.metrics_port, addr=config.host, registry=servicer.metrics.registry
            )
        except OSError as e:
            shard.close()
            raise InvalidConfigError(
                f"cannot serve metrics on {config.host}:{config.metrics_port}: {e}"
            ) from None
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return ShardServer(server, port, shard, health_servicer, metrics_http), port


def add_replay_servicer(server: grpc.Server, servicer: ReplayServicer) -> None:
    """Register ``servicer`` on ``server``: the generated handlers, with Insert taking its
    requests as bytes (parsed by the servicer, its tensors as views of those bytes) and
    Sample sending bytes the servicer framed itself (:mod:`millpond.protos.wire`):
    protobuf would copy every tensor three times more on each side."""
    pb_grpc.add_ReplayServicer_to_server(servicer, server)
    server.add_registered_method_handlers(
        SERVICE_NAME,
        {
            "Insert": grpc.stream_stream_rpc_method_handler(
                servicer.Insert,
                request_deserializer=None,
                response_serializer=pb.InsertResponse.SerializeToString,
            ),
            "Sample": grpc.unary_stream_rpc_method_handler(
                servicer.Sample,
                request_deserializer=pb.SampleRequest.FromString,
                response_serializer=_bytes_or_message,
            ),
        },
    )
    servicer.framed_samples = True


def _bytes_or_message(response: bytes | pb.SampleResponse) -> bytes:
    """A Sample answer: bytes framed by the servicer as they are, a message serialized."""
    return response if isinstance(response, bytes) else response.SerializeToString()


_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----", re.DOTALL)
_KEY_LABELS = (b"PRIVATE KEY", b"RSA PRIVATE KEY", b"EC PRIVATE KEY")


def tls_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """Server credentials from PEM files, each checked first.

    gRPC reports a bad key or certificate only as "Failed to bind", which sends an operator
    after the port; here the message names the file and what is wrong with it.
    """
    cert = _read_pem(cert_path, "certificate", (b"CERTIFICATE",))
    key = _read_pem(key_path, "private key", _KEY_LABELS)
    credentials = grpc.ssl_server_credentials([(key, cert)])
    # The pair is tried on a throwaway loopback port: a key that does not belong to the
    # certificate (or that gRPC refuses otherwise) must not read as a busy address.
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        probe.add_secure_port("127.0.0.1:0", credentials)
    except RuntimeError:
        raise InvalidConfigError(
            f"TLS key {key_path} and certificate {cert_path} are PEM but gRPC refuses them "
            "together: does the key belong to the certificate (the first one in the file)?"
        ) from None
    finally:
        probe.stop(None)
    return credentials


def _read_pem(path: str, what: str, labels: tuple[bytes, ...]) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidConfigError(f"cannot read TLS {what} {path}: {e.strerror}") from None
    blocks = _PEM_BLOCK.findall(data)
    wanted = " or ".join(repr(label.decode()) for label in labels)
    if not blocks:
        raise InvalidConfigError(
            f"TLS {what} {path} is not valid PEM: no complete '-----BEGIN ...-----' / "
            "'-----END ...-----' block"
        )
    if not any(label in labels for label, _ in blocks):
        found = ", ".join(sorted({label.decode() for label, _ in blocks}))
        encrypted = any(label == b"ENCRYPTED PRIVATE KEY" for label, _ in blocks)
        hint = " (the key is encrypted: gRPC takes unencrypted keys)" if encrypted else ""
        raise InvalidConfigError(
            f"TLS {what} {path} is not valid PEM for a {what}: it holds {found}, not {wanted}{hint}"
        )
    for label, body in blocks:
        if b"Proc-Type:" in body:
            raise InvalidConfigError(
                f"TLS {what} {path} is encrypted (Proc-Type header): gRPC takes unencrypted keys"
            )
        try:
            base64.b64decode(b"".join(body.split()), validate=True)
        except binascii.Error as e:
            raise InvalidConfigError(
                f"TLS {what} {path} is not valid PEM: its {label.decode()} block is not "
                f"base64 ({e})"
            ) from None
    return data


def load_tables(path: str | os.PathLike) -> tuple[TableConfig, ...]:
    """Table configs from a YAML file: ``tables: [{name: ..., capacity: ..., sampler: ...}]``."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as e:
        raise InvalidConfigError(f"cannot read tables file {p}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InvalidConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), list):
        raise InvalidConfigError(f"{p}: expected a mapping with a 'tables' list")
    unknown = set(doc) - {"tables"}
    if unknown:
        raise InvalidConfigError(f"{p}: unknown key(s) {sorted(unknown)}")
    configs = []
    for i, entry in enumerate(doc["tables"]):
        if not isinstance(entry, dict):
            raise InvalidConfigError(f"{p}: tables[{i}] must be a mapping")
        try:
            configs.append(TableConfig.from_json(entry))
        except InvalidConfigError as e:
            raise InvalidConfigError(f"{p}: tables[{i}]: {e}") from None
    return tuple(configs)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond serve", description=__doc__)
    p.add_argument("--dir", required=True, help="shard directory (created or resumed)")
    p.add_argument("--port", type=int, default=50051, help="port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument("--shards", type=int, default=1, help="number of shard processes")
    p.add_argument("--tables", help="YAML file of tables to create at start")
    p.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key (with --tls-cert)")
    p.add_argument("--token-file", help="file of 'ROLE TOKEN' lines; calls then need a token")
    p.add_argument(
        "--fsync",
        action="store_true",
        help="fsync each insert and weights publication before acking it",
    )
    p.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="background",
        help="when reopened tables check their data's checksums: in a background thread "
        "(reads check what they touch first), only on reads, or all before serving",
    )
    p.add_argument(
        "--verify-rate-mb",
        type=float,
        default=0.0,
        help="the background check reads at most this many MiB/s (0: no limit)",
    )
    p.add_argument("--max-message-mb", type=int, default=256, help="largest message, MiB")
    p.add_argument(
        "--max-workers",
        type=int,
        default=64,
        help="threads serving calls; Insert streams take at most all but max(2, 1/8) of them",
    )
    p.add_argument(
        "--max-weights-mb",
        type=int,
        default=DEFAULT_MAX_WEIGHTS_BYTES >> 20,
        help="largest weights PublishWeights takes, MiB",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this HTTP port of --host (0: a free port; with "
        "--shards N, shard i on PORT + i); off by default",
    )
    return p


def serve(args: argparse.Namespace) -> int:
    """Run ``millpond serve`` with parsed arguments until SIGTERM/SIGINT; returns an exit code."""
    if args.shards < 1:
        raise InvalidConfigError(f"--shards ({args.shards}) must be >= 1")
    if args.shards > 1:
        return _serve_many(args)
    tune_shard_process()
    config = ServerConfig(
        dir=args.dir,
        host=args.host,
        port=args.port,
        tables=load_tables(args.tables) if args.tables else (),
        fsync=args.fsync,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token_file=args.token_file,
        max_message_mb=args.max_message_mb,
        max_workers=args.max_workers,
        max_weights_mb=args.max_weights_mb,
        metrics_port=args.metrics_port,
        verify=args.verify,
        verify_rate_mb=args.verify_rate_mb,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    running, port = create_server(config)
    print(f"millpond shard serving {args.dir} on {args.host}:{port}", flush=True)
    print(f"ADDRESSES {args.host}:{port}", flush=True)
    if running.metrics_port is not None:
        print(f"metrics on http://{args.host}:{running.metrics_port}/metrics", flush=True)
    stop.wait()
    log.info("stopping: finishing in-flight calls and checkpointing")
    running.stop(grace=5.0)
    print("millpond shard stopped cleanly", flush=True)
    return 0


def _serve_many(args: argparse.Namespace) -> int:
    """Supervise N single-shard processes on consecutive ports; forward signals to them."""
    base = Path(args.dir)
    children: list[subprocess.Popen] = []
    addresses = []
    passthrough = []
    for flag in ("tables", "tls_cert", "tls_key", "token_file"):
        value = getattr(args, flag)
        if value:
            passthrough += [f"--{flag.replace('_', '-')}", value]
    if args.fsync:
        passthrough.append("--fsync")
    passthrough += ["--max-message-mb", str(args.max_message_mb)]
    passthrough += ["--max-workers", str(args.max_workers), "--host", args.host]
    passthrough += ["--max-weights-mb", str(args.max_weights_mb)]
    passthrough += ["--verify", args.verify, "--verify-rate-mb", str(args.verify_rate_mb)]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for i in range(args.shards):
            port = args.port + i if args.port else 0
            metrics = []
            if args.metrics_port is not None:  # consecutive ports too (0: each a free one)
                metrics = ["--metrics-port", str(args.metrics_port + i if args.metrics_port else 0)]
            cmd = [
                sys.executable,
                "-m",
                "millpond.cli",
                "serve",
                "--dir",
                str(base / f"shard-{i}"),
                "--port",
                str(port),
                *metrics,
                *passthrough,
            ]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            children.append(child)
            addresses.append(_read_address(child))
        print(f"millpond: {args.shards} shards serving {base}", flush=True)
        print(f"ADDRESSES {','.join(addresses)}", flush=True)
        while not stop.wait(0.5):
            dead = [i for i, c in enumerate(children) if c.poll() is not None]
            if dead:
                log.error("shard process(es) %s exited; stopping the others", dead)
                stop.set()
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        codes = [child.wait(30) for child in children]
    print("millpond shards stopped", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def _read_address(child: subprocess.Popen) -> str:
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("ADDRESSES "):
            threading.Thread(target=_drain, args=(child.stdout,), daemon=True).start()
            return line.split()[1]
    raise InvalidConfigError(f"shard process exited with code {child.wait()} before serving")


def _drain(stream) -> None:
    for line in stream:
        sys.stdout.write(line)
    sys.stdout.flush()
