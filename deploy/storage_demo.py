"""``millpond demo``: collect CartPole experience into a compact table and report the saving.

Steps a gymnasium vector env with a random policy, records each chunk in TED form (the
true final observation at episode ends, not the reset one), inserts it with
``Table.extend`` (which compacts it), then samples the table and checks every
``("next", "observation")`` against the recording.

It then prints the bytes per stored step of every file of the table's directory (data
columns, slot pointers, segment records, sampler and table files, as ``st_blocks * 512``)
next to those of the same steps in TorchRL's TED layout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.service.export import export_ted
from millpond.service.table import Table
from millpond.service.table_files import disk_usage


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="millpond demo", description=__doc__)
    p.add_argument("--env", default="CartPole-v1", help="gymnasium env id")
    p.add_argument("--lanes", type=int, default=8, help="parallel env lanes (P)")
    p.add_argument("--chunk", type=int, default=128, help="steps per lane per chunk (T)")
    p.add_argument("--frames", type=int, default=50_000, help="total steps to collect")
    p.add_argument("--dir", help="table directory (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    return p


def collect_chunk(
    env: gym.vector.VectorEnv,
    obs: np.ndarray,
    steps: int,
    traj_ids: np.ndarray,
    next_traj: list[int],
) -> tuple[TensorDict, np.ndarray]:
    """``steps`` steps of every lane as a ``[P, T]`` TED TensorDict (SAME_STEP autoreset)."""
    lanes = env.num_envs
    rows = {
        k: [] for k in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "traj")
    }
    for _ in range(steps):
        action = env.action_space.sample()
        new_obs, reward, terminated, truncated, info = env.step(action)
        next_obs = new_obs.copy()
        ended = terminated | truncated
        for lane in np.flatnonzero(ended):
            next_obs[lane] = info["final_obs"][lane]  # the real last observation
        for k, v in (
            ("obs", obs),
            ("next_obs", next_obs),
            ("action", action),
            ("reward", reward),
            ("terminated", terminated),
            ("truncated", truncated),
            ("traj", traj_ids.copy()),
        ):
            rows[k].append(np.asarray(v))
        for lane in np.flatnonzero(ended):
            traj_ids[lane] = next_traj[0]
            next_traj[0] += 1
        obs = new_obs

    def stack(k: str) -> torch.Tensor:
        return torch.from_numpy(np.stack(rows[k], axis=1))

    td = TensorDict(
        {
            "observation": stack("obs"),
            "action": stack("action"),
            "collector": {"traj_ids": stack("traj")},
            "next": {
                "observation": stack("next_obs"),
                "reward": stack("reward").float().unsqueeze(-1),
                "terminated": stack("terminated").unsqueeze(-1),
                "truncated": stack("truncated").unsqueeze(-1),
                "done": (stack("terminated") | stack("truncated")).unsqueeze(-1),
            },
        },
        batch_size=[lanes, steps],
    )
    return td, obs


def run(args: argparse.Namespace) -> int:
    env = gym.make_vec(
        args.env,
        num_envs=args.lanes,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    env.action_space.seed(args.seed)
    obs, _ = env.reset(seed=args.seed)
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="millpond-demo-")
    path = Path(args.dir or tmp.name) / "replay"  # type: ignore[union-attr]
    chunks = max(1, args.frames // (args.lanes * args.chunk))
    capacity = 2 * chunks * args.lanes * args.chunk  # room for every step and tail: no eviction
    table = Table.create(path, TableConfig.uniform("replay", capacity, seed=args.seed))
    traj_ids = np.arange(args.lanes)
    next_traj = [args.lanes]
    recorded: dict[tuple[int, int], TensorDict] = {}
    episode_ends = 0
    ted = TedBytes()
    start = time.perf_counter()
    for c in range(chunks):
        td, obs = collect_chunk(env, obs, args.chunk, traj_ids, next_traj)
        ted.add(td)
        table.extend(td)
        flat = td.reshape(-1)
        # Check 16 random steps of the chunk and every step that ends an episode.
        ends = np.flatnonzero(flat["next", "done"].reshape(-1).numpy())
        episode_ends += len(ends)
        random = np.random.default_rng(c).choice(len(flat), size=16, replace=False)
        for i in np.union1d(random, ends).tolist():
            recorded[(c, i)] = flat[i]
        done = (c + 1) * args.lanes * args.chunk
        print(
            f"\rcollected {done:>9,} steps  ({done / (time.perf_counter() - start):,.0f}/s)",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    env.close()
    info = table.info()
    steps = info["size"]
    segments = info["next_generation"] - 1
    print(f"\nmillpond demo: {args.env}, {args.lanes} lanes x {args.chunk} steps, random policy")
    print(f"  stored steps             {steps:>12,}")
    print(
        f"  segments                 {segments:>12,}  (mean length {steps / max(1, segments):.1f})"
    )
    print(f"  episode ends             {episode_ends:>12,}")
    check = _check_against_recording(table, recorded, path.parent / "export")
    print(
        f"  next-obs checked         {check:>12,}  recorded steps (every episode end and 16 more "
        "per chunk)\n                                         equal the stored ones bit for bit"
    )
    table.close()  # the files as a restarted shard finds them
    print()
    print(bytes_table(disk_usage(path, table.spec), ted, steps))
    if tmp is not None:
        tmp.cleanup()
    return 0


class TedBytes:
    """Bytes of the recorded steps in TorchRL's TED layout, by part.

    ``LazyMemmapStorage`` keeps one file per key, its rows back to back, so these are the
    bytes of its files (less a page of rounding per file). The collector's
    ``("collector", "traj_ids")`` column, which TorchRL would store too, is left out (8 bytes
    per step in TED's favour): millpond's episode ids are counted, in its segment records.
    """

    def __init__(self) -> None:
        self.observations = 0
        self.other = 0

    def add(self, td: TensorDict) -> None:
        for key, value in td.exclude("collector").items(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            if key[-1] == "observation":
                self.observations += value.numel() * value.element_size()
            else:
                self.other += value.numel() * value.element_size()

    @property
    def total(self) -> int:
        return self.observations + self.other


def bytes_table(usage: dict[str, int], ted: TedBytes, steps: int) -> str:
    """Bytes per stored step, every file of the table directory against TED, as a table."""
    total = sum(usage.values())
    rows = [
        ("observations", usage["observations"], ted.observations),
        ("step fields (action, reward, flags)", usage["step fields"], ted.other),
        ("slot pointers (slots.bin)", usage["slot pointers"], None),
        ("segment records (+ checksums)", usage["segment records"], None),
        ("sampler files", usage["sampler"], None),
        ("table files (JSON, counters, index)", usage["table files"], None),
        ("total", total, ted.total),
    ]
    lines = [
        "  bytes on disk per stored step     millpond       TED",
        "  (every file, st_blocks x 512)",
    ]
    for name, ours, theirs in rows:
        ted_cell = "-" if theirs is None else f"{theirs / steps:.1f}"
        lines.append(f"    {name:<36}{ours / steps:>8.1f}{ted_cell:>10}")
    lines.append(f"    {'millpond / TED':<36}{total / ted.total:>7.2f}x")
    lines.append(
        f"  ({total:,} bytes against {ted.total:,}. TED: observation and next observation,\n"
        "  action, reward, done/terminated/truncated; TorchRL would also store the collector's\n"
        "  traj_ids, 8 more bytes per step, not counted here)"
    )
    return "\n".join(lines)


def _check_against_recording(table: Table, recorded: dict, path: Path) -> int:
    """Export every stored step and compare the recorded rows' next observations, bit for bit.

    Rows are matched by (episode id, observation bytes); returns how many matched equal.
    """
    exported = export_ted(table, path)
    stored = {
        (int(e), o.numpy().tobytes()): n
        for e, o, n in zip(
            exported["episode_id"], exported["observation"], exported["next", "observation"]
        )
    }
    equal = 0
    for row in recorded.values():
        key = (int(row["collector", "traj_ids"]), row["observation"].numpy().tobytes())
        if key not in stored:
            raise AssertionError(f"a recorded step of episode {key[0]} is not stored")
        if not torch.equal(stored[key], row["next", "observation"]):
            raise AssertionError(f"a stored step of episode {key[0]} differs from the recording")
        equal += 1
    return equal
