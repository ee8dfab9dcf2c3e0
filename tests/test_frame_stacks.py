"""Frame-stacked observations stored one frame per slot, rebuilt exactly.

The data are real ALE frames: Pong through ``AtariPreprocessing`` and gymnasium's
``FrameStackObservation`` (``uint8[4, 84, 84]``), with a short time limit so that episode
starts and truncations come every few dozen steps. The reference is the raw env loop's own
record (:func:`millpond.testing.rollout`): every stored step, and its next observation, must
equal the stack the env produced, bit for bit, whichever way it went in (segments, TED
through ``extend``), whichever way it comes out (``sample``, ``sample_slots``, export), and
after the table is reopened.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ale_py", reason="needs the atari extra: pip install 'millpond[atari]'")
pytest.importorskip("cv2", reason="AtariPreprocessing needs opencv (the atari extra)")

from millpond.actors.envs import WrapperSpec, make_env
from millpond.config import TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError, StorageCorruptedError
from millpond.frame_stacks import compact_stacks, expand_stacks, rebuild
from millpond.protos.tables import config_from_proto, config_to_proto
from millpond.segmenting import from_ted
from millpond.segments import pack
from millpond.service.export import export_ted
from millpond.service.table import Table
from millpond.service.table_files import disk_usage
from millpond.spec import OBSERVATION, STEP, FieldSpec, TableSpec
from millpond.testing import rollout

K = 4
SHAPE = (K, 84, 84)
STEPS = 150
CHUNK = 16  # steps per segment at most: episodes are continued across segments


def _atari_env(padding: str = "reset"):
    return make_env(
        "ALE/Pong-v5",
        # In emulator frames (4 per step): 40 steps per episode, then a truncation.
        {"frameskip": 1, "max_episode_steps": 160},
        [
            WrapperSpec("gymnasium.wrappers:AtariPreprocessing", {"frame_skip": 4}),
            WrapperSpec(
                "gymnasium.wrappers:FrameStackObservation",
                {"stack_size": K, "padding_type": padding},
            ),
        ],
    )


def _record(padding: str = "reset"):
    env = _atari_env(padding)
    try:
        ted = rollout(env, STEPS, seed=3)
    finally:
        env.close()
    assert ted["observation"].dtype == torch.uint8 and ted["observation"].shape[1:] == SHAPE
    assert ted["next", "truncated"].sum() >= 2, "the test needs episode ends"
    return ted


@pytest.fixture(scope="module")
def ted():
    return _record()


def _config(name: str = "fs", capacity: int = 1024, **kwargs) -> TableConfig:
    return TableConfig.uniform(name, capacity, frame_stacks={"observation": K}, seed=1, **kwargs)


def _segments(ted, chunk: int = CHUNK):
    """The rollout cut as an actor cuts it: at episode ends and every ``chunk`` steps."""
    segments, t, n = [], 0, ted.shape[0]
    while t < n:
        first_step = int(ted["step_count"][t])
        end = t
        while end + 1 < n and end + 1 - t < chunk and not bool(ted["next", "done"][end]):
            end += 1
        ep = int(ted["collector", "traj_ids"][t])
        piece = ted[t : end + 1].exclude("collector", "step_count", ("next", "done"))
        segments += from_ted(piece, [end + 1 - t], [ep], [first_step])
        t = end + 1
    return segments


def _reference(ted):
    """``(episode, step) -> row`` of the raw env loop's record."""
    return {
        (int(e), int(s)): i
        for i, (e, s) in enumerate(
            zip(ted["collector", "traj_ids"].tolist(), ted["step_count"].tolist())
        )
    }


def _check_rows(batch, ted, episode_of=lambda e: e) -> int:
    """Every row of ``batch`` equals the env's own stacks; returns the rows checked."""
    where = _reference(ted)
    ids, steps = batch["episode_id"].reshape(-1).tolist(), batch["step"].reshape(-1).tolist()
    obs = batch["observation"].reshape(-1, *SHAPE)
    nxt = batch["next", "observation"].reshape(-1, *SHAPE)
    for row, (e, s) in enumerate(zip(ids, steps)):
        i = where[(episode_of(e), s)]
        assert torch.equal(obs[row], ted["observation"][i]), (e, s)
        assert torch.equal(nxt[row], ted["next", "observation"][i]), (e, s)
    return len(ids)


