"""Colocated sampling against real servers on loopback: a learner on the shard's host gets the
sampled slots over gRPC and reads the observation rows from the table's files.

Every batch is checked against the wire's and the in-process table's (same config, seed and
inserts: the samplers draw the same slots), bit for bit; rows that encode their own episode
and step show that no torn or stale row comes back while a writer overwrites the ring; and a
table whose files cannot be read is sampled on the wire (automatic mode) or refused, with the
reason (``colocated=True``).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.colocated import ColocatedReader
from millpond.errors import ColocationError, ResourceExhaustedError
from millpond.learner.client import _colocated, _split
from millpond.storage_format import TOKEN_FILE, ensure_token, read_token, storage_identity
from millpond.testing import pattern, pattern_segment

OBS = (6, 10)


def _segments(n: int, length: int = 9, first_episode: int = 0, obs=OBS) -> list:
    return [
        pattern_segment(first_episode + e, 3 * e, length + e % 4, obs, terminated=e % 2 == 0)
        for e in range(n)
    ]


def _stacked_segments(n: int, k: int = 3, length: int = 7) -> list:
    """Segments whose observation is a stack of ``k`` pattern frames, oldest first."""
    out = []
    for seg in _segments(n, length):
        ep, first = seg.episode_id, seg.first_step
        steps = torch.arange(first, first + len(seg.steps) + 1)
        frames = torch.stack(
            [pattern(ep, steps - (k - 1 - j), OBS) for j in range(k)], dim=1
        )  # [L + 1, k, *OBS]
        seg.steps["observation"] = frames[:-1]
        seg.tail["observation"] = frames[-1]
        out.append(seg)
    return out


def _fill(client: ReplayClient, table: str, segments: list) -> None:
    with client.writer(table, f"{table}-writer") as w:
        w.write_segments(segments)


def _assert_same(actual, expected, what: str) -> None:
    keys = set(expected.keys(True, True)) - {("index", "shard")}
    assert keys == set(actual.keys(True, True)) - {("index", "shard")}, what
    for key in keys:
        a, e = actual[key], expected[key]
        assert a.dtype == e.dtype and a.shape == e.shape, (what, key)
        assert torch.equal(a, e), (what, key)


def _check_pattern(batch) -> None:
    """Every row holds what its (episode, step) wrote: no torn or stale row."""
    eps, steps = batch["episode_id"].reshape(-1), batch["step"].reshape(-1)
    obs = batch["observation"].reshape(len(eps), *OBS)
    nxt = batch["next", "observation"].reshape(len(eps), *OBS)
    assert torch.equal(obs, pattern(eps, steps, OBS))
    assert torch.equal(nxt, pattern(eps, steps + 1, OBS))
    assert torch.equal(batch["action"].reshape(-1, 2), torch.stack([eps, steps], 1))


CONFIGS = {
    "uniform": lambda name: TableConfig.uniform(name, capacity=2_000, seed=11),
    "prioritized": lambda name: TableConfig.prioritized(name, capacity=2_000, seed=12),
    "slices": lambda name: TableConfig.slices(name, capacity=2_000, slice_len=4, seed=13),
    "verify_reads": lambda name: TableConfig.uniform(
        name, capacity=2_000, seed=14, verify_reads=True
    ),
    "frame_stacks": lambda name: TableConfig.uniform(
        name, capacity=2_000, seed=15, frame_stacks={"observation": 3}
    ),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_wire_colocated_and_in_process_batches_are_bit_identical(
    server1, table_name, make_table, kind
):
    segments = (_stacked_segments if kind == "frame_stacks" else _segments)(30)
    batches = {}
    for mode in (False, True):
        name = f"{table_name}-{mode}"
        with ReplayClient(server1.address, colocated=mode) as client:
            client.create_table(CONFIGS[kind](name))
            _fill(client, name, segments)
            got = []
            for i in range(4):
                batch = client.sample(name, 32)
                got.append(batch)
                if kind == "prioritized":
                    prios = torch.arange(batch.numel(), dtype=torch.float64) + i
                    client.update_priorities(name, batch["index"], prios)
            batches[mode] = got
            assert client.colocated_shards(name) == ([0] if mode else []), mode
    local = make_table(CONFIGS[kind](f"{table_name}-local"))
    local.insert_many(segments)
    expected = []
    for i in range(4):
        batch = local.sample(32)
        expected.append(batch)
        if kind == "prioritized":
            prios = torch.arange(batch.numel(), dtype=torch.float64) + i
            local.update_priorities(batch["index", "slot"], batch["index", "generation"], prios)
    for i, e in enumerate(expected):
        _assert_same(batches[False][i], e, f"wire batch {i}")
        _assert_same(batches[True][i], e, f"colocated batch {i}")
    if kind == "prioritized":
        assert "weight" in expected[-1]
    if kind != "frame_stacks":
        for b in batches[True]:
            _check_pattern(b)


def test_colocated_sampling_over_three_shards(server3, table_name, covering_writer_ids):
    with ReplayClient(server3.address, colocated=True) as client:
        client.create_table(TableConfig.uniform(table_name, capacity=3_000, seed=1))
        for i, wid in enumerate(covering_writer_ids(table_name, server3.shards)):
            with client.writer(table_name, wid) as w:
                w.write_segments(_segments(12, first_episode=100 * i))
        shards = set()
        for _ in range(5):
            batch = client.sample(table_name, 64)
            _check_pattern(batch)
            shards.update(batch["index", "shard"].tolist())
        assert shards == {0, 1, 2}
        assert len(client._sampler._colocation._readers) == 3
        iterated = client.iterate(table_name, 32, prefetch=3)
        for _, batch in zip(range(6), iterated, strict=False):
            _check_pattern(batch)
        iterated.close()


def test_reader_flags_slots_overwritten_after_the_sample(make_table, table_name):
    """The generation check: a slot overwritten between the sample and the read is stale."""
    table = make_table(TableConfig.uniform(table_name, capacity=120, seed=3))
    table.insert_many(_segments(6))
    sampled = table.sample_colocated(16)
    config = table.config
    reader = ColocatedReader(
        table.storage.path.resolve(),
        _ensure_token(table),
        config.capacity,
        config.spec,
        config.frame_stacks,
    )
    obs, nxt, stale = reader.read(
        sampled.slots, sampled.generations, sampled.rows, sampled.next_rows
    )
    assert not stale.any()
    batch = sampled.ted
    for key in obs:
        batch.set(key, obs[key])
        batch.set(("next", *key), nxt[key])
    _check_pattern(batch)
    table.insert_many(_segments(12, first_episode=500))  # the ring wraps over every slot
    _, _, stale = reader.read(sampled.slots, sampled.generations, sampled.rows, sampled.next_rows)
    assert stale.all()


def _ensure_token(table) -> str:
    directory = table.storage.path.resolve()
    assert ensure_token(directory)
    return storage_identity(directory)


@pytest.mark.parametrize(
    ("kind", "overwritten"),
    [("uniform", 2), ("prioritized", 2), ("slices", 2), ("uniform", 99), ("slices", 99)],
)
def test_rows_overwritten_while_read_are_redrawn(
    server1, table_name, monkeypatch, kind, overwritten
):
    """The first ``overwritten`` reads are preceded by a writer overwriting the ring: the rows
    they read are stale, and the client draws them again, from the files up to three times,
    then on the wire."""
    name = table_name
    config = {
        "uniform": TableConfig.uniform(name, capacity=200, seed=5),
        "prioritized": TableConfig.prioritized(name, capacity=200, seed=5),
        "slices": TableConfig.slices(name, capacity=200, slice_len=3, seed=5),
    }[kind]
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(config)
        writer = client.writer(name, f"{name}-w")
        episode = [0]

        def overwrite() -> None:  # more slots than the ring holds
            segs = _segments(20, first_episode=episode[0])
            episode[0] += 20
            writer.write_segments(segs)
            writer.flush()

        overwrite()
        real_read = ColocatedReader.read
        reads = {"n": 0, "stale": 0}

        def read(self, slots, generations, rows, next_rows):
            if reads["n"] < overwritten:
                overwrite()
            reads["n"] += 1
            out = real_read(self, slots, generations, rows, next_rows)
            reads["stale"] += int(out[2].sum())
            return out

        monkeypatch.setattr(ColocatedReader, "read", read)
        before = client.info(name)["samples"]
        batch = client.sample(name, 8)
        _check_pattern(batch)
        assert reads["stale"] > 0 and reads["n"] == min(overwritten + 1, 4)
        # Redraws replace rows of a counted batch: the rate limiter counted its steps once.
        assert client.info(name)["samples"] - before == batch.numel()
        writer.close()


def test_a_joined_call_hands_out_its_parts_before_it_waits_for_late_rows(
    server1, table_name, monkeypatch
):
    """Rows of a joined call (``prefetch`` batches drawn as one) found overwritten go to the
    draw's end: the parts before them are handed out before their replacements are
    received, the replacements are read from the files, and the rate limiter counts no row
    twice."""
    name = table_name
    n, prefetch = 8, 4
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(TableConfig.uniform(name, capacity=200, seed=5))
        writer = client.writer(name, f"{name}-w")
        writer.write_segments(_segments(20))  # more slots than the ring holds
        writer.flush()
        real_read = ColocatedReader.read
        handed_out = [0]
        reads: list[tuple[int, int]] = []  # (parts handed out before the read, rows stale)

        def read(self, slots, generations, rows, next_rows):
            if not reads:  # about half the ring overwritten after the first draw
                writer.write_segments(_segments(10, first_episode=100))
                writer.flush()
            out = real_read(self, slots, generations, rows, next_rows)
            bad = out[2][rows.long()] | out[2][next_rows.long()]
            reads.append((handed_out[0], int(bad.sum())))
            return out

        monkeypatch.setattr(ColocatedReader, "read", read)
        before = client.info(name)["samples"]
        batches = client.iterate(name, n, prefetch=prefetch)
        for _ in range(prefetch):
            _check_pattern(next(batches))
            handed_out[0] += 1
        batches.close()
        joined = n * prefetch
        (first_read, late), (redraw_read, _) = reads[:2]
        assert first_read == 0 and 0 < late < joined - n
        assert redraw_read == (joined - late) // n  # the parts without late rows went first
        # Joined calls were counted (the one read and the one asked next); no redraw was.
        counted = client.info(name)["samples"] - before
        assert counted % joined == 0 and counted >= joined
        writer.close()


def test_concurrent_writer_never_yields_a_torn_row(server1, table_name):
    name = table_name
    big = (64, 64)
    stop = threading.Event()
    errors: list[BaseException] = []
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(TableConfig.uniform(name, capacity=400, seed=6))

        def write() -> None:
            try:
                with client.writer(name, f"{name}-w") as w:
                    e = 0
                    while not stop.is_set():
                        w.write_segments(_segments(4, first_episode=e, obs=big))
                        e += 4
            except BaseException as err:  # surfaced below
                errors.append(err)

        with ReplayClient(server1.address) as setup:
            _fill(setup, name, _segments(20, first_episode=10_000, obs=big))
        thread = threading.Thread(target=write)
        thread.start()
        try:
            for _ in range(150):
                batch = client.sample(name, 48)
                eps, steps = batch["episode_id"], batch["step"]
                assert torch.equal(batch["observation"], pattern(eps, steps, big))
                assert torch.equal(batch["next", "observation"], pattern(eps, steps + 1, big))
        finally:
            stop.set()
            thread.join()
        assert not errors, errors


def _storage_dir(client: ReplayClient, table: str) -> str:
    return client.info(table)["shards"][0]["storage_dir"]


def test_files_that_do_not_open_fall_back_to_the_wire(server1, table_name):
    name = table_name
    with ReplayClient(server1.address) as setup:
        setup.create_table(TableConfig.uniform(name, capacity=1_000, seed=8))
        _fill(setup, name, _segments(10))
        directory = _storage_dir(setup, name)
    token_file = f"{directory}/{TOKEN_FILE}"
    with open(token_file) as f:
        token = f.read()
    try:
        with open(token_file, "w") as f:  # another table's files now, as the reader sees it
            f.write("0" * 32 + "\n")
        with ReplayClient(server1.address) as auto:
            _check_pattern(auto.sample(name, 16))
            assert not auto._sampler._colocation._readers
        with (
            ReplayClient(server1.address, colocated=True) as strict,
            pytest.raises(ColocationError, match=f"{name}.*another table's files"),
        ):
            strict.sample(name, 16)
    finally:
        with open(token_file, "w") as f:
            f.write(token)
    with ReplayClient(server1.address) as auto:
        _check_pattern(auto.sample(name, 16))
        assert auto._sampler._colocation._readers


def test_another_host_is_sampled_on_the_wire(server1, table_name, monkeypatch):
    monkeypatch.setattr(_colocated, "host_id", lambda: "elsewhere/0")
    with ReplayClient(server1.address) as auto:
        auto.create_table(TableConfig.uniform(table_name, capacity=1_000, seed=9))
        _fill(auto, table_name, _segments(10))
        _check_pattern(auto.sample(table_name, 16))
        assert not auto._sampler._colocation._readers
    with (
        ReplayClient(server1.address, colocated=True) as strict,
        pytest.raises(ColocationError, match="another host"),
    ):
        strict.sample(table_name, 16)


def test_queue_tables_stay_on_the_wire(server1, table_name):
    with ReplayClient(server1.address) as auto:
        auto.create_table(TableConfig.queue(table_name, capacity=1_000, seed=10))
        _fill(auto, table_name, _segments(6))
        batch = auto.sample(table_name, 20)
        _check_pattern(batch)
        assert not auto._sampler._colocation._readers
    with (
        ReplayClient(server1.address, colocated=True) as strict,
        pytest.raises(ColocationError, match=f"{table_name}.*queue table"),
    ):
        strict.sample(table_name, 20)


def test_colocated_flag_is_checked_and_pickled(server1):
    with pytest.raises(Exception, match="colocated"):
        ReplayClient(server1.address, colocated="yes")
    import pickle

    client = pickle.loads(pickle.dumps(ReplayClient(server1.address, colocated=False)))
    assert client.colocated is False


def test_info_reports_where_the_table_is_stored(server1, table_name):
    with ReplayClient(server1.address) as client:
        client.create_table(TableConfig.uniform(table_name, capacity=100))
        shard = client.info(table_name)["shards"][0]
        assert shard["storage_dir"].startswith("/") and shard["storage_dir"].endswith("data")
        token = read_token(shard["storage_dir"])
        assert len(token) == 32 and shard["storage_token"].startswith(token + "-")
        assert shard["storage_token"] == storage_identity(shard["storage_dir"])
        assert shard["host_id"]
        assert np.all(np.array([c != "" for c in shard["host_id"].split("/")]))


@pytest.mark.parametrize("kind", ["uniform", "prioritized", "slices"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_iterate_streams_the_batches_sample_would_draw(server1, table_name, kind, prefetch):
    """A colocated iterator of a one-shard client asks ``prefetch`` batches per call, drawn
    as one batch of ``prefetch`` times the rows (every row is drawn on its own): the same
    batches, in the same order, as wire samples of that many rows on a same-seeded table,
    each cut in ``prefetch`` parts."""
    segments = _segments(30)
    batches = {}
    for mode in (False, True):
        name = f"{table_name}-{mode}"
        with ReplayClient(server1.address, colocated=mode) as client:
            client.create_table(CONFIGS[kind](name))
            _fill(client, name, segments)
            if mode:
                stream = client.iterate(name, 16, prefetch=prefetch)
                batches[mode] = [next(stream) for _ in range(7)]
                stream.close()
                assert client._sampler._colocation._readers
                info = client.info(name)
                # 7 delivered, and at most the rest of the last call's were drawn.
                steps = batches[mode][0].numel()
                calls = -(-7 // prefetch)
                assert 7 * steps <= info["samples"] <= (calls + 1) * prefetch * steps
            else:
                batches[mode] = [
                    part
                    for _ in range(-(-7 // prefetch))
                    for part in client.sample(name, 16 * prefetch).split(16)
                ][:7]
    for i, (got, expected) in enumerate(zip(batches[True], batches[False], strict=True)):
        assert got.shape[0] == 16
        _assert_same(got, expected, f"batch {i}")
        _check_pattern(got)


def test_a_joined_call_is_read_once_for_its_batches(server1, table_name, monkeypatch):
    """The ``prefetch`` batches of one colocated call are read from the files in one go;
    a table too small for them together is asked one batch at a time, as before, and so
    are batches of READ_AHEAD_BYTES or more (read one ahead each, rather than all at once
    and then none)."""
    reads = _read_sizes(monkeypatch)
    with ReplayClient(server1.address, colocated=True) as client:
        small = f"{table_name}-small"
        client.create_table(CONFIGS["uniform"](table_name))
        client.create_table(TableConfig.uniform(small, capacity=40, seed=3))
        for name in (table_name, small):
            _fill(client, name, _segments(3 if name == small else 30))
        stream = client.iterate(table_name, 16, prefetch=4)
        held = [next(stream) for _ in range(8)]
        stream.close()
        assert reads[:2] == [64, 64]
        for batch in held:  # each part is its own rows, intact after the others were read
            assert batch.shape == (16,)
            _check_pattern(batch)
        reads.clear()
        stream = client.iterate(small, 16, prefetch=4)  # 64 rows > 40 slots: one at a time
        for _ in range(4):
            _check_pattern(next(stream))
        stream.close()
        assert reads and set(reads) == {16}
        reads.clear()
        monkeypatch.setattr(_split, "READ_AHEAD_BYTES", 16)  # every batch is large
        stream = client.iterate(table_name, 16, prefetch=4)
        for _ in range(6):
            _check_pattern(next(stream))
        stream.close()
        assert reads and set(reads) == {16}


def test_iterate_asks_for_the_next_call_while_the_last_batch_of_one_is_read(server1, table_name):
    """Once the last batch of a colocated call is handed out, the next call is open: the
    shard draws its batches meanwhile, before the iterator is asked for another."""
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(CONFIGS["uniform"](table_name))
        _fill(client, table_name, _segments(30))
        stream = client.iterate(table_name, 16, prefetch=3)
        batches = [next(stream) for _ in range(3)]  # the whole of the first call
        steps = batches[0].numel()
        deadline = time.monotonic() + 10
        while client.info(table_name)["samples"] < 6 * steps and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.info(table_name)["samples"] == 6 * steps
        stream.close()


def _read_sizes(monkeypatch) -> list[int]:
    """The rows of each colocated read, as they come."""
    sizes: list[int] = []
    real_read = ColocatedReader.read

    def read(self, slots, generations, rows, next_rows):
        sizes.append(len(rows))
        return real_read(self, slots, generations, rows, next_rows)

    monkeypatch.setattr(ColocatedReader, "read", read)
    return sizes


def _read_threads(monkeypatch) -> list[str]:
    """The names of the threads that read colocated rows, one per read, as they come."""
    reads: list[str] = []
    real_read = ColocatedReader.read

    def read(self, *args):
        reads.append(threading.current_thread().name)
        return real_read(self, *args)

    monkeypatch.setattr(ColocatedReader, "read", read)
    return reads


def test_a_colocated_iterator_reads_the_next_batch_while_the_consumer_holds_this_one(
    server1, table_name, monkeypatch
):
    """The rows of the next batch are read on the iterator's own thread as soon as this
    one is handed out, one batch ahead and no more; closing the iterator joins that thread.
    (Batches of READ_AHEAD_BYTES or more; this one is small, so the bound is lowered.)"""
    monkeypatch.setattr(_split, "READ_AHEAD_BYTES", 0)
    reads = _read_threads(monkeypatch)
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(CONFIGS["uniform"](table_name))
        _fill(client, table_name, _segments(30))
        # prefetch 1: a call per batch, so that each batch is a read of its own
        stream = client.iterate(table_name, 16, prefetch=1)
        _check_pattern(next(stream))
        deadline = time.monotonic() + 10
        while len(reads) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time for a third read, if one were made
        assert len(reads) == 2, reads
        assert set(reads) == {"millpond-read-ahead"}
        _check_pattern(next(stream))
        stream.close()
        assert "millpond-read-ahead" not in {t.name for t in threading.enumerate()}


def test_a_colocated_iterator_reads_small_batches_when_asked_for(server1, table_name, monkeypatch):
    """Batches under READ_AHEAD_BYTES are read on the consumer's thread, when asked for: no
    thread of their own, nothing read ahead."""
    reads = _read_threads(monkeypatch)
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(CONFIGS["uniform"](table_name))
        _fill(client, table_name, _segments(30))
        stream = client.iterate(table_name, 16, prefetch=1)
        for _ in range(3):
            _check_pattern(next(stream))
        time.sleep(0.2)  # time for a read ahead, if one were made
        assert reads == [threading.current_thread().name] * 3
        assert "millpond-colocated-read" not in {t.name for t in threading.enumerate()}
        stream.close()


def test_an_iterator_made_before_anything_is_stored_joins_its_draws_once_it_is(
    server1, table_name, monkeypatch
):
    """A learner starts with its actors: its iterator is made while the table holds nothing,
    so the batches' bytes are unknown. Its first batch is drawn on its own; the rest come
    as they would from a table filled beforehand: ``prefetch`` batches read in one go, on
    the consumer's thread (not one call and one read-ahead thread per batch for good)."""
    reads = _read_threads(monkeypatch)
    sizes = _read_sizes(monkeypatch)
    with ReplayClient(server1.address, colocated=True) as client:
        client.create_table(CONFIGS["uniform"](table_name))
        stream = client.iterate(table_name, 16, prefetch=4)
        first: list = []
        waiting = threading.Thread(target=lambda: first.append(next(stream)))
        waiting.start()
        time.sleep(0.3)  # the iterator waits for the table to fill
        assert not first
        _fill(client, table_name, _segments(30))
        waiting.join(timeout=30)
        _check_pattern(first[0])
        for _ in range(8):
            batch = next(stream)
            assert batch.shape == (16,)
            _check_pattern(batch)
        stream.close()
    assert sizes[0] == 16 and set(sizes[1:]) == {64}, sizes
    assert "millpond-read-ahead" not in reads[1:], reads


