"""More writer streams than server threads: probes and learners are still answered."""

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from millpond import ReplayClient, TableConfig
from millpond.errors import ResourceExhaustedError, ShardBusyError
from millpond.learner.client import _insert_stream
from millpond.learner.client._errors import from_rpc_error, is_retryable
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment as segment

pytestmark = pytest.mark.timeout(120)
MAX_WORKERS = 4


@pytest.fixture
def busy_shard(tmp_path):
    server, port = create_server(ServerConfig(dir=str(tmp_path / "s"), max_workers=MAX_WORKERS))
    yield f"127.0.0.1:{port}"
    server.stop(grace=0.5)


def health_check(address: str, timeout_s: float = 5.0) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="millpond.v1.Replay")
        return stub.Check(request, timeout=timeout_s).status


def test_probes_and_learners_answer_while_writers_fill_the_shard(busy_shard):
    client = ReplayClient(busy_shard, timeout_s=10)
    client.create_table(TableConfig.uniform("t", capacity=10_000))
    writers = [
        client.writer("t", writer_id=f"actor-{i}", timeout_s=60) for i in range(MAX_WORKERS + 2)
    ]
    for i, writer in enumerate(writers):  # every writer opens its stream and keeps it open
        writer.write_segment(*segment(i), episode_id=i, first_step=0)
    time.sleep(1.0)
    for _ in range(3):
        started = time.monotonic()
        assert health_check(busy_shard) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < 5
        assert client.info("t")["size"] >= 0  # Info finds a thread too
    batch = client.sample("t", 4, timeout_s=10)  # and a learner's Sample stream
    assert batch.batch_size == torch.Size([4])

    # Writers refused as busy retry: all of them deliver once others close.
    errors = []

    def close(writer):
        try:
            writer.close(timeout_s=60)
        except Exception as e:  # the test reports it
            errors.append(e)

    threads = [threading.Thread(target=close, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors and not any(t.is_alive() for t in threads)
    assert all(w.acked == 1 for w in writers)
    assert client.info("t")["size"] == 8 * len(writers)
    client.close(timeout_s=10)


def test_a_stream_past_the_bound_is_refused_at_once_as_busy(busy_shard):
    channels = [grpc.insecure_channel(busy_shard) for _ in range(MAX_WORKERS + 1)]
    stub_calls = []
    released = threading.Event()

    def requests(i):
        yield pb.InsertRequest(writer_id=f"raw-{i}", table="t", timeout_ms=0)
        released.wait(30)

    with ReplayClient(busy_shard, timeout_s=10) as client:
        client.create_table(TableConfig.uniform("t", capacity=100))
    try:
        for i, channel in enumerate(channels):
            stub_calls.append(pb_grpc.ReplayStub(channel).Insert(requests(i)))
        refused = []
        for call in stub_calls:
            try:
                next(call)  # an admitted stream answers its opening request
            except grpc.RpcError as e:
                refused.append(e)
        assert refused, "more Insert streams than threads were all admitted"
        for err in refused:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "shard busy" in err.details()
            assert is_retryable(err)
            mapped = from_rpc_error(err)
            assert isinstance(mapped, ShardBusyError)
            assert isinstance(mapped, ResourceExhaustedError)
        assert health_check(busy_shard) == health_pb2.HealthCheckResponse.SERVING
    finally:
        released.set()
        for call in stub_calls:
            call.cancel()
        for channel in channels:
            channel.close()


def test_publications_waiting_for_the_actors_take_stream_places(busy_shard):
    """PublishWeightsAtOnce is unary, but waits for the acting actors as long as a stream:
    such calls take stream places, so that a probe still finds a thread."""
    channel = grpc.insecure_channel(busy_shard)
    stub = pb_grpc.ReplayStub(channel)
    # an actor acting with no weights holds back every version > max_lag - 1
    list(stub.GetWeights(pb.GetWeightsRequest(actor="a", acting=True, min_version=0)))
    waiting = [
        stub.PublishWeightsAtOnce.future(
            pb.PublishWeightsRequest(version=10 + i, total_size=1, chunk=b"w", max_lag=1),
            timeout=30,
        )
        for i in range(MAX_WORKERS - 1)
    ]
    try:
        time.sleep(0.5)  # the waiting calls take their places
        assert not any(call.done() for call in waiting)
        request = pb.PublishWeightsRequest(version=20, total_size=1, chunk=b"w", max_lag=1)
        with pytest.raises(grpc.RpcError) as refused:
            stub.PublishWeightsAtOnce(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shard busy" in refused.value.details()
        assert health_check(busy_shard) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for call in waiting:
            call.cancel()
        channel.close()


def test_idle_writers_make_room_for_refused_ones(busy_shard, monkeypatch):
    monkeypatch.setattr(_insert_stream, "IDLE_STREAM_S", 0.5)
    client = ReplayClient(busy_shard, timeout_s=10)
    client.create_table(TableConfig.uniform("idle", capacity=10_000))
    writers = [client.writer("idle", writer_id=f"idle-{i}") for i in range(MAX_WORKERS + 2)]
    for i, writer in enumerate(writers):
        writer.write_segment(*segment(i), episode_id=i, first_step=0)
    deadline = time.monotonic() + 60
    while not all(w.acked == 1 for w in writers):  # none closes: idle streams give way
        assert time.monotonic() < deadline, [w.acked for w in writers]
        time.sleep(0.1)
    for i, writer in enumerate(writers):  # a writer whose idle stream ended writes on
        writer.write_segment(*segment(100 + i), episode_id=100 + i, first_step=0)
    client.close(timeout_s=60)
    with ReplayClient(busy_shard, timeout_s=10) as check:
        assert check.info("idle")["size"] == 8 * 2 * len(writers)


def test_a_sample_refused_as_busy_is_asked_again_within_its_wait(busy_shard):
    client = ReplayClient(busy_shard, timeout_s=10)
    client.create_table(TableConfig.uniform("full", capacity=1_000))
    client.create_table(TableConfig.uniform("empty", capacity=1_000))
    with client.writer("full", writer_id="filler") as writer:
        for ep in range(4):
            writer.write_segment(*segment(ep), episode_id=ep, first_step=0)
    # Two writers take the Insert places, a Sample waiting on an empty table the last
    # stream place: the next Sample is refused as busy until that one gives up.
    writers = [client.writer("full", writer_id=f"hold-{i}") for i in range(2)]
    for i, writer in enumerate(writers):
        writer.write_segment(*segment(10 + i), episode_id=10 + i, first_step=0)
        writer.flush(timeout_s=10)
    with grpc.insecure_channel(busy_shard) as channel:
        hog = pb_grpc.ReplayStub(channel).Sample(
            pb.SampleRequest(table="empty", batch_size=1, num_batches=1, timeout_ms=2000)
        )
        time.sleep(0.5)
        batch = client.sample("full", 4, timeout_s=20)
        assert batch.batch_size == torch.Size([4])
        with pytest.raises(grpc.RpcError):
            list(hog)  # it timed out on the empty table, freeing its place
    client.close(timeout_s=10)
