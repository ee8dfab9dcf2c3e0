"""``millpond demo``: collect CartPole experience into a compact table and report the saving.

Steps a gymnasium vector env with a random policy, records each chunk in TED form (the
true final observation at episode ends, not the reset one), inserts it with
``Table.extend`` (which compacts it), then samples the table and checks every
``("next", "observation")`` against the recording.
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
    ted_bytes = 0
    start = time.perf_counter()
    for c in range(chunks):
        td, obs = collect_chunk(env, obs, args.chunk, traj_ids, next_traj)
        ted_bytes += td.exclude("collector").bytes()
        table.extend(td)
        flat = td.reshape(-1)
        for i in np.random.default_rng(c).choice(len(flat), size=16, replace=False):
            recorded[(c, int(i))] = flat[int(i)]
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
    spec = table.spec
    assert spec is not None
    obs_b, step_b = spec.observation_bytes, spec.step_bytes
    compact_data = obs_b * (steps + segments) + step_b * steps
    batch = table.sample(min(4096, steps))
    ends = batch["next", "done"].squeeze(-1)
    print(f"\nmillpond demo: {args.env}, {args.lanes} lanes x {args.chunk} steps, random policy")
    print(f"  stored steps             {steps:>12,}")
    print(
        f"  segments                 {segments:>12,}  (mean length {steps / max(1, segments):.1f})"
    )
    print(f"  episode ends sampled     {int(ends.sum()):>12,}  of {len(batch):,} sampled steps")
    print(f"  TED bytes (obs twice)    {ted_bytes:>12,}  ({ted_bytes / steps:.1f} B/step)")
    print(f"  compact bytes            {compact_data:>12,}  ({compact_data / steps:.1f} B/step)")
    print(
        f"  observation bytes saved  {1 - obs_b * (steps + segments) / (2 * obs_b * steps):>12.1%}"
    )
    print(f"  total bytes saved        {1 - compact_data / ted_bytes:>12.1%}")
    print(f"  on disk (sparse files)   {info['bytes_on_disk']:>12,}")
    check = _check_against_recording(table, recorded, path.parent / "export")
    print(
        f"  next-obs checked         {check:>12,}  recorded steps equal the stored ones bit for bit"
    )
    table.close()
    if tmp is not None:
        tmp.cleanup()
    return 0


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
