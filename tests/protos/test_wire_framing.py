"""Insert requests framed by hand (protos/wire.py): the same bytes protobuf reads, parsed
back into the same tensors, and malformed bytes refused by name, over a real server too."""

import dataclasses

import grpc
import numpy as np
import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.errors import InvalidDataError
from millpond.learner.client._insert_messages import MessagePacker
from millpond.protos import codec, framing, samples, wire
from millpond.protos import millpond_pb2 as pb
from millpond.protos.tables import config_to_proto
from millpond.segments import PackedSegments, pack_columns
from millpond.service.server import ServerConfig, create_server
from millpond.spec import Key


def _packed(n_segments: int = 3, length: int = 4, seed: int = 0) -> PackedSegments:
    g = torch.Generator().manual_seed(seed)
    rows = n_segments * length
    steps: dict[Key, torch.Tensor] = {
        ("pixels",): torch.randint(0, 256, (rows, 2, 5, 3), dtype=torch.uint8, generator=g),
        ("action",): torch.arange(rows) - 7,
        ("next", "reward"): torch.randn(rows, 1, generator=g).to(torch.bfloat16),
        # the second segment ends its episode
        ("next", "terminated"): (torch.arange(rows) == 2 * length - 1).reshape(rows, 1),
        ("next", "truncated"): torch.zeros(rows, 1, dtype=torch.bool),
        ("mask",): torch.empty(rows, 0),  # an empty tensor carries no data field
    }
    tails = {("pixels",): torch.randint(0, 256, (n_segments, 2, 5, 3), dtype=torch.uint8)}
    return pack_columns(
        steps,
        tails,
        [length] * n_segments,
        list(range(10, 10 + n_segments)),
        [0, 5, 2**40][:n_segments],
    )


def _protobuf_message(packed: PackedSegments, compress: set[Key], first: int) -> pb.PackedSegments:
    msg = pb.PackedSegments(
        sequences=range(first, first + len(packed)),
        episode_ids=packed.episode_ids.tolist(),
        first_steps=packed.first_steps.tolist(),
        lengths=packed.lengths.tolist(),
    )
    codec.to_tensor_map(packed.steps, [packed.num_steps], compress, out=msg.steps)
    codec.to_tensor_map(packed.tails, [len(packed)], compress, out=msg.tails)
    return msg


@pytest.mark.parametrize("compress", [set(), {("pixels",)}])
def test_hand_framed_bytes_are_the_protobuf_message(compress):
    packed = _packed()
    body = wire.encode_packed(packed, compress, framed=True)
    raw = wire.insert_request("writer-é", "table", [(7, len(packed), body)], timeout_ms=250)
    request = pb.InsertRequest.FromString(raw)
    assert request.writer_id == "writer-é" and request.table == "table"
    assert request.timeout_ms == 250
    assert list(request.packed) == [_protobuf_message(packed, compress, 7)]


def test_parsed_views_equal_protobufs_own_parse():
    packed = _packed()
    reference = pb.InsertRequest(
        writer_id="w",
        table="t",
        packed=[_protobuf_message(packed, {("pixels",)}, 1), _protobuf_message(packed, set(), 4)],
    )
    view = wire.parse_framed_insert(reference.SerializeToString())  # any client's bytes
    assert (view.writer_id, view.table) == ("w", "t")
    assert [list(p.sequences) for p in view.packed] == [[1, 2, 3], [4, 5, 6]]
    for got, want in zip(view.packed, reference.packed):
        assert list(got.lengths) == list(want.lengths)
        assert list(got.first_steps) == list(want.first_steps)
        for part in ("steps", "tails"):
            a, batch_a = codec.from_tensor_map_flat(getattr(got, part), copy=False)
            b, batch_b = codec.from_tensor_map_flat(getattr(want, part))
            assert batch_a == batch_b and a.keys() == b.keys()
            for key in b:
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("compress", [set(), {("pixels",)}])
def test_priorities_travel_hand_framed_as_protobufs_bytes(compress):
    packed = dataclasses.replace(_packed(), priorities=np.linspace(0.0, 3.0, 12) ** 2)
    body = wire.encode_packed(packed, compress, framed=True)
    assert body == wire.encode_packed(packed, compress, framed=False)
    raw = wire.insert_request("w", "t", [(7, len(packed), body)])
    want = _protobuf_message(packed, compress, 7)
    want.priorities.extend(packed.priorities.tolist())
    assert raw == pb.InsertRequest(writer_id="w", table="t", packed=[want]).SerializeToString()
    (got,) = wire.parse_framed_insert(raw).packed
    assert list(got.priorities) == packed.priorities.tolist()  # float64: exact
    without = wire.insert_request("w", "t", [(7, 3, wire.encode_packed(_packed(), framed=True))])
    assert list(wire.parse_framed_insert(without).packed[0].priorities) == []


def test_a_refitted_message_keeps_its_priorities():
    """A queued message cut again for a lower message limit keeps each step's priority."""
    packed = dataclasses.replace(_packed(), priorities=np.arange(12, dtype=np.float64))
    packer = MessagePacker(256 * 1024 * 1024, lambda: None)
    (queued,) = packer.encode(packed)
    queued.number(1)
    # The shard says a limit that one segment fits and two do not (64 KiB: the room the
    # packer keeps for the request's other fields).
    packer.shard_message_bytes = 64 * 1024 + queued.size // 2
    parts = list(packer.refit({queued.last: queued}).values())
    assert len(parts) > 1
    got = [list(wire.parse_packed(p.body).priorities) for p in parts]
    assert [len(g) for g in got] == [4 * p.count for p in parts]  # 4 steps per segment
    assert [p for g in got for p in g] == packed.priorities.tolist()


