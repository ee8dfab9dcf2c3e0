"""Bad inputs through ReplayClient: each gets its millpond exception, and the data stay intact.

One shard started with ``--max-message-mb 1`` serves the module. Each test first stores
reference data (dict observations with uint8 pixels); after every refused call the table
still holds exactly that many steps and samples back exactly.
"""

import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import (
    DeadlineExceededError,
    InvalidConfigError,
    InvalidDataError,
    RateLimiterTimeoutError,
    ReplayClient,
    ResourceExhaustedError,
    TableConfig,
    TableExistsError,
    TableNotFoundError,
)
from millpond.segments import Segment


@pytest.fixture(scope="module")
def small_server(module_server):
    return module_server("--max-message-mb", "1")


@pytest.fixture
def setup(small_server, table_name, make_experience, envs, write, rng):
    """A client of the 1 MiB server, a uniform table with reference data, and ``intact()``."""
    client = ReplayClient(small_server.address, timeout_s=30)
    client.create_table(TableConfig.uniform(table_name, capacity=20_000, seed=11))
    exp = make_experience()
    exp.add_rollout(envs["dict"](), 120, seed=0, episode_offset=0, rng=rng)
    write(client, table_name, exp, ["errors-writer"])
    segments = exp.segments[0]

    def intact():
        assert client.info(table_name)["size"] == exp.num_steps
        seen = set()
        for _ in range(exp.batches_to_cover(100)):
            seen.update(exp.check(client.sample(table_name, 100)))
            if len(seen) == exp.num_steps:
                break
        assert seen == set(exp.index)

    intact()
    yield client, table_name, segments, intact
    client.close()


def retyped(td, key, fn):
    td = td.clone()
    td[key] = fn(td[key])
    return td


def test_wrong_dtype_or_shape_names_key_expected_and_received(setup):
    client, table, segments, intact = setup
    seg = segments[0][0]
    pixels = ("observation", "pixels")
    cases = [
        (retyped(seg.steps, pixels, lambda x: x.float()), seg.tail, "uint8[3, 8, 8]", "float32"),
        (retyped(seg.steps, pixels, lambda x: x[..., :7]), seg.tail, "uint8[3, 8, 8]", "[3, 8, 7]"),
        (seg.steps, retyped(seg.tail, pixels, lambda x: x.long()), "uint8[3, 8, 8]", "int64"),
        (retyped(seg.steps, "action", lambda x: x.double()), seg.tail, "float32[2]", "float64[2]"),
    ]
    with client.writer(table, writer_id="bad-dtype") as w:
        for steps, tail, expected, received in cases:
            with pytest.raises(InvalidDataError) as e:
                w.write_segment(steps, tail, 10**6, 0)
            message = str(e.value)
            key = "action" if "action" in message.split(":")[0] else "pixels"
            assert key in message and expected in message and received in message, message
        with pytest.raises(InvalidDataError, match="pixels"):
            w.write_segment(seg.steps.exclude(pixels), seg.tail, 10**6, 0)
        with pytest.raises(InvalidDataError, match="unexpected key"):
            w.write_segment(seg.steps.set("extra", torch.zeros(len(seg.steps))), seg.tail)
        assert w.sent == 0  # refused before anything was queued
    # A fresh client (no cached spec) refuses it too.
    with (
        ReplayClient(client.addresses) as other,
        other.writer(table, writer_id="bad-dtype-2") as w,
        pytest.raises(InvalidDataError, match="float32"),
    ):
        w.write_segment(cases[0][0], seg.tail, 10**6, 0)
    intact()


def test_unknown_table(setup):
    client, _, segments, intact = setup
    seg = segments[0][0]
    with pytest.raises(TableNotFoundError, match="nope"):
        client.sample("nope", 4)
    with pytest.raises(TableNotFoundError, match="nope"):
        client.info("nope")
    with pytest.raises(TableNotFoundError, match="nope"):
        next(client.iterate("nope", 4))
    with pytest.raises(TableNotFoundError, match="nope"):
        client.reset("nope")
    index = {"slot": [0], "generation": [1], "shard": [0]}
    with pytest.raises(TableNotFoundError, match="nope"):
        client.update_priorities("nope", index, [1.0])
    w = client.writer("nope", writer_id="to-nowhere")
    w.write_segment(seg.steps, seg.tail, 10**6, 0)
    with pytest.raises(TableNotFoundError, match="nope"):
        w.flush(timeout_s=10)
    with pytest.raises(TableNotFoundError):  # the writer keeps its error
        w.write_segment(seg.steps, seg.tail, 10**6, 0)
    with pytest.raises(TableNotFoundError):
        w.close()
    intact()


