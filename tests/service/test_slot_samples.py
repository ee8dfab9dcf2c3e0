"""A sample sent in the slot layout (each distinct observation slot once, int32 rows to
rebuild ``obs`` and ``("next", obs)``) decodes to exactly what ``Table.sample`` returns on
the same table and seed, bit for bit, for every sampler, with and without zstd, for
CartPole-shaped, image-shaped and nested (dict) observations; and the older form
(``next_rows``) still decodes to the same batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.errors import InvalidDataError
from millpond.protos import millpond_pb2 as pb
from millpond.protos import samples, wire
from millpond.service.servicer import ReplayServicer
from millpond.service.shard import Shard
from millpond.service.weights import WeightStore

SHAPES = {
    "cartpole": {("observation",): ((4,), torch.float32)},
    "image": {("pixels",): ((4, 84, 84), torch.uint8)},
    "nested": {
        ("observation", "pixels"): ((3, 8, 8), torch.uint8),
        ("observation", "state"): ((5,), torch.float64),
    },
}


def _segment(rng: np.random.Generator, shape: str, ep: int, n: int, end: str):
    def obs(rows: int) -> dict:
        out: dict = {}
        for key, (feature, dtype) in SHAPES[shape].items():
            if dtype == torch.uint8:
                value = torch.from_numpy(rng.integers(0, 256, (rows, *feature), dtype=np.uint8))
            else:
                value = torch.from_numpy(rng.standard_normal((rows, *feature))).to(dtype)
                value.view(-1)[:1] = -0.0  # signs and NaN payloads must survive too
            d = out
            for part in key[:-1]:
                d = d.setdefault(part, {})
            d[key[-1]] = value
        return out

    term = torch.zeros(n, 1, dtype=torch.bool)
    trunc = term.clone()
    (term if end == "terminated" else trunc)[-1] = end != "cut"
    every = obs(n + 1)
    steps = TensorDict(
        {
            **_rows(every, slice(0, n)),
            "action": torch.from_numpy(rng.integers(0, 2, n)),
            "next": {
                "reward": torch.from_numpy(rng.standard_normal((n, 1))).float(),
                "terminated": term,
                "truncated": trunc,
            },
        },
        [n],
    )
    tail = TensorDict(_rows(every, n), [])
    return steps, tail, ep


def _rows(d: dict, index) -> dict:
    return {k: _rows(v, index) if isinstance(v, dict) else v[index] for k, v in d.items()}


def _config(kind: str, compression: str) -> TableConfig:
    if kind == "uniform":
        cfg = TableConfig.uniform("t", 600, seed=3)
    elif kind == "prioritized":
        cfg = TableConfig.prioritized("t", 600, alpha=0.7, beta=0.5, seed=3)
    elif kind == "queue":
        cfg = TableConfig.queue("t", 600, seed=3)
    elif kind == "slices":
        cfg = TableConfig.slices("t", 600, 4, seed=3)
    else:
        cfg = TableConfig.slices("t", 600, 4, seed=3, strict_length=False)
    return dataclasses.replace(cfg, compression=compression) if compression else cfg


class _Context:
    def is_active(self) -> bool:
        return True


def _fill(shard: Shard, config: TableConfig, shape: str) -> None:
    table = shard.create_table(config)
    rng = np.random.default_rng(7)
    ends = ["terminated", "truncated", "cut"]
    # more than the capacity, so that the ring wraps and evicts
    for ep in range(40):
        n = int(rng.integers(1, 20))
        steps, tail, ep = _segment(rng, shape, ep, n, ends[ep % 3])
        table.insert(steps, tail, ep, timeout=10)


def _wire(servicer: ReplayServicer, batch_size: int) -> pb.SampleResponse:
    request = pb.SampleRequest(table="t", batch_size=batch_size, num_batches=1)
    (response,) = list(servicer.Sample(request, _Context()))
    # the slot layout is framed by hand (bytes); the older form is a message
    raw = response if isinstance(response, bytes) else response.SerializeToString()
    return pb.SampleResponse.FromString(raw)


def _assert_same(actual: TensorDict, expected: TensorDict) -> None:
    a = dict(actual.items(include_nested=True, leaves_only=True))
    e = dict(expected.items(include_nested=True, leaves_only=True))
    assert set(a) == set(e)
    for key, want in e.items():
        got = a[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("compression", ["", "zstd"], ids=["raw", "zstd"])
@pytest.mark.parametrize("kind", ["uniform", "prioritized", "queue", "slices", "slices-short"])
def test_wire_sample_equals_table_sample(tmp_path, kind: str, compression: str, shape: str):
    config = _config(kind, compression)
    shards = [Shard(tmp_path / name) for name in ("local", "slots", "rows")]
    try:
        for shard in shards:
            _fill(shard, config, shape)
        local = shards[0].table("t")
        slots = ReplayServicer(shards[1], WeightStore(tmp_path / "w1"))
        slots.framed_samples = True  # as a served shard answers: bytes framed by hand
        rows = ReplayServicer(shards[2], WeightStore(tmp_path / "w2"), slot_samples=False)
        batch_size = 16 if kind.startswith("slices") else 48
        for _ in range(4):
            expected = local.sample(batch_size, timeout=5)
            new = _wire(slots, batch_size)
            old = _wire(rows, batch_size)
            assert new.HasField("slot_observations") and not new.next_rows
            assert not old.HasField("slot_observations")
            _assert_same(samples.decode_sample(new), expected)
            # as the client reads it: observations as views of the bytes
            view = wire.parse_sample_response(new.SerializeToString())
            _assert_same(samples.decode_sample(view), expected)
            _assert_same(samples.decode_sample(old), expected)
            if kind.startswith("slices"):
                # consecutive steps share their slots: fewer observations than 2 per step
                assert new.slot_observations.observations.batch_size[0] < 2 * expected.numel()
    finally:
        for shard in shards:
            shard.close()


def test_rows_outside_the_observations_are_refused(tmp_path):
    shard = Shard(tmp_path / "s")
    try:
        _fill(shard, _config("uniform", ""), "cartpole")
        response = _wire(ReplayServicer(shard, WeightStore(tmp_path / "w")), 8)
    finally:
        shard.close()
    bad = pb.SampleResponse.FromString(response.SerializeToString())
    bad.slot_observations.observations.batch_size[0] = 1
    with pytest.raises(InvalidDataError, match="rows"):
        samples.decode_sample(bad)
    bad = pb.SampleResponse.FromString(response.SerializeToString())
    bad.slot_observations.rows.dtype = "int64"
    with pytest.raises(InvalidDataError):
        samples.decode_sample(bad)
