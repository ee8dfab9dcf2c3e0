"""Absurd values in requests are refused by name, never answered INTERNAL.

Each request goes through a real gRPC server as a raw proto (the client would refuse most of
them first). The answer must be INVALID_ARGUMENT or RESOURCE_EXHAUSTED with details naming
the field, its value and its limit; nothing is stored or created on disk; the server keeps
serving.
"""

from __future__ import annotations

import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensordict import TensorDict

from millpond import TableConfig
from millpond.config import (
    MAX_CAPACITY,
    MAX_NAME_BYTES,
    MAX_TABLE_BYTES,
    MAX_TIMEOUT_MS,
)
from millpond.errors import InvalidConfigError
from millpond.protos import codec, samples
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.tables import config_to_proto
from millpond.segments import MAX_STEP
from millpond.service.server import ServerConfig, create_server
from millpond.spec import MAX_KEY_BYTES, MAX_KEY_DEPTH, MAX_ROW_BYTES
from tests.service._wire import segment_proto

REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("absurd")
    running, port = create_server(ServerConfig(dir=str(base / "shard")))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    for config in (TableConfig.uniform("t", 1000), TableConfig.slices("s", 1000, 3)):
        stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(config)))
        insert(stub, config.name, segment(1))
    yield stub, channel, base / "shard"
    channel.close()
    running.stop(grace=1)


def segment(seq: int, first_step: int = 0, n: int = 4, obs_dim: int = 3) -> pb.Segment:
    obs = torch.arange((n + 1) * obs_dim, dtype=torch.float32).reshape(n + 1, obs_dim)
    return segment_proto(seq, obs, first_step=first_step)


def insert(stub, table: str, *segments: pb.Segment, timeout_ms: int = 0, writer: str = "w"):
    request = pb.InsertRequest(
        writer_id=writer, table=table, segments=list(segments), timeout_ms=timeout_ms
    )
    return list(stub.Insert(iter([request]), timeout=30))


