"""Killed shards and restarted writers: acknowledged data survive, exactly once.

The shards killed here are processes of the test's own: SIGKILL (no checkpoint, no
goodbye), then a restart on the same port and directory while clients keep going.
"""

import contextlib
import logging
import threading
import time

import pytest
import torch

from millpond import DeadlineExceededError, ReplayClient, TableConfig
from millpond.routing import writer_hash
from millpond.segments import Segment


def write_episodes(writer, patterned, episodes: range, how: str) -> None:
    """Write one segment per episode: each alone (``single``), ten at a time as columns
    (``packed``: one PackedSegments message each), or alternating (``mixed``)."""
    eps = list(episodes)
    for i in range(0, len(eps), 10):
        group = eps[i : i + 10]
        if how == "single" or (how == "mixed" and i % 20 == 0):
            for ep in group:
                writer.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
        else:
            writer.write_segments([Segment(*patterned.segment(ep), ep, 0) for ep in group])


@pytest.mark.parametrize("how", ["single", "packed", "mixed"])
def test_sigkilled_shard_loses_and_duplicates_nothing_acknowledged(
    server_process, patterned, caplog, how
):
    server = server_process()  # its own port, so it comes back on the same one
    client = ReplayClient(server.address, timeout_s=30)
    table = "durable"
    client.create_table(TableConfig.queue(table, capacity=200_000))
    n_segments = 2_000
    written = []
    errors: list[BaseException] = []
    w = client.writer(table, writer_id="durable-writer", max_in_flight=256)

    def write() -> None:
        try:
            for start in range(0, n_segments, 20):
                write_episodes(w, patterned, range(start, start + 20), how)
                written.extend(range(start, start + 20))
        except BaseException as e:  # reported by the test
            errors.append(e)

    caplog.set_level(logging.WARNING, logger="millpond.client")
    thread = threading.Thread(target=write, name="durability-writer", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while w.acked < n_segments // 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    server.kill()
    acked_at_kill, written_at_kill = w.acked, len(written)
    assert acked_at_kill >= n_segments // 5
    assert written_at_kill < n_segments, "the writer finished before the kill; write more"
    time.sleep(1.0)
    server.restart()
    thread.join(120)
    assert not thread.is_alive() and not errors, errors
    w.flush(timeout_s=60)
    w.close()
    assert w.acked == n_segments
    assert any("unavailable" in r.getMessage() for r in caplog.records), "no reconnect seen"

    # Each acknowledged segment stored once: the queue hands out every step exactly once.
    assert client.info(table)["size"] == n_segments * patterned.L
    got = patterned.drain(client, table, n_segments * patterned.L)
    assert len(got) == len(set(got)), "a step was stored twice"
    assert set(got) == {(ep, s) for ep in range(n_segments) for s in range(patterned.L)}
    client.close()


def test_one_of_three_shards_dies_sampling_goes_on_and_it_comes_back(
    server_process,
    server1,
    server3,
    table_name,
    covering_writer_ids,
    make_experience,
    envs,
    rng,
    write,
    caplog,
):
    # Three shards, each its own process: the middle one is this test's, to kill; the others
    # are shards of the session's servers (a client sees only addresses).
    victim = server_process()
    address = [server1.addresses[0], victim.address, server3.addresses[2]]
    client = ReplayClient(address, timeout_s=30)
    table = table_name
    client.create_table(TableConfig.uniform(table, capacity=5_000, seed=9))
    exp = make_experience()
    wids = covering_writer_ids(table, 3, per_shard=1)
    for k, _ in enumerate(wids):
        exp.add_rollout(envs["dict"](1000 * k), 80, seed=k, episode_offset=1000 * k, rng=rng)
    write(client, table, exp, wids)
    sizes = [s["size"] for s in client.info(table)["shards"]]
    assert all(sizes) and sum(sizes) == exp.num_steps

    # A writer pinned to shard 1, which keeps writing through the outage.
    late = make_experience()
    late.add_rollout(envs["dict"](5000), 40, seed=50, episode_offset=5000, rng=rng)
    late_id = next(w for w in (f"late-{i}" for i in range(100)) if writer_hash(w) % 3 == 1)
    late_writer = client.writer(table, writer_id=late_id, max_in_flight=1_000)

    caplog.set_level(logging.INFO, logger="millpond.client")
    victim.kill()
    for seg, _ in late.segments[0]:
        late_writer.write_segment(seg.steps, seg.tail, seg.episode_id, seg.first_step)
    for _ in range(10):  # full batches from the other two, no error
        batch = client.sample(table, 128)
        assert batch.batch_size == torch.Size([128])
        exp.check(batch)
        assert set(batch["index", "shard"].tolist()) <= {0, 2}
    down = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(victim.address in r.getMessage() for r in down), "no warning for the shard"
    info = client.info(table)
    assert [s["available"] for s in info["shards"]] == [True, False, True]
    assert info["size"] == sizes[0] + sizes[2]

    time.sleep(1.0)
    victim.restart()
    late_writer.flush(timeout_s=60)
    late_writer.close()
    for rollout_ted, chunks in zip(late.teds, late.segments, strict=True):
        exp.add(rollout_ted, [chunks])
    deadline = time.monotonic() + 30
    seen: set = set()
    while time.monotonic() < deadline and len(seen) < exp.num_steps:
        batch = client.sample(table, 256)
        seen.update(exp.check(batch))
    assert seen == set(exp.index), "the restarted shard's data did not all come back"
    assert any("available again" in r.getMessage() for r in caplog.records)
    assert client.info(table)["size"] == exp.num_steps
    client.close()


@pytest.mark.parametrize("how", ["single", "packed"])
@pytest.mark.parametrize("abandon", [False, True], ids=["closed", "crashed"])
def test_restarted_writer_with_the_same_id_is_stored(server, table_name, patterned, abandon, how):
    """An actor restarted under its old writer id: the writer learns the shard's sequence at
    connect, so its new segments are not mistaken for re-sends of the old ones."""
    writer_id = f"actor-{table_name}"
    first = ReplayClient(server.address)
    first.create_table(TableConfig.queue(table_name, capacity=20_000))
    with first.writer(table_name, writer_id=writer_id) as w:
        for ep in range(50):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
        w.flush(timeout_s=30)
    if abandon:  # more segments, then the actor dies without waiting for them
        w = first.writer(table_name, writer_id=writer_id)
        for ep in range(50, 80):
            w.write_segment(*patterned.segment(ep), episode_id=ep, first_step=0)
        with contextlib.suppress(DeadlineExceededError):  # what was not acked is gone
            w.close(timeout_s=0)
    first_size = first.info(table_name)["size"]
    first.close()
    assert first_size >= 50 * patterned.L

    second = ReplayClient(server.address)  # the restarted actor
    with second.writer(table_name, writer_id=writer_id) as w:
        write_episodes(w, patterned, range(100, 140), how)  # renumbered when it connects
        w.flush(timeout_s=30)
        assert w.sequence > 40  # numbered after what the shard holds from this id
    stored = second.info(table_name)["size"]
    if abandon:
        # Requests the dead writer had already sent may still be stored after first_size was
        # read; what matters is that the new writer's 40 segments all are (checked below).
        assert stored >= first_size + 40 * patterned.L
    else:
        assert stored == first_size + 40 * patterned.L
    got = patterned.drain(second, table_name, stored)
    assert len(got) == len(set(got))
    eps = {ep for ep, _ in got}
    assert set(range(50)) | set(range(100, 140)) <= eps
    assert eps <= set(range(80)) | set(range(100, 140))
    second.close()


def test_queued_messages_are_cut_to_a_shard_restarted_with_a_lower_message_limit(
    server_process, patterned
):
    """A writer sends segments written together as one message, as large as the shard's
    limit allows; a shard that comes back with a lower limit gets them cut to fit, each
    segment stored once."""
    server = server_process()
    client = ReplayClient(server.address, timeout_s=30)
    client.create_table(TableConfig.queue("cut", capacity=100_000))
    length = 9_000  # ~340 kB per segment
    w = client.writer("cut", writer_id="cut-writer")
    w.write_segments([Segment(*patterned.segment(0, 0, length), 0, 0)])
    w.flush()  # the shard has said its limit (256 MiB)
    server.stop()
    # Queued while the shard is down: one message of ~1.3 MB, more than 1 MiB.
    w.write_segments([Segment(*patterned.segment(ep, 0, length), ep, 0) for ep in range(1, 5)])
    server.args += ["--max-message-mb", "1"]
    server.restart()
    w.flush(timeout_s=60)
    w.close()
    assert w.acked == 5
    got = patterned.drain(client, "cut", 5 * length)
    assert sorted(got) == [(ep, s) for ep in range(5) for s in range(length)]
    client.close()