def _check_table(table, ted, tmp_path, episode_of=lambda e: e) -> None:
    """Sampled (both ways) and exported rows equal the env's stacks; every step is there."""
    _check_rows(table.sample(64), ted, episode_of)
    _check_rows(table.sample_slots(64).to_ted(), ted, episode_of)
    exported = export_ted(table, tmp_path / f"export-{table.name}-{np.random.randint(1 << 30)}")
    assert exported.shape[0] == table.size == ted.shape[0]
    _check_rows(exported, ted, episode_of)
    # Episode starts and truncations are among the rows: the stacks the env padded.
    assert bool((exported["step"] == 0).any())
    assert bool(exported["next", "truncated"].any())


def test_segments_round_trip_bit_for_bit(make_table, ted, tmp_path):
    table = make_table(_config())
    segments = _segments(ted)
    assert len({s.episode_id for s in segments}) < len(segments)  # continuations
    table.insert_many(segments)
    _check_table(table, ted, tmp_path)
    # One frame per slot: the observation column is a stack's quarter.
    assert table.storage.columns[("observation",)].shape[1:] == SHAPE[1:]


def test_ted_extend_round_trip_in_chunks(make_table, ted, tmp_path):
    table = make_table(_config())
    for a in range(0, STEPS, 37):  # chunks that cut episodes anywhere
        table.extend(ted[a : a + 37].exclude("step_count"))
    _check_table(table, ted, tmp_path)


@pytest.mark.parametrize("sampler", ["slices", "queue", "prioritized"])
def test_every_sampler_rebuilds_stacks(make_table, ted, sampler):
    kwargs = {"slice_len": 5} if sampler == "slices" else {}
    config = TableConfig(
        "fs", 1024, sampler=sampler, frame_stacks={"observation": K}, seed=2, **kwargs
    )
    table = make_table(config)
    table.insert_many(_segments(ted))
    batch = table.sample(20)
    assert _check_rows(batch, ted) > 0
    assert _check_rows(table.sample_slots(20).to_ted(), ted) > 0


def test_zero_padded_episode_starts(make_table, tmp_path):
    ted = _record("zero")
    starts = ted["observation"][ted["step_count"] == 0]
    assert bool((starts[:, 0] == 0).all())  # the padding the env chose, kept as it is
    table = make_table(_config())
    table.insert_many(_segments(ted))
    _check_table(table, ted, tmp_path)


@pytest.fixture(scope="module", params=["reset", "zero"])
def padded(request):
    """The rollout with each of ``FrameStackObservation``'s paddings."""
    return _record(request.param)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_a_writer_s_continuations_store_no_older_frames(make_table, tmp_path, padded, chunk):
    """Segments of a writer with an id continue each other on their tail slots, a prefix
    per chain: every stack still the env's, sampled and exported."""
    record = padded
    table = make_table(_config(f"fs-{chunk}", capacity=8192))
    segments = _segments(record, chunk)
    for i, seg in enumerate(segments):
        seg.sequence = i + 1
        table.insert_many([seg], writer_id="actor")
    chains = table.storage._next_prefix - 1
    episodes = len(set(record["collector", "traj_ids"].tolist()))
    assert chains <= 2 * episodes < len(segments)
    _check_table(table, record, tmp_path)


def test_ring_wraps_and_records_are_reused(make_table, ted):
    # A ring smaller than the data: old segments are evicted and their records (prefixes
    # included) taken by new ones, many times over.
    table = make_table(_config(capacity=60))
    for _ in range(3):
        table.insert_many(_segments(ted, chunk=7))
        for _ in range(5):
            _check_rows(table.sample(32), ted)
            _check_rows(table.sample_slots(32).to_ted(), ted)


