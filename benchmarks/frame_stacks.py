"""Bytes on disk per stored transition of Atari frame stacks: TED, compact, frame-stacked.

Collects real frames from an ALE game with the standard preprocessing (``frameskip=1`` +
``AtariPreprocessing`` + ``FrameStackObservation(4)``: ``uint8[4, 84, 84]``, as
``deploy/configs/atari-*.yaml``), a random policy, ``P`` lanes and chunks of ``T`` steps (so
segments are cut at episode ends and every ``T`` steps, as actors cut them), and stores the
same transitions in two tables:

- **compact**: the plain segment layout, one stack per slot (``L + 1`` stacks per segment);
- **frame stacks**: ``frame_stacks: {observation: 4}``, one frame per slot plus the three
  older frames of each segment's first stack (``L + 4`` frames per segment).

It reports each table's bytes on disk per stored transition (every file: columns, prefixes,
slot pointers, records, checksums; blocks are reserved a 64th of the capacity ahead of use,
and the capacity is sized to the data), against TED's (a TorchRL buffer of the same
transitions: ``observation`` and ``("next", "observation")``, action, reward and the three
flags, uncompressed), and the time to sample a batch from each.

    python benchmarks/frame_stacks.py --out frame-stacks.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import collect_atari

TED_KEYS = [
    ("observation",),
    ("next", "observation"),
    ("action",),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
]


def ted_bytes_per_step(batch) -> int:
    row = batch.reshape(-1)[0]
    return sum(row[k].numel() * row[k].element_size() for k in TED_KEYS)


def sample_ms(table, batch_size: int, min_s: float) -> float:
    table.sample(batch_size)  # warm
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        table.sample(batch_size)
        n += 1
    return (time.perf_counter() - start) / n * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="ALE/Pong-v5")
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--chunk-len", type=int, default=32, help="as the atari configs")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per sampler")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)

    from millpond.config import TableConfig
    from millpond.service.table import Table
    from millpond.service.table_files import disk_usage

    torch.set_num_threads(1)
    batches = collect_atari(args.game, args.lanes, args.chunk_len, args.chunks, args.seed)
    steps = sum(b.numel() for b in batches)
    ted = ted_bytes_per_step(batches[0])
    # Segments end at episode ends and lane-chunk ends.
    max_segments = sum(int(b["next", "done"].sum()) + b.shape[0] for b in batches)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, stacks in (("compact", {}), ("frame stacks", {"observation": 4})):
            # Room for every step and a tail per segment, and no more: blocks are reserved a
            # 64th of the capacity ahead, which then stays small.
            capacity = steps + max_segments
            config = TableConfig.uniform("t", capacity, frame_stacks=stacks, seed=args.seed)
            table = Table.create(Path(tmp) / name.replace(" ", "-"), config)
            try:
                for batch in batches:
                    table.extend(batch)
                assert table.size == steps
                segments = len(table.storage.published_in(0, capacity))
                usage = disk_usage(table.path, table.spec)
                data = usage["observations"] + usage["step fields"]
                total = data + usage["slot pointers"] + usage["segment records"]
                ms = sample_ms(table, args.batch_size, args.seconds)
            finally:
                table.destroy()
            rows.append((name, segments, data / steps, total / steps, ms))

    lines = [
        f"{args.game}, {args.lanes} lanes x {args.chunks} chunks of {args.chunk_len} steps: "
        f"{steps} transitions, uint8[4, 84, 84] stacks; TED {ted} bytes per transition.",
        "",
        "| layout | segments | data B/transition | all files B/transition | vs TED "
        f"| sample {args.batch_size} (ms) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| TED (TorchRL buffer) | - | {ted} | {ted} | 1.000 | - |",
    ]
    for name, segments, data, total, ms in rows:
        lines.append(
            f"| {name} | {segments} | {data:.0f} | {total:.0f} | {total / ted:.3f} | {ms:.2f} |"
        )
    lines += [
        "",
        f"python {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, {platform.machine()}; one thread.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