def big_segment(segments, length):
    """A segment of ``length`` steps with the table's keys (rows tiled from real ones)."""
    seg = segments[0][0]
    reps = -(-length // len(seg.steps))
    steps = torch.cat([seg.steps] * reps)[:length]
    steps["next", "terminated"][:] = False
    steps["next", "truncated"][:] = False
    return steps, seg.tail


def test_message_too_large(setup):
    client, table, segments, intact = setup
    steps, tail = big_segment(segments, 6_000)  # ~1.3 MB on the wire
    # The client allows 256 MiB, the server 1 MiB: the server refuses the stream.
    w = client.writer(table, writer_id="too-big")
    w.write_segment(steps, tail, 10**6, 0)
    with pytest.raises(ResourceExhaustedError):
        w.flush(timeout_s=10)
    with pytest.raises(ResourceExhaustedError):
        w.close()
    # A client told the limit refuses it before sending.
    with (
        ReplayClient(client.addresses, max_message_mb=1) as small,
        small.writer(table, writer_id="too-big-2") as w2,
        pytest.raises(ResourceExhaustedError, match="message limit"),
    ):
        w2.write_segment(steps, tail, 10**6, 0)
    # A sample whose answer exceeds the limit (on the wire: a colocated answer carries no
    # observations, and that batch fits it).
    with (
        ReplayClient(client.addresses, colocated=False) as wire,
        pytest.raises(ResourceExhaustedError),
    ):
        wire.sample(table, 6_000)
    intact()


@pytest.mark.parametrize("how", ["single", "columns"])
@pytest.mark.parametrize("client_mb", [1, 256])
def test_many_small_segments_fit_a_small_message_limit(setup, client_mb, how):
    """Segments that pass one by one are batched into requests that pass too, whether the
    client knows the server's limit (1 MiB) or not; written as columns in one call, they
    are cut into several packed messages."""
    client, table, segments, _ = setup
    before = client.info(table)["size"]
    steps, tail = big_segment(segments, 400)  # ~90 KB each; 40 of them ~3.6 MB in all
    first_id = 2 * 10**6 + 100 * client_mb + (50 if how == "columns" else 0)
    with (
        ReplayClient(client.addresses, max_message_mb=client_mb) as other,
        other.writer(table, writer_id=f"many-small-{client_mb}-{how}") as w,
    ):
        if how == "single":
            for i in range(40):
                w.write_segment(steps, tail, first_id + i, 0)
        else:
            w.write_segments([Segment(steps, tail, first_id + i, 0) for i in range(40)])
        w.flush(timeout_s=30)
    assert client.info(table)["size"] == before + 40 * 400


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True, "8"])
def test_bad_batch_size(setup, batch_size):
    client, table, _, intact = setup
    with pytest.raises(InvalidDataError, match="batch_size"):
        client.sample(table, batch_size)
    with pytest.raises(InvalidDataError, match="batch_size"):
        client.iterate(table, batch_size)
    with pytest.raises(InvalidConfigError, match="prefetch"):
        client.iterate(table, 4, prefetch=0)
    intact()


def test_bad_table_configs(setup):
    client, table, _, intact = setup
    bad = [
        lambda: TableConfig.uniform(table, capacity=-5),
        lambda: TableConfig.uniform(table, capacity=1),
        lambda: TableConfig(name=table, capacity=100, sampler="lifo"),
        lambda: TableConfig.slices(table, capacity=100, slice_len=0),
        lambda: TableConfig.queue(table, capacity=100, samples_per_insert=1.0),
        lambda: TableConfig.uniform("bad name!", capacity=100),
        lambda: TableConfig.uniform(table, capacity=100, compression="lz4"),
    ]
    for make in bad:
        with pytest.raises(InvalidConfigError):
            make()
    with pytest.raises(InvalidConfigError):
        client.create_table({"name": table, "capacity": 100})
    with pytest.raises(TableExistsError, match=table):
        client.create_table(TableConfig.uniform(table, capacity=999))
    with pytest.raises(TableExistsError):
        client.create_table(TableConfig.queue(table, capacity=20_000))
    intact()