def test_a_directory_that_is_not_here_falls_back_to_the_wire(server_process, table_name):
    """The shard's directory path names nothing on this side (another mount namespace, say):
    the automatic client samples on the wire, ``colocated=True`` says why not."""
    server = server_process()
    with ReplayClient(server.address) as setup:
        setup.create_table(TableConfig.uniform(table_name, capacity=1_000, seed=4))
        _fill(setup, table_name, _segments(10))
        directory = _storage_dir(setup, table_name)
    moved = directory + "-elsewhere"
    os.rename(directory, moved)  # the shard keeps its maps and descriptors
    try:
        with ReplayClient(server.address) as auto:
            _check_pattern(auto.sample(table_name, 16))
            assert not auto._sampler._colocation._readers
        with (
            ReplayClient(server.address, colocated=True) as strict,
            pytest.raises(ColocationError, match=f"{table_name}.*not on this host"),
        ):
            strict.sample(table_name, 16)
    finally:
        os.rename(moved, directory)


def test_a_colocated_batch_larger_than_the_wire_could_send_is_sampled(server_process, table_name):
    """The message limit bounds what travels: a colocated answer carries no observations, so
    a batch whose observations would not fit one message is still served colocated, and
    refused on the wire with the largest batch that fits."""
    server = server_process("--max-message-mb", "1")
    big = (128, 128)  # pattern rows of 16 KiB: 32 KiB a step with its next, 31 steps a message
    with ReplayClient(server.address, colocated=False) as wire:
        wire.create_table(TableConfig.uniform(table_name, capacity=1_000, seed=8))
        _fill(wire, table_name, _segments(12, obs=big))
        with pytest.raises(ResourceExhaustedError, match="batch_size must be at most"):
            wire.sample(table_name, 64)
    with ReplayClient(server.address, colocated=True) as colocated:
        batch = colocated.sample(table_name, 64)
        assert batch["observation"].shape == (64, *big)
        eps, steps = batch["episode_id"], batch["step"]
        assert torch.equal(batch["observation"], pattern(eps, steps, big))
        assert torch.equal(batch["next", "observation"], pattern(eps, steps + 1, big))
