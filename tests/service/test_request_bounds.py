"""One small request must not make a shard allocate gigabytes.

Each request here is a few kilobytes that declares something huge: a tensor shape zstd would
inflate to hundreds of megabytes, weights of 2**62 bytes, a batch of millions of steps. The
shard must refuse each by name before allocating it. The shard is a real ``millpond serve``
process, and its peak resident memory (``VmHWM`` in ``/proc/PID/status``) is read before
and after each request: it must not grow by more than :data:`MAX_GROWTH`.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import zstandard
from tensordict import TensorDict

from millpond import TableConfig
from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.tables import config_to_proto
from tests.service._wire import segment_proto, steps_td

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads peak memory from /proc"
)

MAX_GROWTH = 100 << 20
MiB = 1 << 20


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def reset_peak(pid: int) -> None:
    """Reset ``VmHWM`` to the current RSS, so that an earlier request's peak hides nothing."""
    # Where that fails (an older kernel), the peak since start only makes the check stricter.
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


class Served:
    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc = proc
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.ReplayStub(self.channel)

    def growth(self, call) -> tuple[grpc.RpcError, int]:
        """Run ``call`` (it must fail); returns its error and the server's peak-RSS growth."""
        reset_peak(self.proc.pid)
        before = peak_rss(self.proc.pid)
        with pytest.raises(grpc.RpcError) as info:
            call()
        time.sleep(0.2)  # let the server finish whatever it still does with the request
        growth = peak_rss(self.proc.pid) - before
        print(f"peak RSS {before / MiB:.0f} MiB, +{growth / MiB:.1f} MiB: {info.value.code()}")
        return info.value, growth


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("bounds")
    out = base / "server.out"
    with open(out, "w") as stdout, open(base / "server.err", "w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "millpond.cli",
                "serve",
                "--dir",
                str(base / "shard"),
                "--port=0",
            ],
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 90
        address = None
        while address is None:
            assert proc.poll() is None, (base / "server.err").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            for line in out.read_text().splitlines():
                if line.startswith("ADDRESSES "):
                    address = line.split()[1]
            time.sleep(0.05)
        served = Served(proc, address)
        yield served
        served.channel.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def create(stub, config: TableConfig) -> None:
    stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(config)))


