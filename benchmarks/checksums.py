"""What per-segment checksums cost: inserts, verified samples, reopening.

For CartPole-shaped steps (float32[4] observations, 30-byte rows with action, reward and
flags) and Atari-shaped ones (uint8[4, 84, 84]), in one run:

* the checksum of one segment's observations: ``zlib.crc32`` against
  :func:`millpond.service.checksums.range_value` (the CRC for short ranges, a word-weighted
  sum for long ones);
* inserts into a full ring (the steady state), with checksums and with the checksum
  function replaced by a stub that returns zeros, alternating, median of the repetitions;
* ``table.sample(256)`` alone and followed by ``storage.verify`` of the sampled slots;
* ``Table.open`` of the full table (recovery verifies every segment) against the same open
  with the stub.

Usage: ``python benchmarks/checksums.py [--reps 5] [--segment-len 32]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.segments import Segment, pack
from millpond.service import checksums as cks
from millpond.service.table import Table

SHAPES = {"cartpole": ((4,), torch.float32), "atari": ((4, 84, 84), torch.uint8)}


def segments(shape, dtype, n_segments: int, length: int, first_ep: int) -> list[Segment]:
    out = []
    g = torch.Generator().manual_seed(first_ep)
    for ep in range(first_ep, first_ep + n_segments):
        if dtype.is_floating_point:
            obs = torch.randn(length + 1, *shape, generator=g, dtype=dtype)
        else:
            obs = torch.randint(0, 256, (length + 1, *shape), generator=g, dtype=dtype)
        last = torch.zeros(length, 1, dtype=torch.bool)
        last[-1] = True
        td = TensorDict(
            {
                "observation": obs[:-1],
                "action": torch.zeros(length, dtype=torch.int64),
                "next": {
                    "reward": torch.ones(length, 1),
                    "terminated": last,
                    "truncated": torch.zeros(length, 1, dtype=torch.bool),
                },
            },
            [length],
        )
        out.append(Segment(td, TensorDict({"observation": obs[-1]}, []), ep, 0))
    return out


def timed(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def no_checksums(columns, starts, lengths):
    return np.zeros(len(starts), dtype=np.uint64)


def measure(name: str, shape, dtype, L: int, reps: int) -> None:
    real = cks.data_sums
    row = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    seg_bytes = (L + 1) * row
    data = np.random.default_rng(0).integers(0, 256, seg_bytes, dtype=np.uint8)
    t_crc = timed(lambda: zlib.crc32(data), 200)
    t_value = timed(lambda: cks.range_value(data), 200)
    print(
        f"{name}: one segment of {L} steps ({seg_bytes} observation bytes): zlib.crc32 "
        f"{t_crc * 1e6:.1f} us, checksums.range_value {t_value * 1e6:.1f} us "
        f"({'CRC-32' if seg_bytes < cks.WIDE_BYTES else 'word-weighted sum'})"
    )

    steps_per_call, n_calls = 8 * L, 16 if name == "atari" else 128
    capacity = n_calls * 8 * (L + 1)  # one pass fills the ring exactly
    calls = [pack(segments(shape, dtype, 8, L, 1 + 8 * i)) for i in range(n_calls)]
    with tempfile.TemporaryDirectory() as tmp:
        table = Table.create(Path(tmp) / "t", TableConfig.uniform("t", capacity, seed=0))

        def one_pass():
            for packed in calls:
                table.insert_packed(packed)

        one_pass()  # fills the ring: later passes overwrite (the steady state)
        with_cks, without = [], []
        for _ in range(reps):
            with_cks.append(timed(one_pass, 1))
            cks.data_sums = no_checksums
            try:
                without.append(timed(one_pass, 1))
            finally:
                cks.data_sums = real
        one_pass()  # real checksums again, for the samples and the reopening below
        steps = n_calls * steps_per_call
        a, b = statistics.median(with_cks), statistics.median(without)
        print(
            f"{name}: insert (8 segments of {L} steps per call, full ring of {capacity} "
            f"slots): {steps / a:,.0f} steps/s with checksums, {steps / b:,.0f} without: "
            f"{a / b:.3f}x the time"
        )

        def sample_verified():
            batch = table.sample(256)
            assert table.storage.verify(batch["index", "slot"].numpy()).all()

        t_s = timed(lambda: table.sample(256), 20 * reps)
        t_v = timed(sample_verified, 20 * reps)
        print(
            f"{name}: sample(256) {t_s * 1e3:.2f} ms, with verify of the sampled "
            f"segments {t_v * 1e3:.2f} ms: {t_v / t_s:.2f}x"
        )
        table.close()

        def reopen():
            Table.open(Path(tmp) / "t").close()

        t_open = timed(reopen, reps)
        cks.data_sums = no_checksums
        try:
            # The stub's zeros do not match: every segment is dropped, but after the same
            # work less the checksums; the table is not reused after this.
            t_open_stub = timed(reopen, 1)
        finally:
            cks.data_sums = real
        print(
            f"{name}: Table.open of {n_calls * 8} segments ({capacity} slots): "
            f"{t_open * 1e3:.1f} ms verifying checksums, {t_open_stub * 1e3:.1f} ms without "
            "computing them"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--segment-len", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the stubbed reopening drops every segment, loudly
    for name, (shape, dtype) in SHAPES.items():
        measure(name, shape, dtype, args.segment_len, args.reps)


if __name__ == "__main__":
    main()
