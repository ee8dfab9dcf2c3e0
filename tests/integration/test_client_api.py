"""ReplayClient as an object: prefetching iteration, pickling, and policy weights."""

import pickle
import threading
import time

import pytest
import torch
from torch import nn

from millpond import (
    DeadlineExceededError,
    InvalidConfigError,
    InvalidDataError,
    ReplayClient,
    TableConfig,
)


def live_threads() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.is_alive()}


def threads_left(before: dict[int, str], allowed: str = "", wait_s: float = 10.0) -> list[str]:
    """Threads started since ``before`` that outlive ``wait_s``, other than ``allowed*`` ones.

    gRPC ends the thread that drains a streaming call's requests (``Thread-N (_run)``) on
    its own schedule after the call ends, so a thread is only left over once it outlives a
    grace period; one blocked for good still fails.
    """
    deadline = time.monotonic() + wait_s
    while True:
        left = [
            n
            for i, n in live_threads().items()
            if i not in before and not (allowed and n.startswith(allowed))
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_iterate_streams_while_a_writer_inserts_and_leaves_no_threads(
    server, table_name, patterned
):
    client = ReplayClient(server.address)
    client.create_table(TableConfig.uniform(table_name, capacity=50_000, seed=12))
    with client.writer(table_name, writer_id=f"{table_name}-seed") as w:
        for ep in range(20):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
    client.sample(table_name, 8)  # channels and the client's own pool exist from here on
    before = live_threads()

    stop = threading.Event()
    written = [20]

    def write() -> None:
        with client.writer(table_name, writer_id=f"{table_name}-live", max_in_flight=16) as w:
            ep = 20
            while not stop.is_set() and ep < 5_000:
                w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
                ep += 1
                if ep % 10 == 0:
                    w.flush(timeout_s=30)
                    written[0] = ep
                    time.sleep(0.002)

    writer = threading.Thread(target=write, name="test-live-writer")
    writer.start()
    newest = []
    iterator = client.iterate(table_name, batch_size=64, prefetch=4)
    try:
        for i, batch in enumerate(iterator):
            assert batch.batch_size == torch.Size([64])
            patterned.check(batch)
            newest.append(int(batch["episode_id"].max()))
            if i >= 40 and newest[-1] > 200:
                break
            assert i < 2_000, "iterate never saw the new data"
    finally:
        iterator.close()
        stop.set()
        writer.join(60)
    assert not writer.is_alive()
    assert max(newest[-10:]) > max(newest[:5])  # later batches hold newer steps

    # The client's shared call pool may have grown (it lives as long as the client); nothing
    # of the iterator's own may stay.
    assert not threads_left(before, allowed="millpond-client")
    client.close()
    assert not threads_left(before)


def test_iterate_a_queue_in_order_and_close_loses_nothing(server1, table_name, patterned):
    client = ReplayClient(server1.address)
    client.create_table(TableConfig.queue(table_name, capacity=10_000))
    with client.writer(table_name, writer_id=f"{table_name}-w") as w:
        for ep in range(50):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
    got = []
    iterator = client.iterate(table_name, batch_size=20, prefetch=4, timeout_s=30)
    for batch in iterator:
        got += patterned.check(batch)
        if len(got) == 50 * patterned.L:
            break
    iterator.close()  # the next requests wait on an empty queue: cancelled, nothing taken
    assert got == [(ep, s) for ep in range(50) for s in range(patterned.L)]
    with client.writer(table_name, writer_id=f"{table_name}-w2") as w:
        for ep in range(50, 60):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
    more = patterned.drain(client, table_name, 10 * patterned.L)
    assert more == [(ep, s) for ep in range(50, 60) for s in range(patterned.L)]
    client.close()


def test_closing_iterate_while_the_shard_waits_for_queue_data_loses_nothing(
    server1, table_name, patterned
):
    client = ReplayClient(server1.address)
    client.create_table(TableConfig.queue(table_name, capacity=10_000))
    lost = 0
    for rnd in range(3):
        base = 1000 * rnd
        with client.writer(table_name, writer_id=f"{table_name}-{rnd}") as w:
            for ep in range(base, base + 11):  # 44 steps: 5 batches of 8, then 4 left
                w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
        iterator = client.iterate(table_name, batch_size=8, prefetch=4, timeout_s=30)
        for i, batch in enumerate(iterator):
            patterned.check(batch)
            if i == 4:
                break
        time.sleep(0.2)  # the next request waits on the shard: 4 steps, it wants 8
        iterator.close()
        with client.writer(table_name, writer_id=f"{table_name}-{rnd}-more") as w:
            for ep in range(base + 500, base + 510):
                w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
        time.sleep(0.6)
        size = client.info(table_name)["size"]
        lost += 44 - size
        patterned.drain(client, table_name, size)
    client.close()
    assert lost == 0, f"{lost} steps taken by cancelled calls and never delivered"


def test_client_pickles_as_its_addresses_and_the_copy_works(server3, table_name, patterned):
    client = ReplayClient(server3.address, token="not-checked-here", timeout_s=12.5)
    client.create_table(TableConfig.uniform(table_name, capacity=5_000))
    with client.writer(table_name, writer_id=f"{table_name}-a") as w:
        for ep in range(30):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
    patterned.check(client.sample(table_name, 32))  # in use: channels open, masses cached

    copy = pickle.loads(pickle.dumps(client))
    assert copy is not client and type(copy) is ReplayClient
    assert copy.addresses == client.addresses == server3.addresses
    assert (copy.token, copy.tls, copy.timeout_s, copy.max_message_mb) == (
        "not-checked-here",
        None,
        12.5,
        256,
    )
    assert copy.info(table_name)["size"] == 30 * patterned.L
    patterned.check(copy.sample(table_name, 64))
    with copy.writer(table_name, writer_id=f"{table_name}-b") as w:
        for ep in range(30, 40):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
    assert client.info(table_name)["size"] == 40 * patterned.L
    copy.close()
    client.close()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
        self.norm = nn.BatchNorm1d(512)  # buffers: float running stats, int64 counter
        self.head = nn.Linear(512, 8).to(torch.bfloat16)


def test_small_weights_go_in_one_message_large_ones_in_chunks(server, monkeypatch):
    """Weights of one chunk or less take PublishWeightsAtOnce, larger ones the stream; both
    come back whole."""
    from millpond.learner.client._shards import ShardHandle
    from millpond.protos.weights import WEIGHTS_CHUNK_BYTES

    methods: list[str] = []
    real_stub = ShardHandle.stub

    class Recorded:  # the stub, noting which publishing method is called
        def __init__(self, stub) -> None:
            self._stub = stub

        def __getattr__(self, name: str):
            if name.startswith("PublishWeights"):
                methods.append(name)
            return getattr(self._stub, name)

    monkeypatch.setattr(ShardHandle, "stub", property(lambda self: Recorded(real_stub.fget(self))))
    client = ReplayClient(server.address)
    _, latest = client.get_weights()
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    large = {"w": torch.arange(WEIGHTS_CHUNK_BYTES // 4 + 1, dtype=torch.float32)}
    for i, state in enumerate((small, large)):
        methods.clear()
        assert client.publish_weights(state, version=latest + 1 + i) == latest + 1 + i
        assert methods == ["PublishWeightsAtOnce" if state is small else "PublishWeights"]
        got, _ = client.get_weights()
        assert torch.equal(got["w"], state["w"])
    client.close()


def test_weights_round_trip_versions_and_waiting(server):
    client = ReplayClient(server.address)
    torch.manual_seed(0)
    net = Net()
    net.norm.num_batches_tracked += 7
    state = net.state_dict()
    assert sum(t.numel() * t.element_size() for t in state.values()) > 4 * 2**20  # several MB
    _, latest = client.get_weights()
    version = latest + 2  # versions may skip; version - 1 is then a valid, stale number

    assert client.publish_weights(state, version=version) == version
    got, got_version = client.get_weights()
    assert got_version == version and got.keys() == state.keys()
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    fresh = Net()
    fresh.load_state_dict(got)
    x = torch.randn(4, 512)
    net.eval(), fresh.eval()
    assert torch.equal(fresh.body(x), net.body(x))
    assert client.info()["weights_version"] == version

    assert client.get_weights(min_version=version + 1) == (None, version)
    for stale in (version, version - 1):
        with pytest.raises(InvalidDataError, match="not newer"):
            client.publish_weights({"w": torch.zeros(1)}, version=stale)
    got, got_version = client.get_weights(min_version=version)
    assert got_version == version and got.keys() == state.keys()  # unchanged

    # A reader waiting for the next version gets it as soon as it is published.
    newer = {"only.one": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    publisher = threading.Timer(0.3, client.publish_weights, (newer, version + 1))
    publisher.start()
    start = time.monotonic()
    got, got_version = client.get_weights(min_version=version + 1, timeout_s=20)
    publisher.join()
    assert time.monotonic() - start < 10
    assert got_version == version + 1 and torch.equal(got["only.one"], newer["only.one"])
    assert client.get_weights(min_version=version + 5, timeout_s=0.2) == (None, version + 1)
    client.close()


def test_a_publication_asked_later_goes_on_while_the_caller_does(server):
    """``publish_weights_later`` returns before the rendezvous stores the weights (here held
    back by an acting actor, ``max_lag``); ``result()`` waits for the answer, counts the
    wait, and raises what the rendezvous refused; the weights are those handed over."""
    client = ReplayClient(server.address)
    _, latest = client.get_weights()
    base = latest + 1
    client.publish_weights({"w": torch.zeros(3)}, version=base)
    client.get_weights(actor="slow", acting=True)  # acts with version `base`
    handed = {"w": torch.arange(3, dtype=torch.float32)}
    pending = client.publish_weights_later(handed, base + 2, max_lag=1)
    handed["w"] += 100  # serialized already: the change is not published
    time.sleep(0.5)
    assert not pending.done() and client.info()["weights_version"] == base
    waited_before = client.publish_wait_s
    threading.Timer(0.3, client.get_weights, kwargs={"actor": "slow", "acting": False}).start()
    assert pending.result() == base + 2
    assert client.publish_wait_s - waited_before >= 0.5
    got, version = client.get_weights()
    assert version == base + 2 and torch.equal(got["w"], torch.arange(3, dtype=torch.float32))
    refused = client.publish_weights_later({"w": torch.zeros(3)}, base + 1)
    with pytest.raises(InvalidDataError, match="not newer"):
        refused.result()
    client.close()


def test_sample_timeout_on_an_empty_table(server, table_name):
    with ReplayClient(server.address) as client:
        client.create_table(TableConfig.uniform(table_name, capacity=100))
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.sample(table_name, 4, timeout_s=0.3)
        assert time.monotonic() - start < 5


def test_writers_pinned_to_chosen_shards(server3, table_name, patterned):
    client = ReplayClient(server3.address)
    client.create_table(TableConfig.uniform(table_name, capacity=10_000))
    assert client.num_shards == 3
    for shard in range(3):
        with client.writer(table_name, writer_id=f"{table_name}-same-id", shard=shard) as w:
            for ep in range(shard + 1):  # shard i gets i + 1 segments
                w.write_segment(*patterned.segment(100 * shard + ep), episode_id=100 * shard + ep)
    sizes = [s["size"] for s in client.info(table_name)["shards"]]
    assert sizes == [patterned.L * (i + 1) for i in range(3)]  # one id, three shards, no clash
    for bad in (3, -1, True, "0"):
        with pytest.raises(InvalidConfigError, match="shard"):
            client.writer(table_name, shard=bad)
    patterned.check(client.sample(table_name, 24))
    client.close()