def zstd_bomb(key: str, shape: list[int]) -> pb.Tensor:
    """A float32 tensor of ``shape`` whose zeros compress to a few kilobytes."""
    nbytes = 4
    for s in shape:
        nbytes *= s
    compressor = zstandard.ZstdCompressor(level=3)
    chunk = bytes(MiB)
    writer = compressor.compressobj(size=nbytes)
    data = b"".join(writer.compress(chunk) for _ in range(nbytes // MiB)) + writer.flush()
    return pb.Tensor(
        key=[key], dtype="float32", shape=shape, data=data, compression=pb.COMPRESSION_ZSTD
    )


def bomb_request(table: str, n: int, shape: list[int]) -> pb.InsertRequest:
    """An insert whose observation declares ``shape`` (zstd zeros: a small message)."""
    small = steps_td(torch.zeros(n, 3))
    steps = codec.to_tensor_map(small.exclude("observation"))
    steps.tensors.append(zstd_bomb("observation", shape))
    tail = pb.TensorMap(tensors=[zstd_bomb("observation", shape[1:])])
    segment = pb.Segment(sequence=1, episode_id=1, steps=steps, tail=tail)
    return pb.InsertRequest(writer_id="bomb", table=table, segments=[segment])


def test_a_zstd_bomb_over_the_message_limit_is_refused_before_decompressing(served):
    create(served.stub, TableConfig.uniform("bomb", 1000))
    request = bomb_request("bomb", 4, [4, 128 * MiB // 4])  # 512 MiB declared, over 256 MiB
    assert request.ByteSize() < 100_000
    error, growth = served.growth(lambda: list(served.stub.Insert(iter([request]))))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "observation" in error.details() and "message limit" in error.details()
    assert str(256 * MiB) in error.details()
    assert growth < MAX_GROWTH, f"the server grew by {growth / MiB:.0f} MiB"
    info = served.stub.Info(pb.InfoRequest(table="bomb")).tables[0]
    assert info.inserts == 0 and not info.config.spec


def test_a_shape_the_spec_does_not_declare_is_refused_before_decompressing(served):
    create(served.stub, TableConfig.uniform("specced", 1000))
    ok = steps_td(torch.zeros(4, 3))
    tail = TensorDict({"observation": torch.zeros(3)}, [])
    seg = pb.Segment(
        sequence=1, episode_id=1, steps=codec.to_tensor_map(ok), tail=codec.to_tensor_map(tail)
    )
    list(
        served.stub.Insert(iter([pb.InsertRequest(writer_id="w", table="specced", segments=[seg])]))
    )
    # 200 MiB declared: under the message limit, but not the spec's float32[3] per step
    request = bomb_request("specced", 4, [4, 50 * MiB // 4])
    error, growth = served.growth(lambda: list(served.stub.Insert(iter([request]))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "observation" in error.details() and "float32[3]" in error.details()
    assert growth < MAX_GROWTH, f"the server grew by {growth / MiB:.0f} MiB"


def test_overflowing_dimensions_are_refused_by_name(served):
    create(served.stub, TableConfig.uniform("overflow", 1000))
    for shape in ([4, 2**62], [4, 2**62, 2**62], [0, 2**62, 2**62]):
        t = pb.Tensor(key=["observation"], dtype="float32", shape=shape, data=b"")
        seg = pb.Segment(sequence=1, episode_id=1, steps=pb.TensorMap(batch_size=[4], tensors=[t]))
        request = pb.InsertRequest(writer_id="o", table="overflow", segments=[seg])
        error, growth = served.growth(lambda r=request: list(served.stub.Insert(iter([r]))))
        assert error.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ), error.details()
        assert "observation" in error.details() and str(2**62) in error.details()
        assert growth < MAX_GROWTH


def test_weights_larger_than_the_limit_are_refused_at_the_first_message(served):
    chunk = bytes(4 * MiB)

    def stream():
        yield pb.PublishWeightsRequest(version=1, total_size=2**62, chunk=chunk)
        for _ in range(100):  # 400 MiB more, if the server kept reading
            yield pb.PublishWeightsRequest(chunk=chunk)

    error, growth = served.growth(lambda: served.stub.PublishWeights(stream(), timeout=60))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "total_size" in error.details() and str(2**62) in error.details()
    assert str(4 << 30) in error.details()
    assert growth < MAX_GROWTH, f"the server grew by {growth / MiB:.0f} MiB"
    assert served.stub.Info(pb.InfoRequest()).weights_version == -1


def test_a_huge_sample_batch_is_refused_before_sampling(served):
    create(served.stub, TableConfig.uniform("wide", 10_000_000))
    seg = segment_proto(1, torch.arange(15, dtype=torch.float32).reshape(5, 3))
    list(served.stub.Insert(iter([pb.InsertRequest(writer_id="w", table="wide", segments=[seg])])))
    start = time.monotonic()
    error, growth = served.growth(
        lambda: list(
            served.stub.Sample(pb.SampleRequest(table="wide", batch_size=8_000_000, num_batches=1))
        )
    )
    assert time.monotonic() - start < 5
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "batch_size (8000000)" in error.details() and "message limit" in error.details()
    assert growth < MAX_GROWTH, f"the server grew by {growth / MiB:.0f} MiB"
    # Asked colocated (no observations in the answer), the same batch is refused too: its
    # step keys and indices alone exceed the limit.
    error, growth = served.growth(
        lambda: list(
            served.stub.Sample(
                pb.SampleRequest(table="wide", batch_size=8_000_000, num_batches=1, colocated=True)
            )
        )
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert growth < MAX_GROWTH, f"the server grew by {growth / MiB:.0f} MiB"
    # nothing was counted as sampled, and a batch that fits still comes
    assert served.stub.Info(pb.InfoRequest(table="wide")).tables[0].samples == 0
    batches = list(served.stub.Sample(pb.SampleRequest(table="wide", batch_size=8, num_batches=1)))
    assert len(batches) == 1