def test_reopen_recovers_exact_stacks(tmp_path, ted):
    path = tmp_path / "t"
    table = Table.create(path, _config())
    table.insert_many(_segments(ted))
    table.close()
    table = Table.open(path)
    try:
        assert table.storage.corrupted == []
        assert table.config.frame_stacks == {("observation",): K}
        _check_table(table, ted, tmp_path)
    finally:
        table.close()


def test_a_damaged_prefix_is_caught(tmp_path, ted):
    path = tmp_path / "t"
    table = Table.create(path, _config())
    table.insert_many(_segments(ted))
    slots = table.storage.published_step_slots()
    assert table.storage.verify(slots).all()
    # Damage one frame of the first segment's prefix (record 1) in place.
    prefix = table.storage.prefixes[("observation",)]
    prefix[1, 0, 40, 40] ^= 1
    ok = table.storage.verify(slots)
    damaged = table.storage.segments_at(slots[~ok])
    assert len(damaged) == 1 and (~ok).sum() == damaged.lengths[0]
    prefix[1, 0, 40, 40] ^= 1
    table.close()
    # Damaged on disk: recovery drops that segment, the rest is served exactly.
    file = path / "data" / "prefixes" / "observation.bin"
    raw = bytearray(file.read_bytes())
    raw[(K - 1) * 84 * 84 + 100] ^= 0xFF
    file.write_bytes(bytes(raw))
    table = Table.open(path)
    try:
        table.verify_all()  # the data's checksums are checked after the open
        assert len(table.storage.corrupted) == 1
        assert table.size == ted.shape[0] - table.storage.corrupted[0][2]
        for _ in range(5):
            _check_rows(table.sample(64), ted)
    finally:
        table.close()


def test_stacks_that_do_not_overlap_are_refused(make_table, ted):
    table = make_table(_config())
    segments = _segments(ted)
    seg = segments[1]
    obs = seg.steps["observation"].clone()
    obs[3, 1] = 255 - obs[3, 1]  # frame 1 of step 3 is no longer step 2's frame 2
    seg.steps["observation"] = obs
    with pytest.raises(InvalidDataError) as info:
        table.insert_many(segments)
    message = str(info.value)
    assert "'observation'" in message
    assert f"step {seg.first_step + 3} of episode {seg.episode_id}" in message
    assert table.size == 0  # nothing of the call was stored
    # The tail is checked against the last step too.
    seg = _segments(ted)[0]
    tail = seg.tail["observation"].clone()
    tail[0] = 255 - tail[0]
    seg.tail["observation"] = tail
    with pytest.raises(InvalidDataError, match=f"step {seg.first_step + seg.steps.shape[0]} "):
        table.insert_many([seg])
    # TED through extend alike.
    bad = ted[:20].exclude("step_count").clone()
    bad["observation"][5, 0] = 255 - bad["observation"][5, 0]
    bad["next", "observation"][4] = bad["observation"][5]  # a consistent TED otherwise
    with pytest.raises(InvalidDataError, match="step 5 of episode 0"):
        table.extend(bad)


def test_frames_and_stacks_convert_both_ways(ted):
    packed = pack(_segments(ted))
    obs = packed.steps[("observation",)]
    compact = compact_stacks(packed, {("observation",): K})
    frames = compact.frames[("observation",)]
    assert frames.shape == (packed.num_steps + len(packed) * K, *SHAPE[1:])
    assert ("observation",) not in compact.steps and ("observation",) not in compact.tails
    steps, tails = expand_stacks(compact)
    assert torch.equal(steps[("observation",)], obs)
    assert torch.equal(tails[("observation",)], packed.tails[("observation",)])
    # Cutting by segments keeps each segment's frames together.
    for i, j in ((0, 1), (2, 5)):
        part = compact.group(i, j)
        s, t = expand_stacks(part)
        assert torch.equal(s[("observation",)], packed.group(i, j).steps[("observation",)])
        assert torch.equal(t[("observation",)], packed.group(i, j).tails[("observation",)])
    keep = np.arange(len(packed)) % 2 == 0
    s, _ = expand_stacks(compact.select(keep))
    assert torch.equal(s[("observation",)], packed.select(keep).steps[("observation",)])


