"""TorchRL's own DQN and SAC training loops, on TorchRL's buffer and on a millpond service.

Each loop is TorchRL's documented recipe (``DQNLoss`` / ``SACLoss``, ``SoftUpdate``,
``Collector``, ``TensorDictReplayBuffer(storage=LazyMemmapStorage(...))``); ``--buffer``
changes only the line that builds the buffer: ``local`` is TorchRL's, ``millpond`` is
``millpond.torchrl.ReplayBuffer`` over a table of a ``millpond serve`` started here. With
``--buffer both`` (default) both run in this process, one after the other, same seed.

Reported per run: frames until the mean return of the last 10 episodes first reaches the
target (``-`` if never), the best such mean, wall time, and bytes on disk per stored
transition (the buffer's files, blocks really written: TorchRL's memmap directory, the
table's directory as the shard reports it).

    python benchmarks/torchrl_scripts.py --algos dqn,sac --dqn-frames 20000 --sac-frames 6000
    python benchmarks/torchrl_scripts.py --algos dqn --seeds 0,1,2

``--breakdown`` also lists, per millpond run, every file of the table's directory (blocks
written over transitions stored) and the table's spec: where the bytes go.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections import deque
from pathlib import Path

import torch
from _common import disk_bytes, log, millpond_serve, quiet_torchrl, scratch_root

quiet_torchrl()
from tensordict.nn import NormalParamExtractor, TensorDictModule  # noqa: E402
from tensordict.nn import TensorDictSequential as Seq  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl.envs import GymEnv, RewardSum, StepCounter, TransformedEnv  # noqa: E402
from torchrl.modules import (  # noqa: E402
    MLP,
    EGreedyModule,
    ProbabilisticActor,
    QValueActor,
    TanhNormal,
    ValueOperator,
)
from torchrl.objectives import DQNLoss, SACLoss, SoftUpdate, ValueEstimators  # noqa: E402

from millpond import TableConfig  # noqa: E402
from millpond.torchrl import ReplayBuffer  # noqa: E402

PREFETCH = 2  # sample requests kept in flight (TorchRL's prefetch), for millpond's buffer


def make_buffer(
    kind: str, name: str, capacity: int, batch_size: int, scratch: Path, address: str, seed: int
):
    """The one line a script changes: TorchRL's buffer, or millpond's (its table seeded)."""
    if kind == "local":
        return TensorDictReplayBuffer(
            storage=LazyMemmapStorage(capacity, scratch_dir=scratch / name), batch_size=batch_size
        )
    table = TableConfig.uniform(name, capacity=capacity, seed=seed)
    return ReplayBuffer(address, table, batch_size=batch_size, prefetch=PREFETCH)


def dqn(rb, frames: int, seed: int, learn: bool = True):
    """TorchRL's DQN recipe on CartPole-v1."""
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.append_transform(RewardSum())
    env.set_seed(seed)
    qnet = QValueActor(
        MLP(in_features=4, out_features=2, num_cells=[120, 84]),
        in_keys=["observation"],
        spec=env.action_spec,
    )
    greedy = EGreedyModule(env.action_spec, annealing_num_steps=frames // 2, eps_end=0.05)
    loss = DQNLoss(qnet, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(ValueEstimators.TD0, gamma=0.99)
    target = SoftUpdate(loss, eps=0.99)
    optim = torch.optim.Adam(loss.parameters(), lr=2.5e-3)
    collector = Collector(
        env, Seq(qnet, greedy), frames_per_batch=50, total_frames=frames, init_random_frames=500
    )
    return _train(collector, rb, loss, optim, target, greedy, updates=5 * learn, warmup=500)


def sac(rb, frames: int, seed: int, learn: bool = True):
    """TorchRL's SAC recipe on Pendulum-v1."""
    env = TransformedEnv(GymEnv("Pendulum-v1"), StepCounter())
    env.append_transform(RewardSum())
    env.set_seed(seed)
    spec = env.action_spec_unbatched
    net = torch.nn.Sequential(
        MLP(in_features=3, out_features=2, num_cells=[64, 64]), NormalParamExtractor()
    )
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": spec.space.low, "high": spec.space.high},
        return_log_prob=True,
    )

    class Q(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP(in_features=4, out_features=1, num_cells=[64, 64])

        def forward(self, observation, action):
            return self.mlp(torch.cat([observation, action], -1))

    qvalue = ValueOperator(Q(), in_keys=["observation", "action"])
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2")
    loss.make_value_estimator(ValueEstimators.TD0, gamma=0.99)
    target = SoftUpdate(loss, eps=0.995)
    optim = torch.optim.Adam(loss.parameters(), lr=3e-3)
    collector = Collector(env, actor, frames_per_batch=50, total_frames=frames)
    return _train(collector, rb, loss, optim, target, None, updates=50 * learn, warmup=500)


def _train(collector, rb, loss_module, optim, target, greedy, updates: int, warmup: int):
    returns: deque[float] = deque(maxlen=10)
    curve = []  # (frames, mean of the last 10 returns)
    frames = 0
    for data in collector:
        rb.extend(data.reshape(-1))
        frames += data.numel()
        ended = data["next", "done"].reshape(-1)
        returns.extend(data["next", "episode_reward"].reshape(-1)[ended].tolist())
        if returns:
            curve.append((frames, sum(returns) / len(returns)))
        if greedy is not None:
            greedy.step(data.numel())
        if frames < warmup:
            continue
        for _ in range(updates):
            losses = loss_module(rb.sample())
            loss = sum(v for k, v in losses.items() if k == "loss" or k.startswith("loss_"))
            optim.zero_grad()
            loss.backward()
            optim.step()
            target.step()
        collector.update_policy_weights_()
    collector.shutdown()
    return curve


def _breakdown(root: Path, table: str, info: dict) -> None:
    """Each file of ``table``'s directory under the service's, in bytes per stored step."""
    stored = max(info["size"], 1)
    for key, field in info["config"].spec.fields.items():
        log(f"  {'.'.join(key)}: {field.describe()} {field.role} ({field.nbytes} B)")
    for path in sorted(next(p for p in root.rglob(table) if p.is_dir()).rglob("*")):
        if path.is_file() and path.stat().st_blocks:
            blocks = path.stat().st_blocks * 512
            log(f"  {path.name}: {blocks} B, {blocks / stored:.1f} B/transition")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buffer", choices=("local", "millpond", "both"), default="both")
    ap.add_argument("--algos", default="dqn,sac", help="comma-separated: dqn,sac")
    ap.add_argument("--dqn-frames", type=int, default=20_000, help="frames per DQN run")
    ap.add_argument("--sac-frames", type=int, default=6_000, help="frames per SAC run")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, each run on both")
    ap.add_argument("--dir", type=Path, help="parent of the temporary data directory (/tmp)")
    ap.add_argument("--breakdown", action="store_true", help="list each millpond table file")
    ap.add_argument(
        "--collect-only",
        action="store_true",
        help="no updates: the recipe's collector fills each buffer (for bytes at larger sizes)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds = ("local", "millpond") if args.buffer == "both" else (args.buffer,)
    seeds = [int(s) for s in args.seeds.split(",")]
    algos = {"dqn": (dqn, 150.0, args.dqn_frames), "sac": (sac, -400.0, args.sac_frames)}
    rows = []
    with scratch_root(args.dir, "torchrl-scripts-") as root:
        server = millpond_serve(root) if "millpond" in kinds else None
        address = server.addresses[0] if server else ""
        try:
            for algo in args.algos.split(","):
                run, goal, frames = algos[algo]
                for seed, kind in itertools.product(seeds, kinds):
                    torch.manual_seed(seed)
                    name = f"{algo}-{kind}-{seed}-{os.getpid()}"
                    rb = make_buffer(kind, name, frames, 128, root, address, seed)
                    t0 = time.perf_counter()
                    curve = run(rb, frames, seed, learn=not args.collect_only)
                    wall = time.perf_counter() - t0
                    if kind == "local":
                        stored, nbytes = len(rb), disk_bytes(root / name)
                    else:
                        info = rb.client.info(rb.table)
                        stored, nbytes = info["size"], info["bytes_on_disk"]
                        if args.breakdown:
                            _breakdown(root, name, info)
                        rb.close()
                    reached = next((f for f, r in curve if r >= goal), None)
                    best = max((r for _, r in curve), default=float("nan"))
                    per = nbytes / max(stored, 1)
                    rows.append((algo, seed, frames, goal, kind, reached, best, wall, per))
                    log(f"{algo} {kind}: {rows[-1]}")
        finally:
            if server is not None:
                server.stop()
    print(
        "\n| loop | seed | frames | target | buffer | frames to target | best mean-10 return "
        "| wall s | bytes/transition |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for algo, seed, frames, goal, kind, reached, best, wall, per in rows:
        print(
            f"| {algo} | {seed} | {frames} | {goal:g} | {kind} "
            f"| {reached if reached is not None else '-'} "
            f"| {best:.1f} | {wall:.1f} | {per:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
