"""Seeded fuzzing of every RPC's request against a real server whose tables hold data.

Each RPC gets requests whose fields take extreme integers, long and odd strings, and tensor
protos of any dtype name, shape, data length and compression flag (some of them valid
segments with one field spoiled). Whatever the request, the answer must be a deliberate
status: never INTERNAL or UNKNOWN; and the server must still answer health checks and Info
afterwards. Derandomized (the same examples every run) and bounded to about a minute.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch
import zstandard
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from millpond import TableConfig
from millpond.config import MAX_TIMEOUT_MS
from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb
from millpond.protos import millpond_pb2_grpc as pb_grpc
from millpond.protos.tables import config_to_proto
from millpond.service.server import ServerConfig, create_server
from tests.service._wire import segment_proto as wire_segment
from tests.service._wire import steps_td

BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
TABLES = ("u", "p", "s", "q")

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def segment_obs(n: int, first: int = 0, obs_dim: int = 3) -> torch.Tensor:
    """``n + 1`` observation rows (steps and tail) counting from ``first``."""
    return torch.arange(first, first + n + 1, dtype=torch.float32)[:, None].expand(n + 1, obs_dim)


def segment_td(n: int, first: int = 0, obs_dim: int = 3) -> tuple[TensorDict, TensorDict]:
    obs = segment_obs(n, first, obs_dim).clone()
    steps = steps_td(obs[:-1], torch.arange(n, dtype=torch.int64))
    return steps, TensorDict({"observation": obs[-1]}, [])


def segment_proto(seq: int, n: int = 4, episode: int = 1, first: int = 0) -> pb.Segment:
    obs = segment_obs(n, first).clone()
    return wire_segment(
        seq, obs, episode=episode, first_step=first, actions=torch.arange(n, dtype=torch.int64)
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    running, port = create_server(ServerConfig(dir=str(base / "shard"), max_message_mb=8))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ReplayStub(channel)
    configs = [
        TableConfig.uniform("u", 500, seed=1),
        TableConfig.prioritized("p", 500, seed=2),
        TableConfig.slices("s", 500, 3, seed=3),
        TableConfig.queue("q", 5000, seed=4),
        TableConfig.uniform("r", 100, compression="zstd"),  # the one Reset may empty
    ]
    for config in configs:
        stub.CreateTable(pb.CreateTableRequest(config=config_to_proto(config)))
        segments = [
            segment_proto(i + 1, n=3 + i % 4, episode=i // 2, first=i % 2 * 10) for i in range(12)
        ]
        request = pb.InsertRequest(writer_id="seed", table=config.name, segments=segments)
        list(stub.Insert(iter([request])))
    yield stub, channel
    channel.close()
    running.stop(grace=1)


def answered(call) -> None:
    """Run ``call``; any status is fine but INTERNAL and UNKNOWN."""
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() not in BROKEN, (error.code(), error.details())


def still_serving(stub, channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    names = {t.config.name for t in stub.Info(pb.InfoRequest(), timeout=10).tables}
    assert set(TABLES) <= names


# -- strategies -----------------------------------------------------------------------------------
EXTREMES = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63), -(2**31)]
i64 = st.one_of(st.integers(-3, 40), st.sampled_from(EXTREMES), st.integers(-(2**63), 2**63 - 1))
u64 = st.one_of(st.integers(0, 40), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
small_i64 = st.one_of(st.integers(-3, 12), st.sampled_from(EXTREMES))
# waits: short ones (an example must not sit out a long one), and the absurd
timeouts = st.one_of(
    st.integers(-3, 150), st.sampled_from([MAX_TIMEOUT_MS + 1, 2**62, 2**63 - 1, -(2**63)])
)
tables = st.sampled_from(TABLES)
names = st.one_of(
    tables,
    tables,
    tables,
    st.sampled_from(["", "r", "nope", ".", "..", "a/b", "a\x00b"]),
    st.text(max_size=20),
    st.text(alphabet="aé", min_size=200, max_size=300),
)
_VALID_KEYS = [["observation"], ["action"], ["next", "reward"], ["pixels"], ["a", "b"]]
keys = st.one_of(
    st.sampled_from(_VALID_KEYS),
    st.sampled_from(_VALID_KEYS),
    st.lists(st.from_regex(r"[a-z_\-]{1,8}", fullmatch=True), min_size=1, max_size=3),
    st.sampled_from(
        [
            ["observation"],
            ["action"],
            ["next", "reward"],
            ["next", "terminated"],
            ["next", "truncated"],
            ["next", "done"],
            ["next", "observation"],
            ["index"],
            ["collector", "mask"],
            [],
            [""],
        ]
    ),
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.just("k"), min_size=30, max_size=40),
    st.just(["x" * 300]),
)
dtypes = st.one_of(
    st.sampled_from(["float32", "float64", "uint8", "int64", "bool", "bfloat16", "complex128"]),
    st.sampled_from(["float32", "", "int128", "f4", "torch.float32", "float32\x00"]),
)
dims = st.one_of(st.integers(0, 5), st.sampled_from([-1, 2**20, 2**31, 2**62, 2**63 - 1]))
shapes = st.lists(dims, max_size=4)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -1.0, 1e308, -1e308, math.nan, math.inf]),
)
_ITEMSIZE = {"float32": 4, "float64": 8, "uint8": 1, "int64": 8, "bool": 1, "bfloat16": 2}
_ITEMSIZE["complex128"] = 16


@st.composite
def tensors(draw) -> pb.Tensor:
    key, dtype, shape = draw(keys), draw(dtypes), draw(shapes)
    compression = draw(st.sampled_from([0, 0, 1, 1, 2, 9]))
    size = _ITEMSIZE.get(dtype, 4) * math.prod(max(d, 0) for d in shape)
    kind = draw(st.sampled_from(["exact", "random", "bomb", "off-by-one"]))
    if kind == "exact" and size <= 4096:
        data = draw(st.binary(min_size=size, max_size=size))
    elif kind == "off-by-one" and size <= 4096:
        data = bytes(size + draw(st.sampled_from([-1, 1])) if size else 1)
    elif kind == "bomb":  # a small zstd frame that inflates to 64 MiB of zeros
        data = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
        compression = 1
    else:
        data = draw(st.binary(max_size=64))
    if compression == 1 and kind != "bomb" and draw(st.booleans()):
        data = zstandard.ZstdCompressor(level=1).compress(data)
    return pb.Tensor(key=key, dtype=dtype, shape=shape, data=data, compression=compression)


@st.composite
def tensor_maps(draw) -> pb.TensorMap:
    return pb.TensorMap(
        batch_size=draw(st.lists(small_i64, max_size=3)),
        tensors=draw(st.lists(tensors(), max_size=5)),
    )


@st.composite
def segments(draw) -> pb.Segment:
    """A valid segment with something spoiled, or one of random parts."""
    n = draw(st.integers(1, 5))
    msg = segment_proto(draw(u64), n=n, episode=draw(i64), first=0)
    msg.first_step = draw(st.one_of(st.integers(0, 100), i64))
    spoil = draw(st.sampled_from(["none", "extra", "replace", "steps", "tail", "batch"]))
    if spoil == "extra":
        msg.steps.tensors.append(draw(tensors()))
    elif spoil == "replace":
        i = draw(st.integers(0, len(msg.steps.tensors) - 1))
        t = draw(tensors())
        t.key[:] = msg.steps.tensors[i].key
        msg.steps.tensors[i].CopyFrom(t)
    elif spoil == "steps":
        msg.steps.CopyFrom(draw(tensor_maps()))
    elif spoil == "tail":
        msg.tail.CopyFrom(draw(tensor_maps()))
    elif spoil == "batch":
        msg.steps.batch_size[:] = draw(st.lists(small_i64, max_size=3))
    return msg


@st.composite
def packed_segments(draw) -> pb.PackedSegments:
    k = draw(st.integers(1, 3))
    n = draw(st.integers(1, 4))
    steps, tail = segment_td(n)
    flat = {
        key if isinstance(key, tuple) else (key,): v.repeat(k, *([1] * (v.dim() - 1)))
        for key, v in steps.items(include_nested=True, leaves_only=True)
    }
    msg = pb.PackedSegments(
        sequences=draw(st.one_of(st.just([]), st.lists(u64, min_size=k, max_size=k))),
        episode_ids=draw(st.lists(i64, min_size=k, max_size=k)),
        first_steps=draw(st.lists(st.one_of(st.integers(0, 50), i64), min_size=k, max_size=k)),
        lengths=draw(st.one_of(st.just([n] * k), st.lists(small_i64, max_size=4))),
        steps=codec.to_tensor_map(flat, batch_size=[k * n]),
        tails=codec.to_tensor_map({("observation",): tail["observation"].repeat(k, 1)}, [k]),
    )
    if draw(st.booleans()):
        msg.steps.tensors.append(draw(tensors()))
    if draw(st.booleans()):
        msg.tails.CopyFrom(draw(tensor_maps()))
    return msg


@st.composite
def insert_requests(draw) -> list[pb.InsertRequest]:
    requests = []
    for i in range(draw(st.integers(1, 2))):
        requests.append(
            pb.InsertRequest(
                writer_id=draw(st.one_of(st.just("fuzz"), st.text(max_size=300))),
                table=draw(names) if i == 0 or draw(st.booleans()) else "",
                segments=draw(st.lists(segments(), max_size=2)),
                packed=draw(st.lists(packed_segments(), max_size=2)),
                timeout_ms=draw(timeouts),
            )
        )
    return requests


@st.composite
def field_specs(draw) -> list[pb.FieldSpec]:
    """A valid spec (an observation and an action) with a field or two spoiled, or none."""
    fields = [
        pb.FieldSpec(key=["observation"], dtype="float32", shape=[3], role="observation"),
        pb.FieldSpec(key=["action"], dtype="int64", shape=[], role="step"),
    ]
    for _ in range(draw(st.integers(0, 2))):
        f = fields[draw(st.integers(0, 1))]
        part = draw(st.sampled_from(["key", "dtype", "shape", "role", "add"]))
        if part == "key":
            f.key[:] = draw(keys)
        elif part == "dtype":
            f.dtype = draw(dtypes)
        elif part == "shape":
            f.shape[:] = draw(shapes)
        elif part == "role":
            f.role = draw(st.sampled_from(["observation", "step", "", "other"]))
        else:
            role = draw(st.sampled_from(["observation", "step"]))
            fields.append(
                pb.FieldSpec(key=draw(keys), dtype=draw(dtypes), shape=draw(shapes), role=role)
            )
    return draw(st.sampled_from([[], fields, fields]))


#: Wild values for each field of a TableConfig.
_WILD = {
    "name": names,
    "capacity": i64,
    "sampler": st.sampled_from(["", "uniform", "prioritized", "queue", "slices", "lifo"]),
    "min_size": i64,
    "alpha": floats,
    "beta": floats,
    "slice_len": i64,
    "compression": st.sampled_from(["", "zstd", "lz4", "ZSTD"]),
    "samples_per_insert": floats,
    "error_buffer": floats,
    "seed": i64,
    "strict_length": st.booleans(),
}


@st.composite
def table_configs(draw) -> pb.TableConfig:
    """A valid config with one to three fields set to wild values."""
    sampler = draw(st.sampled_from(["uniform", "prioritized", "queue", "slices"]))
    msg = pb.TableConfig(
        name=draw(st.from_regex(r"[a-z][a-z0-9_\-]{0,12}", fullmatch=True)),
        # valid capacities stay small: the test must not build a real multi-GiB table
        capacity=draw(st.integers(10, 5000)),
        sampler=sampler,
        min_size=draw(st.integers(0, 10)),
        alpha=0.6,
        beta=0.4,
        slice_len=draw(st.integers(1, 5)) if sampler == "slices" else 0,
        compression=draw(st.sampled_from(["", "zstd"])),
        spec=draw(field_specs()),
    )
    for field in draw(st.lists(st.sampled_from(sorted(_WILD)), min_size=1, max_size=3)):
        value = draw(_WILD[field])
        if field == "capacity" and 5000 < value <= 2**31 - 1:
            value = 5000  # a real table of that many slots is no request's fault
        setattr(msg, field, value)
    return msg


# -- the RPCs --------------------------------------------------------------------------------
@settings(FUZZ, max_examples=300)
@given(request=st.builds(pb.CreateTableRequest, config=table_configs(), exist_ok=st.booleans()))
def test_create_table(served, request):
    stub, _ = served
    answered(lambda: stub.CreateTable(request, timeout=10))


@settings(FUZZ, max_examples=300)
@given(requests=insert_requests())
def test_insert(served, requests):
    stub, _ = served
    answered(lambda: list(stub.Insert(iter(requests), timeout=5)))


def _sample(stub, request) -> None:
    call = stub.Sample(request, timeout=2)
    for i, _ in enumerate(call):
        if i >= 1:
            call.cancel()
            break


@settings(FUZZ, max_examples=150)
@given(
    request=st.builds(
        pb.SampleRequest,
        table=names,
        batch_size=st.one_of(st.integers(-2, 600), i64),
        num_batches=st.one_of(st.integers(-2, 3), st.sampled_from(EXTREMES)),
        timeout_ms=timeouts,
    )
)
def test_sample(served, request):
    stub, _ = served
    try:
        _sample(stub, request)
    except grpc.RpcError as error:
        # a wait the client gave up on is its own deadline, not the server's failure
        assert error.code() not in BROKEN, (error.code(), error.details())


@FUZZ
@given(
    request=st.builds(
        pb.UpdatePrioritiesRequest,
        table=names,
        slots=st.lists(st.one_of(st.integers(0, 600), i64), max_size=6),
        generations=st.lists(st.one_of(st.integers(0, 30), i64), max_size=6),
        priorities=st.lists(floats, max_size=6),
    )
)
def test_update_priorities(served, request):
    stub, _ = served
    answered(lambda: stub.UpdatePriorities(request, timeout=10))


@settings(FUZZ, max_examples=20)
@given(request=st.builds(pb.InfoRequest, table=names))
def test_info(served, request):
    stub, _ = served
    answered(lambda: stub.Info(request, timeout=10))


@settings(FUZZ, max_examples=3)
@given(request=st.just(pb.CheckpointRequest()))
def test_checkpoint(served, request):
    stub, _ = served
    answered(lambda: stub.Checkpoint(request, timeout=30))


@settings(FUZZ, max_examples=20)
@given(
    request=st.builds(
        pb.ResetRequest, table=st.one_of(st.just("r"), names.filter(lambda n: n not in TABLES))
    )
)
def test_reset(served, request):
    stub, _ = served
    answered(lambda: stub.Reset(request, timeout=10))


@FUZZ
@given(
    requests=st.lists(
        st.builds(
            pb.PublishWeightsRequest,
            version=st.one_of(st.integers(-2, 50), i64),
            total_size=st.one_of(st.integers(-2, 64), i64),
            chunk=st.binary(max_size=64),
        ),
        max_size=3,
    )
)
def test_publish_weights(served, requests):
    stub, _ = served
    answered(lambda: stub.PublishWeights(iter(requests), timeout=10))


@FUZZ
@given(
    request=st.builds(
        pb.PublishWeightsRequest,
        version=st.one_of(st.integers(-2, 50), i64),
        total_size=st.one_of(st.integers(-2, 64), i64),
        chunk=st.binary(max_size=64),
    )
)
def test_publish_weights_at_once(served, request):
    stub, _ = served
    answered(lambda: stub.PublishWeightsAtOnce(request, timeout=10))


@FUZZ
@given(
    request=st.builds(
        pb.GetWeightsRequest, min_version=st.one_of(st.integers(-2, 50), i64), timeout_ms=timeouts
    )
)
def test_get_weights(served, request):
    stub, _ = served
    answered(lambda: list(stub.GetWeights(request, timeout=5)))


def test_still_serving_after_the_fuzz(served):
    stub, channel = served
    still_serving(stub, channel)
    for table in TABLES:  # the tables that held data still sample (the queue may be drained)
        if table != "q":
            _sample(stub, pb.SampleRequest(table=table, batch_size=2, num_batches=1))