def test_rebuild_is_a_pure_function_of_the_files():
    # Two segments in a ring of frames: [a0..a3] first stack then 2 more, and [b0..b3] + 1.
    frames = torch.arange(10).reshape(10, 1) * 10
    prefix = torch.zeros(3, K - 1, 1, dtype=torch.int64)
    prefix[1, :, 0] = torch.tensor([-3, -2, -1])
    prefix[2, :, 0] = torch.tensor([-6, -5, -4])
    starts = np.array([0, 0, 0, 5, 5])
    records = np.array([1, 1, 1, 2, 2])
    out = rebuild(frames, prefix, np.array([0, 1, 2, 5, 6]), starts, records)[..., 0]
    assert out.tolist() == [
        [-3, -2, -1, 0],
        [-2, -1, 0, 10],
        [-1, 0, 10, 20],
        [-6, -5, -4, 50],
        [-5, -4, 50, 60],
    ]


def test_declarations_are_checked_and_travel():
    spec = TableSpec(
        {
            ("observation",): FieldSpec(torch.uint8, SHAPE, OBSERVATION),
            ("action",): FieldSpec(torch.int64, (), STEP),
        }
    )
    config = TableConfig("t", 64, spec=spec, frame_stacks={"observation": K})
    assert config_from_proto(config_to_proto(config)) == config
    assert config_from_proto(config_to_proto(config)).frame_stacks == {("observation",): K}
    as_json = json.loads(json.dumps(config.to_json()))
    assert as_json["frame_stacks"] == {"observation": K}
    assert TableConfig.from_json(as_json) == config
    # A config without stacks writes what it always wrote (so old digests still match).
    assert "frame_stacks" not in TableConfig("t", 64).to_json()
    with pytest.raises(InvalidConfigError, match="step key"):
        TableConfig("t", 64, spec=spec, frame_stacks={"action": 4})
    with pytest.raises(InvalidConfigError, match="not in the table spec"):
        TableConfig("t", 64, spec=spec, frame_stacks={"pixels": 4})
    with pytest.raises(InvalidConfigError, match="integer >= 2"):
        TableConfig("t", 64, frame_stacks={"observation": 1})
    with pytest.raises(InvalidConfigError, match=r"a stack of 3 frames has shape \[3, \*frame\]"):
        TableConfig("t", 64, spec=spec, frame_stacks={"observation": 3})


def test_first_insert_checks_an_undeclared_spec(make_table, ted):
    # Without a declared spec, the first insert is checked against the stacks declared.
    table = make_table(TableConfig.uniform("t", 256, frame_stacks={"observation": 3}))
    with pytest.raises(InvalidDataError, match=r"frame-stacked \(3 frames\).*\[16, 3, \*frame\]"):
        table.insert_many(_segments(ted)[:1])
    table = make_table(TableConfig.uniform("u", 256, frame_stacks={"pixels": 4}))
    with pytest.raises(InvalidConfigError, match="'pixels' is not in the table spec"):
        table.insert_many(_segments(ted)[:1])
    assert table.spec is None


def test_bytes_on_disk_per_transition(make_table, ted):
    stacked = make_table(_config("stacked"))
    plain = make_table(TableConfig.uniform("plain", 1024, seed=1))
    segments = _segments(ted, chunk=32)  # the shipped Atari configs' chunk_len
    for table in (stacked, plain):
        table.insert_many(segments)
    obs = {t.name: disk_usage(t.path, t.spec)["observations"] for t in (stacked, plain)}
    frame = int(np.prod(SHAPE[1:]))
    # A frame per slot (steps and tails) and K - 1 per segment: 1 + K / L frames per step,
    # here with 40-step episodes (cut into 32 + 8); the blocks are reserved in chunks
    # ahead of use, a few dozen frames here. benchmarks/atari_compression.py measures
    # long episodes.
    stored = STEPS + len(segments) * K
    assert stored * frame <= obs["stacked"] <= (stored + 64) * frame
    ted_bytes = 2 * STEPS * K * frame  # TED: obs and ("next", obs) per row
    assert obs["stacked"] < 0.2 * ted_bytes
    assert obs["stacked"] < 0.4 * obs["plain"]


