"""Exports of a running service (ReadTable, ``ReplayClient.read_table``, ``millpond export
ADDRESS``): a consistent snapshot read while a writer keeps inserting, each segment whole and
equal to what was inserted, the snapshot less only its oldest segments where inserts overwrite
them meanwhile, and the same exports (TED, HDF5, Minari) as from a shard directory.

The reference is the writer's own record of what it inserted: every value of a
:func:`~millpond.testing.pattern_segment` encodes its ``(episode, step)``."""

import re
import shlex
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import ReplayClient, TableConfig
from millpond.cli import main
from millpond.errors import (
    PermissionDeniedError,
    ResourceExhaustedError,
    ShardUnavailableError,
    TableNotFoundError,
)
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.segments import pack
from millpond.service.export import load_hdf5
from millpond.service.server import ServerConfig, create_server
from millpond.testing import pattern, pattern_segment

DOC = Path(__file__).resolve().parents[2] / "docs" / "datasets.md"
OBS = (6,)
SEGMENT_STEPS = 5
SEGMENTS_PER_EPISODE = 3


def episode_segments(episode: int):
    """The segments of one episode, in order: its last one terminates it."""
    return [
        pattern_segment(
            episode,
            i * SEGMENT_STEPS,
            SEGMENT_STEPS,
            OBS,
            terminated=i == SEGMENTS_PER_EPISODE - 1,
        )
        for i in range(SEGMENTS_PER_EPISODE)
    ]


class Writer(threading.Thread):
    """Inserts episode after episode (one message each) until stopped, or until it has
    ``limit`` segments; ``written`` lists its segments' keys ``(episode, first step)`` in
    insert order, ``acked`` how many the shard stored. ``first`` is its first episode."""

    def __init__(
        self,
        client: ReplayClient,
        table: str,
        writer_id: str,
        shard: int = 0,
        limit: int | None = None,
        first: int | None = None,
    ):
        super().__init__(daemon=True)
        self.client, self.table, self.writer_id, self.shard = client, table, writer_id, shard
        self.limit = limit
        self.first = shard * 1_000_000 if first is None else first
        self.written: list[tuple[int, int]] = []
        self.acked = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            with self.client.writer(self.table, self.writer_id, shard=self.shard) as w:
                episode = self.first
                while not self.stop.is_set() and (
                    self.limit is None or len(self.written) < self.limit
                ):
                    segments = episode_segments(episode)
                    w.write_segments(segments)
                    w.flush()
                    with self._lock:
                        self.written += [(s.episode_id, s.first_step) for s in segments]
                        self.acked = len(self.written)
                    episode += 1
        except BaseException as e:
            self.error = e

    def wait_for(self, n: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.acked < n:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"the writer stored {self.acked} of {n}"
            time.sleep(0.01)
        return self.acked

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        assert self.error is None, self.error


@pytest.fixture
def service(tmp_path):
    """``service(n)``: n in-process shard servers on loopback; their addresses."""
    running = []

    def start(n: int = 1, **config) -> list[str]:
        for i in range(n):
            server, _ = create_server(ServerConfig(dir=str(tmp_path / f"shard-{i}"), **config))
            running.append(server)
        return [f"127.0.0.1:{s.port}" for s in running]

    yield start
    for server in running:
        server.stop(grace=1)


def assert_segment_is_the_inserted_one(packed, k: int) -> tuple[int, int]:
    """Segment ``k`` of ``packed`` equals the pattern segment it claims to be, bit for bit."""
    rows = np.cumsum(packed.lengths) - packed.lengths
    episode, first = int(packed.episode_ids[k]), int(packed.first_steps[k])
    n = int(packed.lengths[k])
    assert n == SEGMENT_STEPS
    ref = pack([pattern_segment(episode, first, n, OBS, terminated=first == 2 * SEGMENT_STEPS)])
    a = int(rows[k])
    for key, value in ref.steps.items():
        assert torch.equal(packed.steps[key][a : a + n], value), (episode, first, key)
    for key, value in ref.tails.items():
        assert torch.equal(packed.tails[key][k : k + 1], value), (episode, first, key)
    return episode, first


def read_all(reader) -> list[tuple[int, int]]:
    """Every segment of ``reader``, each checked against the inserted one; their keys."""
    keys = []
    for packed in reader:
        for k in range(len(packed)):
            keys.append(assert_segment_is_the_inserted_one(packed, k))
    return keys


# -- the snapshot ---------------------------------------------------------------------------
def test_a_snapshot_is_what_was_stored_when_pinned_while_inserts_go_on(service):
    (address,) = service()
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 100_000))
        writer = Writer(client, "replay", "w0")
        writer.start()
        try:
            writer.wait_for(30)
            with client.read_table("replay") as reader:
                pinned = reader.segments
                assert reader.steps == pinned * SEGMENT_STEPS
                assert reader.config.name == "replay" and reader.config.spec is not None
                # An open snapshot holds no insert back: the writer stores 60 more first.
                writer.wait_for(pinned + 60)
                keys = read_all(reader)
        finally:
            writer.finish()
    # Exactly what was stored at the pin: a prefix of the writer's stream, none later.
    assert keys == writer.written[:pinned]
    assert pinned >= 30 and len(writer.written) >= pinned + 60
    assert reader.overwritten_segments == reader.overwritten_steps == 0
    assert reader.shards == [
        {
            "address": address,
            "segments": pinned,
            "steps": pinned * SEGMENT_STEPS,
            "overwritten_segments": 0,
            "overwritten_steps": 0,
            "cut_segments": 0,
            "cut_steps": 0,
        }
    ]


