"""Bytes per stored transition of TorchRL's Atari frame stacks: TorchRL's buffer against
``millpond.torchrl.ReplayBuffer`` over a frame-stacked table, fed the same collector data.

The env is TorchRL's Atari form: an ALE game's frames resized to 84x84 (gymnasium's
``ResizeObservation``, where TorchRL's ``Resize`` would need torchvision), then TorchRL's
``ToTensorImage``, ``GrayScale`` and ``CatFrames(N=4)``: ``pixels`` is ``float32[4, 84,
84]``, and TED stores it twice a row (``pixels`` and ``("next", "pixels")``). A random
policy's ``Collector`` batches of ``--frames-per-batch`` steps go, as they come, into a
``TensorDictReplayBuffer(storage=LazyMemmapStorage(...))`` and into a millpond buffer over
``TableConfig.uniform(..., frame_stacks={"pixels": 4})`` on a ``millpond serve`` started
here: the table keeps each frame once (one per slot, and the three older frames of the first
stack of each chain: a batch short enough for a writer's region continues the previous one
on its last slot and stores no older frames of its own). Both capacities are twice the
frames, so nothing is overwritten; bytes are blocks really written (the memmap directory;
the table's directory as the shard reports it) over the transitions stored.

    python benchmarks/torchrl_frame_stacks.py --frames 3000 --frames-per-batch 16,50,200
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from _common import disk_bytes, log, millpond_serve, quiet_torchrl, scratch_root

quiet_torchrl()
import ale_py  # noqa: E402
import gymnasium as gym  # noqa: E402
from gymnasium.wrappers import ResizeObservation  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl.envs import (  # noqa: E402
    CatFrames,
    Compose,
    GrayScale,
    GymWrapper,
    StepCounter,
    ToTensorImage,
    TransformedEnv,
)

from millpond import TableConfig  # noqa: E402
from millpond.torchrl import ReplayBuffer  # noqa: E402


def atari_env(game: str, seed: int) -> TransformedEnv:
    """TorchRL's Atari preprocessing: 84x84 gray frames, the last 4 stacked (``pixels``)."""
    gym.register_envs(ale_py)
    base = GymWrapper(ResizeObservation(gym.make(game), (84, 84)))
    stack = CatFrames(N=4, dim=-3, in_keys=["pixels"])
    env = TransformedEnv(base, Compose(ToTensorImage(), GrayScale(), stack, StepCounter()))
    env.set_seed(seed)
    return env


def measure(game: str, frames: int, per_batch: int, root: Path, address: str) -> tuple:
    """(bytes per transition: TorchRL's, millpond's; seconds) for one collector run."""
    name = f"frames-{per_batch}-{os.getpid()}"
    local = TensorDictReplayBuffer(
        storage=LazyMemmapStorage(2 * frames, scratch_dir=root / name), batch_size=32
    )
    config = TableConfig.uniform(name, capacity=2 * frames, frame_stacks={"pixels": 4})
    rb = ReplayBuffer(address, config, batch_size=32)
    torch.manual_seed(0)
    collector = Collector(atari_env(game, 0), None, frames_per_batch=per_batch, total_frames=frames)
    t0 = time.perf_counter()
    for batch in collector:
        local.extend(batch)
        rb.extend(batch)
    collector.shutdown()
    wall = time.perf_counter() - t0
    info = rb.client.info(rb.table)
    rb.close()
    assert info["size"] == len(local), (info["size"], len(local))
    return disk_bytes(root / name) / len(local), info["bytes_on_disk"] / info["size"], wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--game", default="ALE/Pong-v5")
    ap.add_argument("--frames", type=int, default=3000, help="frames collected per run")
    ap.add_argument("--frames-per-batch", default="16,50,200", help="comma-separated sizes")
    ap.add_argument("--dir", type=Path, help="parent of the temporary data directory (/tmp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with scratch_root(args.dir, "torchrl-frames-") as root:
        server = millpond_serve(root)
        try:
            for per_batch in (int(s) for s in args.frames_per_batch.split(",")):
                ted, ours, wall = measure(
                    args.game, args.frames, per_batch, root, server.addresses[0]
                )
                rows.append((per_batch, ted, ours, wall))
                log(f"frames_per_batch {per_batch}: {rows[-1]}")
        finally:
            server.stop()
    print(f"\n{args.game}, {args.frames} frames, float32[4, 84, 84] stacks\n")
    print("| frames_per_batch | TorchRL bytes/transition | millpond bytes/transition | ratio |")
    print("| --- | --- | --- | --- |")
    for per_batch, ted, ours, _ in rows:
        print(f"| {per_batch} | {ted:,.0f} | {ours:,.0f} | {ours / ted:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