def refused(call, *words: str, codes=REFUSED) -> str:
    """Assert ``call()`` fails with one of ``codes``, its details naming each of ``words``."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    error = info.value
    assert error.code() in codes, (error.code(), error.details())
    for word in words:
        assert word in error.details(), (word, error.details())
    return error.details()


def create(stub, exist_ok=False, **fields):
    request = pb.CreateTableRequest(config=pb.TableConfig(**fields), exist_ok=exist_ok)
    return stub.CreateTable(request, timeout=30)


def spec(shape, key=("observation",), dtype="float32"):
    return [pb.FieldSpec(key=list(key), dtype=dtype, shape=shape, role="observation")]


def still_serving(stub, channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    names = {t.config.name for t in stub.Info(pb.InfoRequest(), timeout=10).tables}
    assert {"t", "s"} <= names


@pytest.mark.parametrize(
    "name", ["a" * (MAX_NAME_BYTES + 1), "a" * 10_000, "é" * 200], ids=["256", "10k", "utf8"]
)
def test_long_table_names(served, name):
    stub, channel, shard = served
    refused(lambda: create(stub, name=name, capacity=10), "table name", str(MAX_NAME_BYTES))
    assert sorted(p.name for p in (shard / "tables").iterdir()) == ["s", "t"]
    for call in (
        lambda: stub.Sample(pb.SampleRequest(table=name, batch_size=1, num_batches=1)),
        lambda: stub.Info(pb.InfoRequest(table=name)),
        lambda: stub.Reset(pb.ResetRequest(table=name)),
        lambda: stub.UpdatePriorities(pb.UpdatePrioritiesRequest(table=name)),
        lambda: insert(stub, name, segment(1)),
    ):
        refused(call, "table name", str(MAX_NAME_BYTES))
    still_serving(stub, channel)


@pytest.mark.parametrize(
    "key",
    [("o" * (MAX_KEY_BYTES + 1),), ("o" * 300,), ("o",) * (MAX_KEY_DEPTH + 1), ("ab",) * 100],
    ids=["one-too-long", "300", "deep", "long-and-deep"],
)
def test_long_or_deep_keys(served, key):
    stub, channel, _ = served
    details = refused(lambda: create(stub, name="keys", capacity=10, spec=spec([3], key)), "key")
    assert str(MAX_KEY_BYTES) in details or str(MAX_KEY_DEPTH) in details
    # the same key in an insert into a table that takes its spec from the data
    create(stub, name="keyless", capacity=100, exist_ok=True)
    msg = segment(1)
    t = msg.steps.tensors.add()
    t.CopyFrom(codec.tensor_to_proto(key, torch.zeros(4)))
    details = refused(lambda: insert(stub, "keyless", msg), "key")
    assert str(MAX_KEY_BYTES) in details or str(MAX_KEY_DEPTH) in details
    assert not stub.Info(pb.InfoRequest(table="keyless")).tables[0].config.spec
    still_serving(stub, channel)


def test_the_longest_keys_are_stored(served):
    stub, channel, shard = served
    keys = [("o" * MAX_KEY_BYTES,), ("a" * 125, "b" * 125)]
    fields = [pb.FieldSpec(key=list(k), dtype="uint8", shape=[2], role="observation") for k in keys]
    create(stub, name="longest-keys", capacity=10, spec=fields)
    files = {p.name for p in (shard / "tables" / "longest-keys" / "data" / "columns").iterdir()}
    assert {"o" * MAX_KEY_BYTES + ".bin", "a" * 125 + "." + "b" * 125 + ".bin"} <= files
    still_serving(stub, channel)


@pytest.mark.parametrize("capacity", [MAX_CAPACITY + 1, 2**45, 2**62, 2**63 - 1])
def test_capacity_beyond_the_storage(served, capacity):
    stub, channel, shard = served
    refused(lambda: create(stub, name="huge", capacity=capacity), "capacity", str(MAX_CAPACITY))
    assert not (shard / "tables" / "huge").exists()
    still_serving(stub, channel)


def test_prioritized_capacity_beyond_the_memory(served):
    stub, channel, shard = served
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory > 32 * 2**31:
        pytest.skip("this machine holds the sum tree of the largest prioritized table")
    refused(
        lambda: create(stub, name="prio", capacity=MAX_CAPACITY, sampler="prioritized"),
        "capacity",
        str(MAX_CAPACITY),
        str(memory),
        codes=(grpc.StatusCode.RESOURCE_EXHAUSTED,),
    )
    assert not (shard / "tables" / "prio").exists()
    still_serving(stub, channel)


def test_table_bytes_beyond_what_can_be_mapped(served):
    stub, channel, shard = served
    # 2**31 - 1 slots of 16 KiB: 32 TiB
    refused(
        lambda: create(stub, name="vast", capacity=MAX_CAPACITY, spec=spec([4096])),
        "capacity",
        str(MAX_TABLE_BYTES),
    )
    assert not (shard / "tables" / "vast").exists()
    # the same through the first insert of a table without a spec: refused before its files
    create(stub, name="vast", capacity=MAX_CAPACITY)
    refused(lambda: insert(stub, "vast", segment(1, obs_dim=4096)), str(MAX_TABLE_BYTES))
    assert not (shard / "tables" / "vast" / "data" / "columns").exists()
    info = stub.Info(pb.InfoRequest(table="vast")).tables[0]
    assert info.inserts == 0 and not info.config.spec
    still_serving(stub, channel)


def test_a_first_insert_too_large_for_the_table_is_refused_before_its_files(make_table):
    table = make_table(TableConfig.uniform("vast", MAX_CAPACITY))
    steps = TensorDict(
        {
            "observation": torch.zeros(2, 4096),
            "next": {"terminated": torch.zeros(2, 1, dtype=torch.bool)},
        },
        [2],
    )
    with pytest.raises(InvalidConfigError, match=str(MAX_TABLE_BYTES)):
        table.insert(steps, TensorDict({"observation": torch.zeros(4096)}, []), episode_id=1)
    assert table.spec is None and table.config.spec is None
    assert not (table.path / "data" / "columns").exists()


@pytest.mark.parametrize(
    "shape", [[-4], [2**40], [2**62, 2**62], [0, 2**62, 2**62], [2**16, 2**16]]
)
def test_spec_shapes(served, shape):
    stub, channel, shard = served
    details = refused(lambda: create(stub, name="shaped", capacity=10, spec=spec(shape)), "shape")
    assert "negative" in details or str(MAX_ROW_BYTES) in details
    assert not (shard / "tables" / "shaped").exists()
    still_serving(stub, channel)


@pytest.mark.parametrize("seed", [-1, -(2**63)])
def test_negative_seed(served, seed):
    stub, channel, _ = served
    refused(lambda: create(stub, name="seeded", capacity=10, seed=seed), "seed", str(seed))
    still_serving(stub, channel)


def test_min_size_beyond_any_capacity(served):
    stub, channel, _ = served
    refused(lambda: create(stub, name="never", capacity=10, min_size=2**62), "min_size")
    still_serving(stub, channel)


@pytest.mark.parametrize("batch_size", [1001, 2**31, 2**62, 2**63 - 1])
def test_sample_batch_size_beyond_the_capacity(served, batch_size):
    stub, channel, _ = served
    for table in ("t", "s"):
        request = pb.SampleRequest(table=table, batch_size=batch_size, num_batches=1)
        details = refused(lambda r=request: stub.Sample(r), f"batch_size ({batch_size})")
        assert "capacity" in details and "1000" in details
    assert stub.Info(pb.InfoRequest(table="t")).tables[0].samples == 0
    # slices count steps: 334 slices of 3 steps are more than 1000 slots
    refused(
        lambda: stub.Sample(pb.SampleRequest(table="s", batch_size=334, num_batches=1)),
        "batch_size (334) x slice_len (3) = 1002 steps",
    )
    still_serving(stub, channel)


@pytest.mark.parametrize("timeout_ms", [MAX_TIMEOUT_MS + 1, 2**62, 2**63 - 1, -1])
def test_timeouts_beyond_the_maximum(served, timeout_ms):
    stub, channel, _ = served
    words = ("timeout_ms", str(timeout_ms), str(MAX_TIMEOUT_MS))
    refused(
        lambda: stub.GetWeights(
            pb.GetWeightsRequest(min_version=5, timeout_ms=timeout_ms), timeout=10
        ),
        *words,
    )
    refused(
        lambda: stub.Sample(
            pb.SampleRequest(table="t", batch_size=1, num_batches=1, timeout_ms=timeout_ms),
            timeout=10,
        ),
        *words,
    )
    refused(lambda: insert(stub, "t", segment(2), timeout_ms=timeout_ms, writer=""), *words)
    still_serving(stub, channel)


@pytest.mark.parametrize("first_step", [2**63 - 4, 2**63 - 1, MAX_STEP - 3, -1, -(2**63)], ids=str)
def test_first_step_out_of_range(served, first_step):
    stub, channel, _ = served
    for table in ("t", "s"):
        before = stub.Info(pb.InfoRequest(table=table)).tables[0].inserts
        refused(
            lambda t=table: insert(stub, t, segment(7, first_step=first_step), writer="steps"),
            "first_step",
            str(first_step),
            str(MAX_STEP),
        )
        packed = pb.PackedSegments(
            episode_ids=[7], first_steps=[first_step], lengths=[4], sequences=[7]
        )
        seg = segment(7)
        packed.steps.CopyFrom(seg.steps)
        packed.tails.CopyFrom(
            codec.to_tensor_map({("observation",): torch.zeros(1, 3)}, batch_size=[1])
        )
        request = pb.InsertRequest(writer_id="steps", table=table, packed=[packed])
        refused(
            lambda r=request: list(stub.Insert(iter([r]))),
            "first_step",
            str(first_step),
            str(MAX_STEP),
        )
        assert stub.Info(pb.InfoRequest(table=table)).tables[0].inserts == before
    # the last steps that fit (the tail's is 2**63 - 1) are taken, and sampled back unwrapped
    insert(stub, "s", segment(8, first_step=MAX_STEP - 4), writer="edge")
    response = next(stub.Sample(pb.SampleRequest(table="s", batch_size=300, num_batches=1)))
    batch = samples.decode_sample(response)
    steps = batch["step"][batch["episode_id"] == 8]
    assert len(steps) and bool((steps >= MAX_STEP - 4).all()) and bool((steps < MAX_STEP).all())
    assert bool((batch["step"] >= 0).all())
    still_serving(stub, channel)


def test_weights_total_size(served):
    stub, channel, _ = served
    for total in (2**62, (4 << 30) + 1):
        refused(
            lambda t=total: stub.PublishWeights(
                iter([pb.PublishWeightsRequest(version=1, total_size=t, chunk=b"x")])
            ),
            "total_size",
            str(total),
            str(4 << 30),
        )
    assert stub.Info(pb.InfoRequest()).weights_version == -1
    still_serving(stub, channel)


def test_error_details_stay_short(served):
    stub, channel, _ = served
    # a megabyte of key in a tensor: its error must still arrive (details travel in a header)
    msg = segment(1)
    msg.steps.tensors.add().CopyFrom(
        pb.Tensor(key=["x" * 1_000_000], dtype="float32", shape=[4], data=bytes(16))
    )
    details = refused(lambda: insert(stub, "t", msg), "key")
    assert len(details) < 5000
    still_serving(stub, channel)


@pytest.mark.parametrize("sequence", [2**63, 2**64 - 1], ids=str)
def test_segment_sequence_out_of_range(served, sequence):
    """The wire's uint64 sequence must fit the table's int64 (found by the fuzz test)."""
    stub, _, _ = served
    before = stub.Info(pb.InfoRequest(table="t")).tables[0].inserts
    seg = segment(7)
    seg.sequence = sequence
    refused(lambda: insert(stub, "t", seg, writer="seq"), "sequence", str(sequence), "2**63")
    assert stub.Info(pb.InfoRequest(table="t")).tables[0].inserts == before


def test_a_key_of_empty_rows_is_stored_and_sampled(make_table):
    """A key whose rows hold no bytes (shape ``[L, 0]``): its column file is empty, and
    reserving its disk space asked ``posix_fallocate`` for 0 bytes (EINVAL), which failed
    every insert as an internal error."""
    from millpond.testing import constant_segment

    table = make_table(TableConfig.uniform("empty-rows", 64))
    steps, tail = constant_segment(3, length=6)
    steps["nothing"] = torch.empty(6, 0)
    table.insert(steps, tail, episode_id=3)
    batch = table.sample(16)
    assert batch["nothing"].shape == (16, 0)
    assert torch.equal(batch["observation"], torch.full((16, 4), 3.0))
