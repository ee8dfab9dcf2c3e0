"""Priorities given at insert (Ape-X): stored as given, refused by name when they cannot be,
kept once on a re-send, and outlived by the generation check of priority updates."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from millpond import TableConfig
from millpond.errors import InvalidDataError
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos import wire
from millpond.protos.tables import config_to_proto
from millpond.segments import Segment, pack
from millpond.service.server import ServerConfig, create_server
from millpond.testing import stored_segments
from tests.service._wire import segment_proto, steps_td


def segment(ep: int, n: int = 4, priorities=None, sequence: int | None = None) -> Segment:
    obs = torch.arange((n + 1) * 3, dtype=torch.float32).reshape(n + 1, 3) + 100 * ep
    return Segment(steps_td(obs[:-1]), {"observation": obs[-1]}, ep, 0, sequence, priorities)


def step_priorities(table) -> dict[tuple[int, int], float]:
    """``{(episode, step): priority}`` of every stored step."""
    out = {}
    for (ep, first, length, start), _ in stored_segments(table).items():
        for i in range(length):
            out[(ep, first + i)] = float(table.sampler.priorities[start + i])
    return out


def test_each_step_starts_at_its_given_priority_others_at_the_max(make_table):
    table = make_table(TableConfig.prioritized("t", 100, seed=0))
    table.insert_packed(pack([segment(1, priorities=[0.5, 2.0, 0.0, 3.25])]))
    table.insert_packed(pack([segment(2)]))  # none given: the largest priority so far
    got = step_priorities(table)
    assert [got[(1, i)] for i in range(4)] == [0.5, 2.0, 0.0, 3.25]
    assert [got[(2, i)] for i in range(4)] == [3.25] * 4
    assert table.sampler.max_priority == 3.25


@pytest.mark.parametrize(
    ("priorities", "named"),
    [
        ([1.0, 2.0, 3.0], r"one priority per step, shape \[4\], received \[3\]"),
        ([[1.0, 2.0], [3.0, 4.0]], r"one priority per step, shape \[4\], received \[2, 2\]"),
        ([1.0, -0.5, 1.0, 1.0], "priority of step 1 is -0.5: priorities must be >= 0"),
        ([1.0, 1.0, float("nan"), 1.0], "priority of step 2 is nan: priorities must be finite"),
        ([float("inf"), 1.0, 1.0, 1.0], "priority of step 0 is inf: priorities must be finite"),
        (["a", "b", "c", "d"], "priorities must be numbers"),
        (torch.ones(4, dtype=torch.bool), "priorities must be numbers"),
    ],
)
def test_bad_priorities_are_refused_by_name(make_table, priorities, named):
    table = make_table(TableConfig.prioritized("t", 100))
    with pytest.raises(InvalidDataError, match=named):
        table.insert_packed(pack([segment(1, priorities=priorities)]))
    bad = pack([segment(1)])
    bad.priorities = np.asarray(priorities, dtype=object)  # built by hand: checked by the table
    with pytest.raises(InvalidDataError, match="priorit"):
        table.insert_packed(bad)
    assert table.size == 0


def test_priorities_of_some_segments_only_are_refused(make_table):
    with pytest.raises(InvalidDataError, match="every segment of an insert has priorities or none"):
        pack([segment(1, priorities=[1.0] * 4), segment(2)])


@pytest.mark.parametrize(
    "config",
    [
        TableConfig.uniform("u", 100),
        TableConfig.queue("q", 100),
        TableConfig.slices("s", 100, 2),
    ],
    ids=["uniform", "queue", "slices"],
)
def test_a_table_without_priorities_refuses_them_naming_table_and_sampler(make_table, config):
    table = make_table(config)
    with pytest.raises(InvalidDataError, match=f"table {config.name!r} has a {config.sampler!r}"):
        table.insert_packed(pack([segment(1, priorities=[1.0] * 4)]))
    assert table.size == 0
    table.insert_packed(pack([segment(1)]))  # without: stored as before
    assert table.size == 4


def test_a_resent_segment_with_priorities_is_stored_once(make_table):
    table = make_table(TableConfig.prioritized("t", 100))
    first = pack([segment(1, priorities=[1.0, 2.0, 3.0, 4.0], sequence=1)])
    assert table.insert_packed(first, writer_id="w").tolist() == [1]
    # Re-sent with the next one (the acknowledgement was lost): the first is skipped, and
    # keeps the priorities it was stored with.
    again = pack(
        [
            segment(1, priorities=[9.0] * 4, sequence=1),
            segment(2, priorities=[5.0, 6.0, 7.0, 8.0], sequence=2),
        ]
    )
    assert table.insert_packed(again, writer_id="w").tolist() == [0, 2]
    assert table.size == 8
    got = step_priorities(table)
    assert [got[(1, i)] for i in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert [got[(2, i)] for i in range(4)] == [5.0, 6.0, 7.0, 8.0]


def test_an_update_for_an_overwritten_slot_is_dropped(make_table):
    table = make_table(TableConfig.prioritized("t", 10))  # two segments of 4 steps fit
    table.insert_packed(pack([segment(1, priorities=[1.0] * 4)]))
    ((_, _, _, start), gen), *_ = stored_segments(table).items()
    old_slots, old_gens = np.arange(start, start + 4), np.full(4, gen)
    for ep in (2, 3):  # the ring turns: segment 1's slots now hold segment 3's steps
        table.insert_packed(pack([segment(ep, priorities=[0.25 * ep] * 4)]))
    assert (1, 0) not in step_priorities(table)
    before = np.asarray(table.sampler.priorities).copy()
    assert table.update_priorities(old_slots, old_gens, np.full(4, 100.0)) == 0
    np.testing.assert_array_equal(np.asarray(table.sampler.priorities), before)
    assert [step_priorities(table)[(3, i)] for i in range(4)] == [0.75] * 4


@pytest.fixture
def stub(tmp_path):
    running, port = create_server(ServerConfig(dir=str(tmp_path / "shard")))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    for config in (TableConfig.prioritized("p", 100, seed=0), TableConfig.uniform("u", 100)):
        stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(config)))
    yield stub, running
    channel.close()
    running.stop(grace=1)


def test_protobuf_built_segments_carry_priorities(stub):
    """Any protobuf client sends them: in a Segment (field 6) or in PackedSegments (field 8)."""
    stub, _ = stub
    obs = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    one = segment_proto(1, obs)
    one.priorities.extend([0.5, 1.5, 2.5, 3.5])
    packed_msg = pb.PackedSegments.FromString(
        wire.encode_packed(pack([segment(2, priorities=[4.0, 0.0, 1.0, 2.0])]))
    )
    packed_msg.sequences.append(2)
    request = pb.InsertRequest(writer_id="w", table="p", segments=[one], packed=[packed_msg])
    (ack,) = stub.Insert(iter([request]))
    assert list(ack.sequences) == [1, 2]
    (info,) = stub.Info(pb.InfoRequest(table="p")).tables
    assert info.mass == pytest.approx(sum(p**0.6 for p in [0.5, 1.5, 2.5, 3.5, 4.0, 1.0, 2.0]))

    for table, bad, named in [
        ("p", [1.0, -1.0, 1.0, 1.0], "priority of step 1 is -1.0"),
        ("p", [1.0, 1.0], "shape [4], received [2]"),
        ("u", [1.0] * 4, "table 'u' has a 'uniform' sampler, which keeps no priorities"),
    ]:
        seg = segment_proto(3, obs)
        seg.priorities.extend(bad)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Insert(iter([pb.InsertRequest(writer_id="x", table=table, segments=[seg])])))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named in e.value.details()