def test_rate_limiter_timeouts(setup):
    client, table, segments, intact = setup
    starved = f"{table}-starved"
    client.create_table(TableConfig.uniform(starved, capacity=1_000, min_size=500))
    start = time.monotonic()
    with pytest.raises(RateLimiterTimeoutError, match="no shard had data"):  # empty
        client.sample(starved, 8, timeout_s=0.3)
    with client.writer(starved, writer_id="starved-writer") as w:
        seg = segments[0][0]
        w.write_segment(seg.steps, seg.tail, seg.episode_id, seg.first_step)
    with pytest.raises(RateLimiterTimeoutError, match="min_size 500"):  # below min_size
        client.sample(starved, 8, timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert issubclass(RateLimiterTimeoutError, DeadlineExceededError)

    # Inserts held back by samples_per_insert: flush times out, then goes through once the
    # learner samples.
    limited = f"{table}-limited"
    config = TableConfig.uniform(
        limited, capacity=1_000, min_size=4, samples_per_insert=1.0, error_buffer=4.0
    )
    client.create_table(config)
    written = 0
    with client.writer(limited, writer_id="limited-writer") as w:
        # One segment at a time (the limiter checks each insert request before it runs):
        # inserts pass while inserts - samples <= 4 + 4, then block.
        for seg, _ in segments:
            w.write_segment(seg.steps, seg.tail, seg.episode_id, seg.first_step)
            written += len(seg.steps)
            try:
                w.flush(timeout_s=0.5)
            except DeadlineExceededError as e:
                assert "unacknowledged" in str(e)
                break
        else:
            pytest.fail("the rate limiter never held an insert back")
        stored = client.info(limited)["size"]
        assert 8 < stored < written
        deadline = time.monotonic() + 30
        while w.pending and time.monotonic() < deadline:
            client.sample(limited, 4, timeout_s=10)
        w.flush(timeout_s=10)
    assert client.info(limited)["size"] == written
    intact()


def test_bad_priorities_and_weights(setup):
    client, table, _, intact = setup
    batch = client.sample(table, 8)
    with pytest.raises(InvalidDataError, match="prioritized"):
        client.update_priorities(table, batch["index"], torch.ones(8))
    with pytest.raises(InvalidDataError, match="equal"):
        client.update_priorities(table, batch["index"], torch.ones(5))
    with pytest.raises(InvalidDataError, match="index"):
        client.update_priorities(table, {"slot": [1]}, [1.0])
    with pytest.raises(InvalidDataError, match="out of range"):
        index = batch["index"].clone()
        index["shard"][:] = 7
        client.update_priorities(table, index, torch.ones(8))
    with pytest.raises(InvalidDataError):
        client.publish_weights({"w": np.zeros(3)}, version=1)
    with pytest.raises(InvalidDataError, match="dot-separated"):
        client.publish_weights({"a b": torch.zeros(3)}, version=1)
    with pytest.raises(InvalidDataError, match="version"):
        client.publish_weights({"w": torch.zeros(3)}, version=-1)
    intact()


def test_multi_megabyte_weights_pass_a_one_megabyte_limit(setup):
    """Weights travel in chunks, each under the smallest message limit a server takes."""
    client, _, _, intact = setup
    state = {"big": torch.arange(3 * 2**20 // 4, dtype=torch.float32), "small": torch.ones(3)}
    _, version = client.get_weights()
    assert client.publish_weights(state, version=version + 1) == version + 1
    got, got_version = client.get_weights()
    assert got_version == version + 1
    assert got.keys() == state.keys()
    for k in state:
        assert torch.equal(got[k], state[k])
    intact()


def test_extend_bad_ted(setup):
    client, table, _, intact = setup
    with pytest.raises(InvalidDataError, match="TED"):
        client.extend(table, {"observation": torch.zeros(3)})
    td = TensorDict({"observation": torch.zeros(5, 3)}, [5])
    with pytest.raises(InvalidDataError, match="observation keys"):
        client.extend(table, td)
    td = TensorDict(
        {
            "observation": torch.zeros(5, 3),
            "next": {"observation": torch.zeros(5, 3), "reward": torch.zeros(5, 1)},
        },
        [5],
    )
    with pytest.raises(InvalidDataError, match="terminated"):
        client.extend(table, td)
    intact()


@pytest.mark.parametrize("n", [1, 3])
def test_unknown_table_on_session_servers(server1, server3, n):
    server = server1 if n == 1 else server3
    with ReplayClient(server.address) as client:
        with pytest.raises(TableNotFoundError, match="no-such-table"):
            client.sample("no-such-table", 4)
        with pytest.raises(TableNotFoundError, match="no-such-table"):
            client.info("no-such-table")


def test_spec_taken_from_the_first_insert_holds_on_every_shard(
    server3, table_name, patterned, covering_writer_ids
):
    """A table without a declared spec takes it from its first insert; a writer pinned to
    another shard (in another client) must not give that shard a different one."""
    first_id, other_id, _ = covering_writer_ids(table_name, 3)
    with ReplayClient(server3.address) as first:
        first.create_table(TableConfig.uniform(table_name, capacity=1_000))
        with first.writer(table_name, writer_id=first_id) as w:
            w.write_segment(*patterned.segment(1), episode_id=1, first_step=0)
    steps, tail = patterned.segment(2)
    steps["observation"] = steps["observation"].float()
    tail["observation"] = tail["observation"].float()
    with ReplayClient(server3.address) as other:
        with (
            other.writer(table_name, writer_id=other_id) as w,
            pytest.raises(InvalidDataError, match="uint8"),
        ):
            w.write_segment(steps, tail, episode_id=2, first_step=0)
        assert other.info(table_name)["size"] == patterned.L
        batch = other.sample(table_name, 16)
        assert batch["observation"].dtype == torch.uint8
        patterned.check(batch)


def test_too_large_queue_sample_loses_nothing(small_server, table_name, patterned):
    with ReplayClient(small_server.address) as client:
        client.create_table(TableConfig.queue(table_name, capacity=30_000))
        with client.writer(table_name, writer_id=f"{table_name}-w") as w:
            for ep in range(500):
                w.write_segment(*patterned.segment(ep, length=40), episode_id=ep, first_step=0)
        assert client.info(table_name)["size"] == 20_000
        with pytest.raises(ResourceExhaustedError):
            client.sample(table_name, 20_000)  # ~1.5 MB: more than the server's 1 MiB
        assert client.info(table_name)["size"] == 20_000