def test_views_share_the_request_bytes():
    packed = _packed()
    raw = wire.insert_request("w", "t", [(1, len(packed), wire.encode_packed(packed, framed=True))])
    view = wire.parse_framed_insert(raw)
    steps, _ = codec.from_tensor_map_flat(view.packed[0].steps, copy=False)
    pixels = steps[("pixels",)]
    start = np.frombuffer(raw, dtype=np.uint8).ctypes.data
    assert start <= pixels.data_ptr() < start + len(raw)  # a view, not a copy
    assert torch.equal(pixels, packed.steps[("pixels",)])


def test_a_field_given_twice_merges_as_in_protobuf():
    packed = _packed()
    msg = _protobuf_message(packed, set(), 1)
    tails = msg.tails.SerializeToString()
    extra = b"\x32" + framing.varint(len(tails)) + tails  # the tails TensorMap again
    raw = pb.InsertRequest(writer_id="w", table="t").SerializeToString()
    body = msg.SerializeToString() + extra
    raw += b"\x2a" + framing.varint(len(body)) + body
    want = pb.InsertRequest.FromString(raw).packed[0]
    got = wire.parse_framed_insert(raw).packed[0]
    assert len(got.tails.tensors) == len(want.tails.tensors) == 2
    assert list(got.tails.batch_size) == list(want.tails.batch_size) == [3, 3]


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b"\x0a\x05ab", "runs past the message's end"),
        (b"\x2a\x03\x2a\x10\x00", "runs past the message's end"),
        (b"\x20" + b"\xff" * 11, "longer than ten bytes"),
        (b"\x20\xff", "cut short"),
        (b"\x00\x01", "field number 0"),
        (b"\x0b", "groups"),
        (b"\x29\x01\x02", "cut short"),
        (b"\x2a\x07\x2a\x05\x12\x03\x12\x01\xff", "not valid UTF-8"),  # a tensor's dtype
        (b"\x0a\x01\xff", "malformed InsertRequest"),  # the writer id (protobuf's own parse)
    ],
)
def test_malformed_bytes_are_refused_by_name(raw, named):
    with pytest.raises(InvalidDataError, match="malformed") as e:
        wire.parse_framed_insert(raw)
    assert named in str(e.value)


@pytest.fixture
def served(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield running, port, channel
    channel.close()
    running.stop(grace=1)


def test_server_refuses_malformed_bytes_and_lives(served):
    _, port, channel = served
    raw_insert = channel.stream_stream("/millpond.v1.Replay/Insert", request_serializer=None)
    for raw in (b"\x2a\x07\x2a\x05\x12\x03\x12\x01\xff", b"\x0a\x05ab", b"\x2a\x02\x2a\x7f"):
        with pytest.raises(grpc.RpcError) as e:
            list(raw_insert(iter([raw]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed" in e.value.details()
    with ReplayClient([f"127.0.0.1:{port}"]) as client:  # still serving, and storing
        client.create_table(TableConfig.uniform("t", 100))
        packed = _packed()
        with client.writer("t", "w") as writer:
            writer.write_packed(packed)
        assert client.info("t")["size"] == packed.num_steps


def test_protobuf_built_requests_still_insert(served):
    """A client that builds its requests with protobuf (any other language's) inserts alike."""
    _, port, channel = served
    from millpond.protos import millpond_pb2_grpc as pb_grpc

    stub = pb_grpc.ReplayStub(channel)
    stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(TableConfig.uniform("t", 100))))
    packed = _packed()
    request = pb.InsertRequest(
        writer_id="w", table="t", packed=[_protobuf_message(packed, {("pixels",)}, 1)]
    )
    (ack,) = stub.Insert(iter([request]))
    assert list(ack.sequences) == [1, 2, 3]
    with ReplayClient([f"127.0.0.1:{port}"]) as client:
        batch = client.sample("t", 64)
    stored = packed.steps[("pixels",)]
    for row in batch["pixels"]:
        assert any(torch.equal(row, s) for s in stored)


def test_slot_sample_bytes_are_the_protobuf_message(make_table):
    from millpond.testing import pattern_segment

    table = make_table(TableConfig.uniform("pixels", 200, seed=3))
    for episode in range(6):
        seg = pattern_segment(episode, 0, 20, (2, 6, 6))
        table.insert(seg.steps, seg.tail, episode_id=episode)
    sample = table.sample_slots(32)
    for compress in (False, True):
        want = samples.encode_slot_sample(sample, compress=compress)
        want.mass = 12.5
        raw = wire.encode_slot_sample(sample, 12.5, compress)
        assert pb.SampleResponse.FromString(raw) == want
        view = wire.parse_sample_response(raw)
        assert view.mass == 12.5 and view.HasField("slot_observations")
        got, expected = samples.decode_sample(view), samples.decode_sample(want)
        for key, value in expected.items(include_nested=True, leaves_only=True):
            assert torch.equal(got.get(key), value), key


def test_malformed_sample_bytes_are_refused_by_name():
    with pytest.raises(InvalidDataError, match="malformed SampleResponse"):
        wire.parse_sample_response(b"\x0a\x09\x0a")
    with pytest.raises(InvalidDataError, match="malformed Tensor"):
        wire.parse_sample_response(b"\x2a\x04\x12\x02\x0a\xff")  # slot rows: a bad key
