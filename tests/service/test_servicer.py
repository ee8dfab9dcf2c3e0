"""The gRPC edge with raw stubs: every kind of bad request gets its status; data stays intact."""

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from millpond import TableConfig
from millpond.protos import codec, samples
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.tables import config_to_proto
from millpond.service.server import ServerConfig, create_server
from tests.service._wire import segment_proto

TOKENS = {"writer": "writer-token-1", "learner": "learner-token-1", "admin": "admin-token-12"}


def make_segment(seq, n=4, obs_dim=3, dtype=torch.float32):
    obs = torch.arange((n + 1) * obs_dim, dtype=dtype).reshape(n + 1, obs_dim) + 100 * seq
    return segment_proto(seq, obs)


@pytest.fixture
def server(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard"), max_message_mb=1))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(TableConfig.uniform("t", 1000))))
    yield stub, channel
    channel.close()
    running.stop(grace=1)


def make_packed(seqs, n=4, dtype=torch.float32):
    """The segments ``make_segment(q, n)`` for each ``q`` of ``seqs``, as one packed message."""
    obs = [torch.arange((n + 1) * 3, dtype=dtype).reshape(n + 1, 3) + 100 * q for q in seqs]
    k = len(seqs)
    steps = {
        ("observation",): torch.cat([o[:-1] for o in obs]),
        ("action",): torch.zeros(k * n, dtype=torch.int64),
        ("next", "reward"): torch.ones(k * n, 1),
        ("next", "terminated"): torch.zeros(k * n, 1, dtype=torch.bool),
        ("next", "truncated"): torch.zeros(k * n, 1, dtype=torch.bool),
    }
    return pb.PackedSegments(
        sequences=list(seqs),
        episode_ids=list(seqs),
        first_steps=[0] * k,
        lengths=[n] * k,
        steps=codec.to_tensor_map(steps, batch_size=[k * n]),
        tails=codec.to_tensor_map({("observation",): torch.stack([o[-1] for o in obs])}, [k]),
    )


def insert(stub, *segments, packed=(), table="t", writer="w", metadata=None):
    request = pb.InsertRequest(
        writer_id=writer, table=table, segments=list(segments), packed=list(packed)
    )
    return list(stub.Insert(iter([request]), metadata=metadata))


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
    batch = samples.decode_sample(response)
    assert torch.equal(batch["next", "observation"], batch["observation"] + 3)
    assert response.mass == 12


def test_packed_segments_round_trip_and_idempotent_resend(server):
    stub, _ = server
    acks = insert(stub, packed=[make_packed([1, 2, 3])])
    assert [list(a.sequences) for a in acks] == [[1, 2, 3]]
    insert(stub, packed=[make_packed([2, 3, 4])])  # 2 and 3 again: only 4 is new
    assert size(stub) == 16
    # Single segments and packed ones in one request, stored in sequence order.
    acks = insert(stub, make_segment(5), packed=[make_packed([6, 7]), make_packed([8])])
    assert list(acks[0].sequences) == [5, 6, 7, 8] and acks[0].stored_through == 8
    assert size(stub) == 32
    request = pb.SampleRequest(table="t", batch_size=256, num_batches=1)
    batch = samples.decode_sample(next(stub.Sample(request)))
    assert torch.equal(batch["next", "observation"], batch["observation"] + 3)
    assert set(batch["episode_id"].tolist()) == set(range(1, 9))


def test_bad_packed_segments_get_invalid_argument_and_store_nothing(server):
    stub, _ = server
    insert(stub, packed=[make_packed([1, 2])])

    def edited(edit, seqs=(3, 4, 5)):
        msg = make_packed(list(seqs))
        edit(msg)
        return msg

    def ends_inside(msg):
        steps = codec.from_tensor_map(msg.steps)
        steps["next", "terminated"][1] = True  # step 1 of a 4-step segment
        msg.steps.CopyFrom(codec.to_tensor_map(steps))

    cases = {
        "the lengths' sum": lambda m: m.lengths.__setitem__(2, 5),
        "one per segment": lambda m: m.tails.CopyFrom(
            codec.to_tensor_map({("observation",): torch.zeros(2, 3)}, [2])
        ),
        "episode_ids": lambda m: m.episode_ids.pop(),
        "sequences": lambda m: m.sequences.pop(),
        "at least one step": lambda m: (m.lengths.__setitem__(0, 0), m.lengths.__setitem__(1, 8)),
        "increasing": lambda m: m.sequences.__setitem__(1, 3),
        "out of range": lambda m: m.sequences.__setitem__(2, 2**64 - 1),
        "episode end": ends_inside,
    }
    for words, edit in cases.items():
        code, details = code_of(lambda e=edit: insert(stub, packed=[edited(e)]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (words, details)
    # The same keys with another dtype, beside good segments in one request: none stored.
    code, details = code_of(
        lambda: insert(stub, make_segment(3), packed=[make_packed([4], dtype=torch.float64)])
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in details
    assert size(stub) == 8
    assert list(insert(stub, packed=[make_packed([3])])[0].sequences) == [3]
    assert size(stub) == 12


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
    batch = samples.decode_sample(next(stub.Sample(pb.SampleRequest(table="t", batch_size=8))))
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
    taken = samples.decode_sample(next(stub.Sample(request)))
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


def test_weights_at_once_round_trip_and_refusals(server):
    """PublishWeightsAtOnce stores one message's blob as PublishWeights stores the chunks,
    and refuses what PublishWeights refuses."""
    stub, _ = server
    blob = bytes(range(256)) * 100
    request = pb.PublishWeightsRequest(version=5, total_size=len(blob), chunk=blob)
    assert stub.PublishWeightsAtOnce(request).version == 5
    replies = list(stub.GetWeights(pb.GetWeightsRequest(min_version=5)))
    assert replies[0].version == 5 and b"".join(r.chunk for r in replies) == blob
    stale = pb.PublishWeightsRequest(version=5, total_size=1, chunk=b"x")
    code, details = code_of(lambda: stub.PublishWeightsAtOnce(stale))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not newer" in details
    truncated = pb.PublishWeightsRequest(version=9, total_size=10, chunk=b"x")
    code, details = code_of(lambda: stub.PublishWeightsAtOnce(truncated))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in details
    longer = pb.PublishWeightsRequest(version=9, total_size=1, chunk=b"xy")
    code, details = code_of(lambda: stub.PublishWeightsAtOnce(longer))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "larger than" in details
    huge = pb.PublishWeightsRequest(version=9, total_size=2**62, chunk=b"x")
    code, details = code_of(lambda: stub.PublishWeightsAtOnce(huge))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "total_size" in details
    assert stub.Info(pb.InfoRequest()).weights_version == 5


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
    weights = pb.PublishWeightsRequest(version=0, total_size=1, chunk=b"w")
    assert stub.PublishWeightsAtOnce(weights, metadata=auth("learner")).version == 0
    assert code_of(lambda: stub.PublishWeightsAtOnce(weights, metadata=auth("writer")))[0] == (
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


def test_abandoned_get_weights_calls_free_their_threads(tmp_path):
    """Eight GetWeights calls waiting 30 s for weights that never come, cancelled at once:
    the shard's four threads are free again within a wait slice, not after 30 s."""
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard"), max_workers=4))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    try:
        waiting = pb.GetWeightsRequest(min_version=10, timeout_ms=30_000)
        calls = [stub.GetWeights(waiting, timeout=60) for _ in range(8)]
        time.sleep(1.0)  # they reach the shard and hold its threads
        for call in calls:
            call.cancel()
        started = time.monotonic()
        stub.Info(pb.InfoRequest(), timeout=10)  # queued behind the abandoned calls
        assert time.monotonic() - started < 5.0
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
        running.stop(grace=1)
