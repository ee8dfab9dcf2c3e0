"""The floor under ``millpond launch``'s startup: Ray and the job's processes doing nothing.

Each repetition runs, each in a fresh process and timed from that process's start:

* ``ray``: ``ray.init`` on a local instance (2 CPUs, no dashboard) while a thread imports
  torch, as ``millpond launch`` starts;
* ``ray + N torch actors``: the same, then N Ray actors that only import torch (N = the
  job's shard, learner and env actors), timed until the last is ready;
* ``millpond launch``: ``deploy/configs/cartpole-ppo.yaml`` with a 3,000-frame budget, its
  ``startup_s`` from ``summary.json``: Ray up, the shard serving, the learners started and
  their weights published, the first steps inserted.

    python benchmarks/startup_floor.py                 # 3 repetitions, N = 3
    python benchmarks/startup_floor.py --reps 5 --actors 4

Prints a Markdown table of the median and range per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LAUNCH = (sys.executable, "-m", "millpond.cli", "launch", "deploy/configs/cartpole-ppo.yaml")
_LAUNCH += ("--set", "run.frames=3000", "--set", "ray.num_cpus=2")

# Timed from the process's start (psutil comes with Ray); prints "ray_up ready" in seconds.
_FLOOR = """
import sys, threading, time
importing = threading.Thread(target=lambda: __import__("torch"))
importing.start()
import ray, psutil
start = psutil.Process().create_time()
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=30)
ray_up = time.time() - start
importing.join()

@ray.remote(num_cpus=0)
class Bare:
    def ready(self):
        import torch  # noqa: F401
        return time.time()

actors = [Bare.remote() for _ in range(int(sys.argv[1]))]
ready = max(ray.get([a.ready.remote() for a in actors]), default=time.time()) - start
print(ray_up, ready)
ray.shutdown()
"""


def floor(actors: int) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", _FLOOR, str(actors)], capture_output=True, text=True, check=True
    )
    ray_up, ready = out.stdout.split()[-2:]
    return float(ray_up), float(ready)


def launch() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [*_LAUNCH, "--run-dir", run_dir],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        return json.loads((Path(run_dir) / "summary.json").read_text())["startup_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--actors", type=int, default=3, help="bare actors beside the driver")
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    for rep in range(args.reps):
        ray_up, _ = floor(0)
        _, ready = floor(args.actors)
        job = launch()
        measured = {
            "ray": ray_up,
            f"ray + {args.actors} torch actors": ready,
            "millpond launch: Ray up": job["ray"],
            "millpond launch: shard serving": job["shards"],
            "millpond launch: learner ready (weights published)": job["learners"],
            "millpond launch: first insert": job["first_insert"],
        }
        for name, seconds in measured.items():
            rows.setdefault(name, []).append(seconds)
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    print("| from the process's start to | median s | range s |")
    print("| --- | ---: | ---: |")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
