"""The gRPC edge with raw stubs: every kind of bad request gets its status; data stays intact."""

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensordict import TensorDict

from millpond import TableConfig
from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.tables import config_to_proto
from millpond.service.server import ServerConfig, create_server

TOKENS = {"writer": "writer-token-1", "learner": "learner-token-1", "admin": "admin-token-12"}


def make_segment(seq, n=4, obs_dim=3, dtype=torch.float32):
    obs = torch.arange((n + 1) * obs_dim, dtype=dtype).reshape(n + 1, obs_dim) + 100 * seq
    steps = TensorDict(
        {
            "observation": obs[:-1],
            "action": torch.zeros(n, dtype=torch.int64),
            "next": {
                "reward": torch.ones(n, 1),
                "terminated": torch.zeros(n, 1, dtype=torch.bool),
                "truncated": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        [n],
    )
    tail = TensorDict({"observation": obs[-1]}, [])
    return pb.Segment(
        sequence=seq,
        episode_id=seq,
        first_step=0,
        steps=codec.to_tensor_map(steps),
        tail=codec.to_tensor_map(tail),
    )


@pytest.fixture
def server(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard"), max_message_mb=1))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(TableConfig.uniform("t", 1000))))
    yield stub, channel
    channel.close()
    running.stop(grace=1)


def insert(stub, *segments, table="t", writer="w", metadata=None):
    requests = [pb.InsertRequest(writer_id=writer, table=table, segments=list(segments))]
    return list(stub.Insert(iter(requests), metadata=metadata))


def size(stub):
    return stub.Info(pb.InfoRequest(table="t")).tables[0].size


def code_of(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_round_trip_and_idempotent_resend(server):
    stub, _ = server
    acks = insert(stub, make_segment(1), make_segment(2))
    assert [list(a.sequences) for a in acks] == [[1, 2]]
    insert(stub, make_segment(2), make_segment(3))  # 2 again: acknowledged, not stored twice
    assert size(stub) == 12
    response = next(stub.Sample(pb.SampleRequest(table="t", batch_size=64, num_batches=1)))
    batch = codec.decode_sample(response)
    assert torch.equal(batch["next", "observation"], batch["observation"] + 3)
    assert response.mass == 12


def test_bad_requests_get_statuses_and_store_nothing(server):
    stub, _ = server
    insert(stub, make_segment(1))
    bad_bytes = make_segment(2)
    bad_bytes.steps.tensors[0].data = b"\x00" * 5
    code, details = code_of(lambda: insert(stub, bad_bytes))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "expected" in details
    code, details = code_of(lambda: insert(stub, make_segment(2, dtype=torch.float64)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'observation'" in details and "float32[3]" in details and "float64[3]" in details
    bad_dtype = make_segment(2)
    bad_dtype.steps.tensors[0].dtype = "float128"
    assert code_of(lambda: insert(stub, bad_dtype))[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, details = code_of(lambda: insert(stub, make_segment(2), table="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
    huge = make_segment(2, n=50_000)  # > the 1 MiB message limit of this server
    assert code_of(lambda: insert(stub, huge))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _ = code_of(lambda: next(stub.Sample(pb.SampleRequest(table="t", batch_size=0))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(lambda: next(stub.Sample(pb.SampleRequest(table="zz", batch_size=4))))
    assert code == grpc.StatusCode.NOT_FOUND
    bad_config = pb.CreateTableRequest(config=pb.TableConfig(name="x", capacity=-5))
    code, details = code_of(lambda: stub.CreateTable(bad_config))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "capacity" in details
    code, _ = code_of(
        lambda: next(stub.Sample(pb.SampleRequest(table="t", batch_size=10**6, timeout_ms=-1)))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert size(stub) == 4  # none of it changed what was stored
    batch = codec.decode_sample(next(stub.Sample(pb.SampleRequest(table="t", batch_size=8))))
    assert torch.equal(batch["next", "observation"], batch["observation"] + 3)


def test_rate_limiter_timeout_is_deadline_exceeded(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    stub = pb_grpc.ReplayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    cfg = TableConfig.uniform("t", 100, min_size=50)
    stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(cfg)))
    request = pb.SampleRequest(table="t", batch_size=4, num_batches=1, timeout_ms=100)
    code, details = code_of(lambda: next(stub.Sample(request)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "min_size 50" in details
    running.stop(grace=1)


@pytest.mark.parametrize("kind", ["uniform", "queue"])
def test_a_sample_cancelled_while_it_waits_is_not_counted(tmp_path, kind):
    """A learner that gives up on a waiting request (a prefetching iterator closed, its
    deadline reached) is not charged for the steps the data arriving afterwards frees."""
    running, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    stub = pb_grpc.ReplayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    cfg = getattr(TableConfig, kind)("t", 100, min_size=8)
    stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(cfg)))
    request = pb.SampleRequest(table="t", batch_size=8, num_batches=1, timeout_ms=30_000)
    waiting = stub.Sample(request)  # the call starts here and waits on the empty table
    time.sleep(0.2)
    waiting.cancel()
    insert(stub, make_segment(1, n=8))  # frees the waiting request, if it were still there
    time.sleep(1.0)  # longer than the shard takes to notice a cancelled call
    info = stub.Info(pb.InfoRequest(table="t")).tables[0]
    assert (info.samples, info.size) == (0, 8)
    taken = codec.decode_sample(next(stub.Sample(request)))
    assert len(taken) == 8 and set(taken["observation"][:, 0].tolist()) <= {
        100.0 + 3 * i for i in range(8)
    }
    assert stub.Info(pb.InfoRequest(table="t")).tables[0].samples == 8
    running.stop(grace=1)


def test_weights_round_trip_in_chunks(server):
    stub, _ = server
    blob = bytes(range(256)) * 20_000  # 5 MB: several chunks, larger than one message
    chunks = [blob[i : i + 300_000] for i in range(0, len(blob), 300_000)]
    requests = [pb.PublishWeightsRequest(version=3, total_size=len(blob), chunk=chunks[0])]
    requests += [pb.PublishWeightsRequest(chunk=c) for c in chunks[1:]]
    assert stub.PublishWeights(iter(requests)).version == 3
    replies = list(stub.GetWeights(pb.GetWeightsRequest(min_version=0)))
    assert replies[0].version == 3 and b"".join(r.chunk for r in replies) == blob
    older = list(stub.GetWeights(pb.GetWeightsRequest(min_version=4)))
    assert len(older) == 1 and older[0].version == 3 and not older[0].chunk
    stale = [pb.PublishWeightsRequest(version=2, total_size=1, chunk=b"x")]
    code, details = code_of(lambda: stub.PublishWeights(iter(stale)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not newer" in details
    truncated = [pb.PublishWeightsRequest(version=9, total_size=10, chunk=b"x")]
    assert code_of(lambda: stub.PublishWeights(iter(truncated)))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert stub.Info(pb.InfoRequest()).weights_version == 3


def test_health_is_serving(server):
    _, channel = server
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "millpond.v1.Replay"):
        status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_token_roles(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{role} {tok}\n" for role, tok in TOKENS.items()))
    running, port = create_server(ServerConfig(dir=str(tmp_path / "s"), token_file=str(token_file)))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)

    def auth(role):
        return [("authorization", f"Bearer {TOKENS[role]}")]

    create = pb.CreateTableRequest(config=config_to_proto(TableConfig.uniform("t", 100)))
    assert code_of(lambda: stub.CreateTable(create))[0] == grpc.StatusCode.UNAUTHENTICATED
    bad = [("authorization", "Bearer not-a-valid-token")]
    assert code_of(lambda: stub.CreateTable(create, metadata=bad))[0] == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    for role in ("writer", "learner"):
        code, details = code_of(lambda r=role: stub.CreateTable(create, metadata=auth(r)))
        assert code == grpc.StatusCode.PERMISSION_DENIED and role in details
    stub.CreateTable(create, metadata=auth("admin"))
    insert(stub, make_segment(1), metadata=auth("writer"))
    assert code_of(lambda: insert(stub, make_segment(2), metadata=auth("learner")))[0] == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    sample = pb.SampleRequest(table="t", batch_size=2, num_batches=1)
    assert len(list(stub.Sample(sample, metadata=auth("learner")))) == 1
    assert code_of(lambda: list(stub.Sample(sample, metadata=auth("writer"))))[0] == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    for role in TOKENS:
        assert stub.Info(pb.InfoRequest(), metadata=auth(role)).tables[0].size == 4
    health = health_pb2_grpc.HealthStub(channel)  # probes need no token
    assert health.Check(health_pb2.HealthCheckRequest()).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    channel.close()
    running.stop(grace=1)


@pytest.mark.parametrize(
    "content, message",
    [("", "no tokens"), ("root abcdefgh\n", "ROLE TOKEN"), ("admin short\n", "too short")],
)
def test_bad_token_file(tmp_path, content, message):
    from millpond.errors import InvalidConfigError

    token_file = tmp_path / "tokens"
    token_file.write_text(content)
    with pytest.raises(InvalidConfigError, match=message):
        create_server(ServerConfig(dir=str(tmp_path / "s"), token_file=str(token_file)))
