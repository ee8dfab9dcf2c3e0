"""A shard that takes the stream and never answers: every wait of a writer has a bound."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from millpond import DeadlineExceededError, InvalidConfigError, ReplayClient, TableConfig
from millpond.learner.client.writer import DEFAULT_TIMEOUT_S
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.service.server import ServerConfig, create_server
from millpond.testing import constant_segment as segment

pytestmark = pytest.mark.timeout(60)


class _Wedged(pb_grpc.ReplayServicer):
    """Takes Insert streams and reads them, but never acknowledges a request."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Insert(self, request_iterator, context):
        def drain():
            try:
                for _ in request_iterator:
                    pass
            except grpc.RpcError:  # the writer cancelled its stream
                pass

        threading.Thread(target=drain, daemon=True).start()
        self.release.wait()
        return iter(())


@pytest.fixture
def wedged_shard():
    servicer = _Wedged()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ReplayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    servicer.release.set()
    server.stop(0)


def in_thread(fn):
    """Run ``fn`` in a thread; returns (thread, outcome list) to join with a bound."""
    outcome = []

    def body():
        try:
            outcome.append(fn())
        except BaseException as e:  # the test inspects it
            outcome.append(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def test_writer_default_deadline_is_documented():
    assert DEFAULT_TIMEOUT_S == 60.0
    assert "timeout_s" in ReplayClient.writer.__doc__


def test_blocked_write_raises_naming_shard_writer_and_count(wedged_shard):
    client = ReplayClient(wedged_shard, timeout_s=5)
    writer = client.writer("t", writer_id="stuck-actor", max_in_flight=2, timeout_s=1.0)

    def write_many():
        for ep in range(10):
            writer.write_segment(*segment(ep), episode_id=ep, first_step=0)

    thread, outcome = in_thread(write_many)
    thread.join(20)
    assert not thread.is_alive(), "a write blocked on max_in_flight must give up"
    (err,) = outcome
    assert isinstance(err, DeadlineExceededError)
    message = str(err)
    assert wedged_shard in message and "stuck-actor" in message and "2 segments" in message
    assert writer.pending == 2 and writer.sequence == 2  # the refused write queued nothing
    with pytest.raises(DeadlineExceededError):
        client.close(timeout_s=0.5)


def test_with_block_on_a_wedged_shard_ends_with_its_deadline(wedged_shard):
    client = ReplayClient(wedged_shard, timeout_s=5)

    def with_block():
        with client.writer("t", writer_id="leaving", timeout_s=1.0) as writer:
            writer.write_segment(*segment(0), episode_id=0, first_step=0)

    thread, outcome = in_thread(with_block)
    thread.join(20)
    assert not thread.is_alive(), "leaving the with block must not wait for ever"
    (err,) = outcome
    assert isinstance(err, DeadlineExceededError)
    assert wedged_shard in str(err) and "leaving" in str(err) and "1 segments" in str(err)
    client.close(timeout_s=1)


def test_rate_limited_shard_bounds_writes_and_close(tmp_path):
    server, port = create_server(ServerConfig(dir=str(tmp_path / "s")))
    try:
        client = ReplayClient(f"127.0.0.1:{port}", timeout_s=5)
        client.create_table(
            TableConfig.uniform(
                "held", capacity=10_000, min_size=1, samples_per_insert=1.0, error_buffer=16.0
            )
        )
        writer = client.writer("held", writer_id="held-actor", max_in_flight=4, timeout_s=1.0)

        def write_until_blocked():
            for ep in range(200):  # nothing samples: the limiter admits a few segments only
                writer.write_segment(*segment(ep), episode_id=ep, first_step=0)

        thread, outcome = in_thread(write_until_blocked)
        thread.join(30)
        assert not thread.is_alive()
        assert isinstance(outcome[0], DeadlineExceededError)
        assert "held-actor" in str(outcome[0])
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="held-actor"):
            writer.close()  # the writer's own deadline, no argument needed
        assert time.monotonic() - started < 15
        client.close(timeout_s=1)
    finally:
        server.stop(grace=0.5)


def test_byte_window_holds_writes_back_like_the_segment_window(wedged_shard):
    client = ReplayClient(wedged_shard, timeout_s=5)
    with pytest.raises(InvalidConfigError, match="max_in_flight_bytes"):
        client.writer("t", max_in_flight_bytes=0)
    writer = client.writer(
        "t", writer_id="byte-window", max_in_flight=1_000, max_in_flight_bytes=1, timeout_s=1.0
    )
    writer.write_segment(*segment(0), episode_id=0, first_step=0)  # below both bounds: queued
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="byte-window"):
        writer.write_segment(*segment(1), episode_id=1, first_step=0)  # over the byte bound
    assert time.monotonic() - started >= 1.0
    assert writer.pending == 1 and writer.sequence == 1
    with pytest.raises(DeadlineExceededError):
        client.close(timeout_s=0.5)