def test_job_configs_declare_stacks(tmp_path):
    from millpond.deploy.launch_config import load_config

    configs = Path(__file__).resolve().parents[1] / "deploy" / "configs"
    config = load_config(configs / "atari-dqn.yaml", ["replay.table.frame_stacks={observation: 4}"])
    assert config.replay.table_config().frame_stacks == {("observation",): K}
    path = tmp_path / "job.yaml"
    path.write_text("replay:\n  table: {name: r, capacity: 64, frame_stacks: {observation: 1}}\n")
    with pytest.raises(InvalidConfigError, match=r"replay.table: frame_stacks: .*integer >= 2"):
        load_config(path).replay.table_config()


def test_a_missing_prefix_file_refuses_the_table(tmp_path, ted):
    path = tmp_path / "t"
    table = Table.create(path, _config())
    table.insert_many(_segments(ted)[:3])
    table.close()
    (path / "data" / "prefixes" / "observation.bin").unlink()
    with pytest.raises(StorageCorruptedError, match="prefix file .* is missing"):
        Table.open(path)


def test_the_shard_checks_declarations_and_frames(tmp_path):
    import grpc

    from millpond.protos import codec, samples
    from millpond.protos import millpond_pb2 as pb
    from millpond.protos import millpond_pb2_grpc as pb_grpc
    from millpond.service.server import ServerConfig, create_server

    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    try:
        bad = config_to_proto(TableConfig("x", 64))
        bad.frame_stacks.add(key=["observation"], frames=1)
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateTable(pb.CreateTableRequest(config=bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "integer >= 2" in info.value.details()
        stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(_config("t", 64))))

        def insert(frame_rows: int, frame_shape=(2, 3)):
            n = 5  # one segment of 5 steps: 5 + K frames
            steps = {
                ("action",): torch.zeros(n, dtype=torch.int64),
                ("next", "reward"): torch.zeros(n, 1),
                ("next", "terminated"): torch.zeros(n, 1, dtype=torch.bool),
                ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
            }
            frames = torch.arange(frame_rows * 6, dtype=torch.uint8).reshape(
                frame_rows, *frame_shape
            )
            packed = pb.PackedSegments(
                episode_ids=[1],
                first_steps=[0],
                lengths=[n],
                steps=codec.to_tensor_map(steps, batch_size=[n]),
                tails=codec.to_tensor_map({}, [1]),
                frames=codec.to_tensor_map({("observation",): frames}, []),
            )
            request = pb.InsertRequest(writer_id="", table="t", packed=[packed])
            return list(stub.Insert(iter([request])))

        with pytest.raises(grpc.RpcError) as info:
            insert(5 + K - 1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"expected {5 + K} frames" in info.value.details()
        insert(5 + K)  # the spec comes from it: uint8[4, 2, 3]
        with pytest.raises(grpc.RpcError) as info:
            insert(5 + K, (3, 2))
        assert "expected uint8[4, 2, 3]" in info.value.details()
        batch = samples.decode_sample(next(stub.Sample(pb.SampleRequest(table="t", batch_size=5))))
        frames = torch.arange((5 + K) * 6, dtype=torch.uint8).reshape(5 + K, 2, 3)
        for obs, nxt, step in zip(
            batch["observation"], batch["next", "observation"], batch["step"]
        ):
            assert torch.equal(obs, frames[int(step) : int(step) + K])
            assert torch.equal(nxt, frames[int(step) + 1 : int(step) + 1 + K])
    finally:
        channel.close()
        running.stop(grace=1)
