"""How full and how FIFO a ring stays with and without writers' regions.

A writer with an id (every env actor's) may get *regions* for its short segments
(``millpond.service.regions``): runs of slots set aside for one lane, so that a segment
continuing its predecessor starts on that one's tail slot. A region is filled over several
inserts, so the steps in it are stored out of the ring's order. This measures, on one table
per case, inserting as an env actor of ``lanes`` lanes does (each lane's chunk of
``chunk_len`` steps cut at its episode ends, episode lengths uniform in ``[lo, hi]``):

* ``fill``: steps stored over slots of the ring, averaged over 24 snapshots after the ring
  wrapped ``--passes`` times;
* ``out of order``: of the steps stored, the share a FIFO ring holding as many steps would
  have evicted already (it holds exactly the newest ones);
* ``oldest``: the oldest stored step's age, in steps inserted since, over the steps stored
  (1.0 in a FIFO).

Each case runs twice: ``plain`` (inserts without a writer id: every segment laid end to end
with its tail, never in a region) and ``writer`` (with an id, as an actor inserts). Run
``python benchmarks/ring_order.py`` (a few minutes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from millpond.config import TableConfig
from millpond.service.table import Table
from millpond.testing import actor_chunks, ring_ages

#: (name, lanes, chunk_len, capacity, episode lengths lo..hi)
CASES = [
    ("cartpole-dqn, early episodes", 16, 16, 11_000, (10, 40)),
    ("cartpole-dqn, late episodes", 16, 16, 11_000, (200, 500)),
    ("cartpole-rainbow", 4, 16, 11_000, (10, 200)),
    ("atari-dqn shape", 4, 32, 50_000, (400, 2000)),
    ("per-step actor (chunk_len 1)", 8, 1, 65_536, (20, 200)),
]


def _measure(case, writer_id: str | None, root: Path, passes: int) -> dict[str, float]:
    _, lanes, chunk_len, capacity, lengths = case
    table = Table.create(root, TableConfig.uniform("t", capacity, seed=0))
    inserted: dict[tuple[int, int], int] = {}
    total = 0
    fills, late, oldest = [], [], []
    every = max(1, capacity // (lanes * chunk_len) // 4)
    try:
        for k, batch in enumerate(actor_chunks(lanes, chunk_len, lengths)):
            for s in batch:
                inserted[(s.episode_id, s.first_step)] = total
                total += len(s.steps)
                if writer_id is None:
                    s.sequence = None
            table.insert_many(batch, writer_id=writer_id)
            if total < capacity * passes or k % every:
                continue
            ages = ring_ages(table, inserted, total)
            fills.append(len(ages) / capacity)
            late.append(float(np.mean(ages >= len(ages))))
            oldest.append(float(ages.max() + 1) / len(ages))
            if len(fills) == 24:
                break
    finally:
        table.close()
    return {"fill": np.mean(fills), "late": np.mean(late), "oldest": np.max(oldest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=3, help="passes of the ring before measuring")
    args = parser.parse_args()
    print("| case | lanes x chunk_len, ring | fill: plain / writer | out of order | oldest |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(CASES):
            name, lanes, chunk_len, capacity, (lo, hi) = case
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            plain = _measure(case, None, Path(tmp) / f"{n}-plain", args.passes)
            writer = _measure(case, "actor-0", Path(tmp) / f"{n}-writer", args.passes)
            print(
                f"| {name} (episodes {lo}-{hi}) | {lanes} x {chunk_len}, {capacity:,} "
                f"| {plain['fill']:.1%} / {writer['fill']:.1%} "
                f"| {plain['late']:.1%} / {writer['late']:.1%} "
                f"| {plain['oldest']:.2f} / {writer['oldest']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
