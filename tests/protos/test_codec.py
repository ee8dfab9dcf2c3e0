"""The tensor codec: every supported dtype and memory layout survives a round trip bit for bit."""

import pytest
import torch

from millpond import InvalidDataError
from millpond.protos import millpond_pb2 as pb
from millpond.protos.codec import from_tensor_map, proto_to_tensor, tensor_to_proto, to_tensor_map
from millpond.spec import _DTYPES


def sample_of(dtype: torch.dtype, shape=(5, 3)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    wide = torch.cat([t, t.flip(0)], 1)
    return {
        "contiguous": t,
        "transposed": t.t(),
        "column slice": wide[:, 1:4],
        "row step": wide[::2],
        "expanded": t[:1].expand(4, -1),
        "empty": t[:0],
        "scalar": t[0, 0],
        # lazy views torch resolves only when asked to
        "negated": ~t if t.dtype == torch.bool else torch._neg_view(t),
        "conjugated": t.conj(),
    }


@pytest.mark.parametrize("dtype", sorted(_DTYPES.values(), key=str), ids=str)
def test_every_dtype_and_layout_round_trips_bit_for_bit(dtype):
    for layout, t in layouts(sample_of(dtype)).items():
        msg = tensor_to_proto(("next", "observation"), t, compress=layout == "row step")
        key, back = proto_to_tensor(pb.Tensor.FromString(msg.SerializeToString()))
        assert key == ("next", "observation")
        assert back.dtype == dtype and back.shape == t.shape, layout
        # Bits, not values: NaN payloads and signed zeros must come back as they went.
        expected = t.resolve_conj().resolve_neg().contiguous()
        assert torch.equal(bits(back), bits(expected)), layout


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_tensors_that_need_grad_are_sent_detached():
    t = torch.randn(4, 2, requires_grad=True) * 2
    _, back = proto_to_tensor(tensor_to_proto(("value",), t))
    assert not back.requires_grad and torch.equal(back, t.detach())


def test_tensor_map_keeps_nesting_and_batch_size():
    td = {
        ("observation", "pixels"): torch.randint(0, 255, (3, 4, 8, 8), dtype=torch.uint8),
        ("observation", "state"): torch.randn(3, 8).t().contiguous().t(),
        ("next", "reward"): torch.randn(3, 1),
    }
    back = from_tensor_map(to_tensor_map(td, batch_size=[3]))
    assert back.batch_size == torch.Size([3])
    for key, value in td.items():
        assert torch.equal(back[key], value)


def test_a_byte_count_that_does_not_match_the_shape_names_the_tensor():
    msg = tensor_to_proto(("action",), torch.zeros(4, dtype=torch.int64))
    msg.data = msg.data[:-1]
    with pytest.raises(InvalidDataError, match=r"'action': 31 bytes for int64\[4\], expected 32"):
        proto_to_tensor(msg)


_THREADED_ROUND_TRIPS = """
import threading, torch
from millpond.protos.codec import proto_to_tensor, tensor_to_proto

failures = []

def work(seed):
    g = torch.Generator().manual_seed(seed)
    for i in range(150):
        # Frames that compress (a few distinct values), different in every thread and call.
        t = torch.randint(0, 4, (4, 84, 84), generator=g, dtype=torch.uint8)
        try:
            _, back = proto_to_tensor(tensor_to_proto(("observation",), t, compress=True))
        except Exception as e:
            failures.append((seed, i, repr(e)))
            return
        if not torch.equal(back, t):
            failures.append((seed, i, "differs"))

threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
for th in threads:
    th.start()
for th in threads:
    th.join()
assert not failures, failures
"""


def test_zstd_round_trips_from_many_threads_at_once():
    """A shard compresses and decompresses on every serving thread at once; zstd contexts
    shared between threads corrupted data or crashed the process. Run apart, so that a
    crash fails this test rather than the whole run."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _THREADED_ROUND_TRIPS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
