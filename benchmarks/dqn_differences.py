"""CleanRL's DQN loop (``benchmarks/cleanrl_dqn.py``) with what ``millpond launch
cartpole-dqn.yaml`` does differently, each switchable, to tell which of them costs frames to
a mean return of 475:

* ``--lanes N``: N envs stepped together by one policy call (the env actor's lanes);
* ``--chunk K``: each lane's steps reach the buffer in chunks of K steps, all lanes' chunks
  at once (the actor's ``chunk_len``);
* ``--late F``: ... F frames after they were acted (what the writer holds unacknowledged
  while the rate limiter holds inserts back: the launch's ``sample age`` shows ~1,000);
* ``--acting-every S``: the acting network is the learner's as of its last multiple of S
  gradient steps (``publish_every``);
* ``--joined J``: J batches drawn at once (a colocated learner's ``prefetch``);
* ``--init orthogonal|torch``: the Q-network's initial weights (``learner.init``);
* ``--half-loss``: ``0.5 (y - Q)^2`` (``DQNLearner``'s) instead of ``(y - Q)^2``.

Learning starts once the buffer holds 9,000 transitions (``min_size``), then one gradient
step per 10 frames, the target copied every 50 steps, epsilon over the first 250,000
frames: ``cartpole-dqn.yaml``'s schedule. One process, one torch thread, no Ray or
millpond but the Q-network of ``--init``. Prints frames and seconds to 475 per seed::

    python benchmarks/dqn_differences.py --seeds 0 1 2                 # CleanRL's loop
    python benchmarks/dqn_differences.py --seeds 0 1 2 --lanes 16 --chunk 16 --late 1024 \\
        --acting-every 25 --joined 8 --half-loss --init orthogonal     # the launch's
"""

from __future__ import annotations

import argparse
import collections
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cleanrl_dqn import Buffer, Config, epsilon

LEARNING_STARTS = 9_000  # cartpole-dqn.yaml's min_size
TARGET_EVERY = 50  # gradient steps
TRAIN_EVERY = 10  # frames per gradient step


def q_network(init: str) -> torch.nn.Module:
    from millpond.learner.networks import mlp_q

    obs = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    return mlp_q(obs, gym.spaces.Discrete(2), (120, 84), activation="relu", init=init)


def run(args: argparse.Namespace, seed: int, target: float = 475.0) -> tuple[int | None, float]:
    """Frames and seconds to a mean return of ``target`` over 100 episodes (``None``
    frames: not within the budget)."""
    cfg = Config()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    envs = [gym.make("CartPole-v1") for _ in range(args.lanes)]
    q = q_network(args.init)
    target_q, acting = copy.deepcopy(q), copy.deepcopy(q)
    optimizer = torch.optim.Adam(q.parameters(), lr=cfg.learning_rate)
    buffer = Buffer(cfg.buffer_size, 4)
    obs = np.stack([env.reset(seed=seed * 100 + i)[0] for i, env in enumerate(envs)])
    for i, env in enumerate(envs):
        env.action_space.seed(seed * 100 + i)
    chunk: list[tuple] = []
    late: collections.deque[tuple] = collections.deque()
    returns: collections.deque[float] = collections.deque(maxlen=100)
    episode = np.zeros(args.lanes)
    batches: list[np.ndarray] = []
    frames = updates = rounds = 0
    started = time.perf_counter()
    while frames < cfg.frames:
        eps = epsilon(cfg, frames)
        with torch.no_grad():
            greedy = acting(torch.as_tensor(obs)).argmax(-1).numpy()
        for i, env in enumerate(envs):
            action = env.action_space.sample() if random.random() < eps else int(greedy[i])
            next_obs, reward, terminated, truncated, _ = env.step(action)
            chunk.append((obs[i].copy(), action, reward, next_obs.copy(), float(terminated)))
            episode[i] += reward
            if terminated or truncated:
                returns.append(episode[i])
                episode[i] = 0.0
                if len(returns) == returns.maxlen and np.mean(returns) >= target:
                    return frames + i + 1, time.perf_counter() - started
                next_obs, _ = env.reset()
            obs[i] = next_obs
        frames += args.lanes
        rounds += 1
        if rounds % args.chunk == 0:
            late.extend(chunk)
            chunk = []
            while len(late) > args.late:
                buffer.add(*late.popleft())
        if buffer.size < LEARNING_STARTS:
            continue
        while updates < (frames - LEARNING_STARTS) // TRAIN_EVERY:
            if not batches:
                rows = rng.integers(0, buffer.size, cfg.batch_size * args.joined)
                batches = list(rows.reshape(args.joined, cfg.batch_size))
            rows = batches.pop(0)
            s, a, r, s2, term = (
                torch.from_numpy(x[rows])
                for x in (
                    buffer.obs,
                    buffer.action,
                    buffer.reward,
                    buffer.next_obs,
                    buffer.terminated,
                )
            )
            with torch.no_grad():
                y = r + cfg.gamma * (1.0 - term) * target_q(s2).max(-1).values
            td = q(s).gather(1, a.unsqueeze(1)).squeeze(1) - y
            loss = (0.5 if args.half_loss else 1.0) * (td**2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1
            if updates % TARGET_EVERY == 0:
                target_q.load_state_dict(q.state_dict())
            if updates % args.acting_every == 0:
                acting.load_state_dict(q.state_dict())
    return None, time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lanes", type=int, default=1)
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--late", type=int, default=0)
    p.add_argument("--acting-every", type=int, default=1)
    p.add_argument("--joined", type=int, default=1)
    p.add_argument("--init", choices=("orthogonal", "torch"), default="torch")
    p.add_argument("--half-loss", action="store_true")
    args = p.parse_args()
    if min(args.lanes, args.chunk, args.acting_every, args.joined) < 1 or args.late < 0:
        p.error("--lanes, --chunk, --acting-every and --joined must be >= 1, --late >= 0")
    torch.set_num_threads(1)
    reached = []
    for seed in args.seeds:
        frames, seconds = run(args, seed)
        print(f"seed {seed}: frames to 475 {frames or '-'} ({seconds:.1f} s)", flush=True)
        if frames is not None:
            reached.append(frames)
    median = statistics.median(reached) if reached else "-"
    print(f"{len(reached)}/{len(args.seeds)} seeds reached 475; median frames {median}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