def test_segments_overwritten_before_they_are_read_are_left_out_never_torn(service):
    # 234 slots: 13 episodes of 3 segments of 5 steps of 64 KiB observations (6 slots a
    # segment), one insert an episode. The reader takes one message at a time (1 MiB: two
    # segments), so the shard reads ahead only as far as the stream's buffers let it.
    (address,) = service()
    obs = (1 << 16,)

    def segments(episode):
        return [pattern_segment(episode, 5 * i, 5, obs, terminated=i == 2) for i in range(3)]

    written = []
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("ring", 234))
        with client.writer("ring", "w0") as w:
            for episode in range(40):  # the ring has turned over
                w.write_segments(segments(episode))
                w.flush()
                written += [(episode, 5 * i) for i in range(3)]
            small = ReplayClient(address, colocated=False, max_message_mb=1)
            with small, small.read_table("ring") as reader:
                pinned = reader.segments
                for episode in range(40, 53):  # a whole lap, while the snapshot is open
                    w.write_segments(segments(episode))
                    w.flush()
                got = []
                for packed in reader:
                    rows = np.cumsum(packed.lengths) - packed.lengths
                    for k in range(len(packed)):
                        e, first = int(packed.episode_ids[k]), int(packed.first_steps[k])
                        want = pattern(e, torch.arange(first, first + 5), obs)
                        assert torch.equal(
                            packed.steps[("observation",)][rows[k] : rows[k] + 5], want
                        )
                        assert torch.equal(
                            packed.tails[("observation",)][k], pattern(e, first + 5, obs)
                        )
                        got.append((e, first))
    assert pinned == 39
    snapshot = written[-pinned:]
    lost, cut = reader.overwritten_segments, reader.cut_segments
    assert lost >= 1  # a lap of inserts outran what the stream could buffer
    assert lost + cut + len(got) == pinned
    assert reader.overwritten_steps == 5 * lost and reader.cut_steps == 5 * cut
    assert got == [key for key in snapshot if key in set(got)]  # in snapshot order
    for e in {e for e, _ in got}:  # each episode's segments one unbroken run
        firsts = [f for g, f in got if g == e]
        assert firsts == list(range(firsts[0], firsts[0] + 5 * len(firsts), 5))


def test_every_shard_pins_its_snapshot_and_segments_come_shard_after_shard(service):
    addresses = service(2)
    with ReplayClient(addresses, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 100_000))
        writers = [Writer(client, "replay", f"w{i}", shard=i) for i in range(2)]
        for w in writers:
            w.start()
        try:
            for w in writers:
                w.wait_for(9)
            with client.read_table("replay") as reader:
                pinned = [s["segments"] for s in reader.shards]
                for w, n in zip(writers, pinned, strict=True):
                    w.wait_for(n + 9)
                keys = read_all(reader)
        finally:
            for w in writers:
                w.finish()
    assert reader.segments == sum(pinned)
    assert keys == writers[0].written[: pinned[0]] + writers[1].written[: pinned[1]]


def test_an_empty_table_is_an_empty_snapshot(service):
    (address,) = service()
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("empty", 100))
        with client.read_table("empty") as reader:
            assert (reader.segments, reader.steps, reader.config.spec) == (0, 0, None)
            assert list(reader) == []


# -- refusals: named, and the server stays up -----------------------------------------------
def test_refusals_name_the_problem_and_the_server_stays_up(service):
    (address,) = service()
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 1000))
        with pytest.raises(TableNotFoundError, match=rf"shard {address}: no table 'nope'"):
            client.read_table("nope")
        # A segment larger than the reader's message limit is refused before anything is
        # sent (the request's limit is the smaller of the two).
        client.create_table(TableConfig.uniform("images", 1000))
        with client.writer("images", "w-images") as w:
            w.write_segments([pattern_segment(1, 0, 3, (300_000,))])  # 1.2 MB
        small = ReplayClient(address, colocated=False, max_message_mb=1)
        with small, pytest.raises(ResourceExhaustedError, match="more than the message limit"):
            small.read_table("images")
        # A request that asks for a negative message size, straight on the wire.
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ReplayStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                list(stub.ReadTable(pb.ReadTableRequest(table="replay", max_message_bytes=-1)))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_message_bytes (-1) must be >= 0" in raised.value.details()
        assert client.info("images")["size"] == 3  # still serving
    nowhere = ReplayClient("127.0.0.1:1", colocated=False)
    with nowhere, pytest.raises(ShardUnavailableError, match="shard 127.0.0.1:1"):
        nowhere.read_table("replay")


