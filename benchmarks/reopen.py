"""How long a restarted shard takes to serve, against its table's size.

Builds tables of stacked-Atari-shaped steps (``uint8[4, 84, 84]`` observations declared
``frame_stacks: {observation: 4}``, so one 7,056-byte frame per step on disk; 32-step
segments, as the Atari configs cut them) of each size in ``--sizes-gb``, then restarts a
shard on each, in a fresh process per measurement, and reports

* **open**: ``create_server`` on the shard directory, until it returns (the tables open);
* **first sample**: until a ``ReplayClient`` (over loopback, not colocated) has its first
  ``sample(256)`` answered, counted from the same start;
* **verified**: until the table has no segment left unverified (the background verifier);
  with code that verifies at open, the open itself.

Each is measured cold (the page cache dropped first: ``echo 3 > /proc/sys/vm/drop_caches``,
which needs root; otherwise the run says warm only) and warm (right after), and for each
millpond source tree in ``--code`` (``NAME=PATH``, imported through ``PYTHONPATH``), so that
the code before a change and after it run side by side on the same tables.

    python benchmarks/reopen.py --sizes-gb 0.1,0.5,2 --code before=/path/old --code after=.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FRAME = (84, 84)
K = 4
SEGMENT = 32
STEP_BYTES = FRAME[0] * FRAME[1]  # one frame per step on disk


def build(shard: Path, size_gb: float) -> int:
    """A shard with table ``t`` of about ``size_gb`` GB of steps; returns its steps."""
    import torch
    from tensordict import TensorDict

    from millpond.config import TableConfig
    from millpond.segments import Segment
    from millpond.service.table import Table

    steps = int(size_gb * 1e9 / STEP_BYTES) // SEGMENT * SEGMENT
    n_segments = steps // SEGMENT
    config = TableConfig.uniform(
        "t", steps + n_segments + 1, seed=0, frame_stacks={"observation": K}
    )
    table = Table.create(shard / "tables" / "t", config)
    pool = torch.randint(0, 256, (4099, *FRAME), dtype=torch.uint8, generator=torch.Generator())
    windows = pool.unfold(0, K, 1).permute(0, 3, 1, 2)  # [n, K, 84, 84]: overlapping stacks
    flags = torch.zeros(SEGMENT, 1, dtype=torch.bool)
    for i in range(0, n_segments, 8):
        batch = []
        for s in range(i, min(i + 8, n_segments)):
            at = (s * 37) % (len(windows) - SEGMENT - 1)
            obs = windows[at : at + SEGMENT + 1]
            td = TensorDict(
                {
                    "observation": obs[:-1],
                    "action": torch.zeros(SEGMENT, dtype=torch.int64),
                    "next": {"reward": torch.ones(SEGMENT, 1), "terminated": flags,
                             "truncated": flags},
                },
                [SEGMENT],
            )  # fmt: skip
            batch.append(Segment(td, TensorDict({"observation": obs[-1]}, []), s, 0))
        table.insert_many(batch)
    table.close()
    return steps


def child(shard: str, verify: str) -> None:
    """One restart: prints the timings as JSON (run with the code under test importable)."""
    import millpond
    from millpond import ReplayClient
    from millpond.service.server import ServerConfig, create_server

    fields = ServerConfig.__dataclass_fields__
    t0 = time.perf_counter()
    extra = {"verify": verify} if "verify" in fields else {}
    server, port = create_server(ServerConfig(dir=shard, **extra))
    t_open = time.perf_counter() - t0
    client = ReplayClient([f"127.0.0.1:{port}"], colocated=False)
    batch = client.sample("t", 256)
    t_sample = time.perf_counter() - t0
    assert batch.shape[0] == 256
    table = server.shard.table("t")
    if extra and verify == "reads":  # no background check: not measured
        t_verified = float("nan")
    elif extra:  # code that verifies after the open
        while table.info()["unverified_segments"]:
            time.sleep(0.005)
        t_verified = time.perf_counter() - t0
    else:
        t_verified = t_open
    info = table.info()
    client.close()
    server.stop(grace=0)
    print(
        json.dumps(
            {
                "open": t_open,
                "first_sample": t_sample,
                "verified": t_verified,
                "dropped": info["dropped_segments"],
                "code": os.path.dirname(os.path.dirname(millpond.__file__)),
            }
        )
    )


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def restart(shard: Path, code: Path, verify: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(shard), "--verify", verify],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-gb", default="0.1,0.5,2")
    ap.add_argument("--code", action="append", default=[], help="NAME=PATH (repeatable)")
    ap.add_argument("--dir", type=Path, default=None, help="where the tables go (a temp dir)")
    ap.add_argument(
        "--verify",
        default="background",
        help="millpond serve --verify for code that has it (reads: verified is not measured)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.verify)
        return
    codes = [tuple(c.split("=", 1)) for c in args.code] or [("here", ".")]
    root = Path(tempfile.mkdtemp(prefix="millpond-reopen-", dir=args.dir))
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print("| size | steps | code | cache | open (s) | first sample (s) | verified (s) |")
    print("|---|---:|---|---|---:|---:|---:|")
    try:
        for size in (float(s) for s in args.sizes_gb.split(",")):
            shard = root / f"shard-{size}"
            t = time.perf_counter()
            steps = build(shard, size)
            gb = sum(p.stat().st_blocks * 512 for p in shard.rglob("*") if p.is_file()) / 1e9
            print(f"built {gb:.2f} GB in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            for name, path in codes:
                for cache in ("cold", "warm"):
                    if cache == "cold" and not drop_caches():
                        cache = "warm (no drop_caches)"
                    r = restart(shard, Path(path).resolve(), args.verify)
                    print(
                        f"| {gb:.2f} GB | {steps:,} | {name} | {cache} | {r['open']:.2f} | "
                        f"{r['first_sample']:.2f} | {r['verified']:.2f} |",
                        flush=True,
                    )
            shutil.rmtree(shard)
        print(f"# load at end {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