def test_a_reader_read_twice_says_so(service):
    (address,) = service()
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 1000))
        with client.read_table("replay") as reader:
            list(reader)
            with pytest.raises(Exception, match="read once"):
                list(reader)


# -- millpond export ADDRESS ------------------------------------------------------------------
def check_ted_rows(td) -> None:
    """TED rows of pattern episodes, next observations included, each one unbroken run from
    step 0: whole (terminated at its last step), or still being written (not ended)."""
    n = td.batch_size[0]
    ids, steps = td["episode_id"].numpy(), td["step"].numpy()
    assert torch.equal(td["observation"], pattern(td["episode_id"], td["step"], OBS))
    assert torch.equal(td["next", "observation"], pattern(td["episode_id"], td["step"] + 1, OBS))
    assert torch.equal(td["action"], torch.stack([td["episode_id"], td["step"]], 1))
    whole = SEGMENT_STEPS * SEGMENTS_PER_EPISODE
    for episode in np.unique(ids):
        rows = np.flatnonzero(ids == episode)
        assert steps[rows].tolist() == list(range(len(rows)))
        assert len(rows) % SEGMENT_STEPS == 0 and len(rows) <= whole
        ends = td["next", "terminated"].reshape(n).numpy()[rows]
        assert ends[-1] == (len(rows) == whole) and not ends[:-1].any()


def test_export_from_an_address_while_a_writer_inserts(service, tmp_path, monkeypatch, capsys):
    addresses = service(2)
    root = tmp_path / "datasets"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    with ReplayClient(addresses, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 100_000))
        writers = [Writer(client, "replay", f"w{i}", shard=i) for i in range(2)]
        for w in writers:
            w.start()
        try:
            for w in writers:
                w.wait_for(30)
            target = ",".join(addresses)
            for fmt, out in (("ted", "out.ted"), ("hdf5", "out.h5")):
                assert (
                    main(
                        [
                            "export",
                            target,
                            "--table",
                            "replay",
                            "--format",
                            fmt,
                            str(tmp_path / out),
                        ]
                    )
                    == 0
                ), capsys.readouterr().err
            export = ["export", target, "--table", "replay", "--format", "minari"]
            assert main([*export, "--minari-root", str(root), "millpond/live-v0"]) == 0
        finally:
            for w in writers:
                w.finish()
    err = capsys.readouterr().err
    assert "overwritten" not in err and "left out" not in err  # the table is large
    ted = TensorDict.load_memmap(tmp_path / "out.ted")
    check_ted_rows(ted)
    assert ted.batch_size[0] >= 60 * SEGMENT_STEPS
    h5 = load_hdf5(tmp_path / "out.h5")
    check_ted_rows(h5)
    # Minari's own API opens it: whole episodes from reset, the inserted values.
    import minari

    dataset = minari.load_dataset("millpond/live-v0")
    assert dataset.total_episodes >= 20
    whole = SEGMENT_STEPS * SEGMENTS_PER_EPISODE
    for episode in dataset.iterate_episodes():
        n = len(episode.actions)
        e = int(episode.actions[0][0])
        assert episode.actions.tolist() == [[e, s] for s in range(n)]
        want = pattern(torch.full((n + 1,), e), torch.arange(n + 1), OBS).numpy()
        assert np.array_equal(episode.observations, want)
        # whole: terminated; still being written when pinned: truncated at its last step
        assert not (episode.terminations[:-1] | episode.truncations[:-1]).any()
        assert (episode.terminations[-1], episode.truncations[-1]) == (n == whole, n < whole)
    assert not list(tmp_path.glob(".millpond-snapshot-*"))  # the spooled table is gone
    assert not list(root.glob(".millpond-snapshot-*"))


def test_export_from_an_address_refusals_are_one_line(service, tmp_path, capsys):
    (address,) = service()
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 100))

    def error(*args) -> str:
        assert main(["export", *map(str, args)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    out = tmp_path / "out.ted"
    assert error(address, "--table", "nope", "--format", "ted", out) == (
        f"millpond: error: shard {address}: no table 'nope' on this shard (tables: replay)"
    )
    assert error("127.0.0.1:1", "--table", "replay", "--format", "ted", out).startswith(
        "millpond: error: shard 127.0.0.1:1: "
    )
    assert error(address, "--table", "replay", "--format", "ted", "--skip-busy-check", out) == (
        "millpond: error: --skip-busy-check is for a shard directory"
    )
    assert error("no/such/dir", "--table", "replay", "--format", "ted", out) == (
        "millpond: error: no/such/dir does not exist: pass a shard directory (what `millpond "
        "serve --dir` serves)"
    )
    assert not out.exists()


# -- docs/datasets.md, "A running service", as written --------------------------------------
def test_the_running_service_section_of_the_datasets_doc_runs_as_written(
    service, tmp_path, monkeypatch, capsys
):
    """Its ``console`` commands and its Python, against a service at the doc's address (the
    address replaced by a real one) while a writer inserts."""
    (address,) = service()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    section = DOC.read_text().split("## A running service", 1)[1]
    commands = [
        line.replace("localhost:50051", address)
        for block in re.findall(r"```console\n(.*?)```", section, re.S)
        for line in block.splitlines()
        if line.startswith("millpond ")
    ]
    code = re.findall(r"```py\n(.*?)```", section, re.S)
    assert len(commands) == 2 and len(code) == 1
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("replay", 100_000))
        writer = Writer(client, "replay", "w0", limit=6000)  # never turns the ring over
        writer.start()
        try:
            writer.wait_for(30)
            for line in commands:
                assert main(shlex.split(line)[1:]) == 0, (line, capsys.readouterr().err)
            exec(compile(code[0].replace("localhost:50051", address), str(DOC), "exec"), {})
        finally:
            writer.finish()
    out = capsys.readouterr().out
    assert re.search(r"exported \d+ rows of table 'replay' to live.ted", out)
    assert re.search(r"pinned \d+ segments \(\d+ steps\)", out)
    assert "left out: 0 overwritten, 0 cut" in out
    check_ted_rows(TensorDict.load_memmap(tmp_path / "live.ted"))


# -- frame stacks and tokens ------------------------------------------------------------------
def test_a_frame_stacked_table_exports_live_as_from_its_directory(service, tmp_path, monkeypatch):
    """Stacks come whole (each frame stored once on the shard): the live export's rows equal
    the directory export's, bit for bit."""
    (address,) = service()
    monkeypatch.chdir(tmp_path)
    k = 4
    frames = torch.arange(-(k - 1), 11, dtype=torch.float32)[:, None].expand(-1, 3).contiguous()
    stacks = torch.stack([frames[t : t + k] for t in range(11)])  # observation of step t
    steps = TensorDict(
        {
            "observation": stacks[:10],
            "action": torch.arange(10.0)[:, None],
            ("next", "reward"): torch.ones(10, 1),
            ("next", "terminated"): torch.arange(10)[:, None] == 9,
            ("next", "truncated"): torch.zeros(10, 1, dtype=torch.bool),
        },
        [10],
    )
    config = TableConfig(name="stacked", capacity=100, frame_stacks={("observation",): k})
    with ReplayClient(address, colocated=False) as client:
        client.create_table(config)
        with client.writer("stacked", "w") as w:
            for first in (0, 5):
                tail = TensorDict({"observation": stacks[first + 5]}, [])
                w.write_segment(steps[first : first + 5], tail, episode_id=1, first_step=first)
        assert main(["export", address, "--table", "stacked", "--format", "ted", "live"]) == 0
    live = TensorDict.load_memmap(Path("live"))
    assert torch.equal(live["observation"], stacks[:10])
    assert torch.equal(live["next", "observation"], stacks[1:])
    assert live["step"].tolist() == list(range(10))


def test_reading_a_table_is_for_admins_where_tokens_are_on(service, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("learner learner-secret-1\nadmin admin-secret-12\n")
    (address,) = service(token_file=str(tokens))
    with ReplayClient(address, token="admin-secret-12", colocated=False) as admin:
        admin.create_table(TableConfig.uniform("replay", 100))
        with admin.writer("replay", "w") as w:
            w.write_segments(episode_segments(1))
        with admin.read_table("replay") as reader:
            assert [len(p) for p in reader] == [3]
    learner = ReplayClient(address, token="learner-secret-1", colocated=False)
    with learner, pytest.raises(PermissionDeniedError, match="may not call ReadTable"):
        learner.read_table("replay")


def test_a_compressed_table_sends_its_observations_compressed_and_exact(service):
    (address,) = service()
    with ReplayClient(address, colocated=False) as client:
        client.create_table(TableConfig.uniform("zstd", 1000, compression="zstd"))
        with client.writer("zstd", "w") as w:
            for episode in range(5):
                w.write_segments(episode_segments(episode))
        with client.read_table("zstd") as reader:
            keys = read_all(reader)
    assert keys == [(e, f) for e in range(5) for f in (0, 5, 10)]
