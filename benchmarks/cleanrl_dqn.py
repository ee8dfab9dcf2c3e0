"""A single-process DQN on CartPole-v1 after CleanRL's ``dqn.py``, as a reference for
``benchmarks/train.py``: plain PyTorch and gymnasium, no millpond, no TorchRL.

Written from CleanRL's documented algorithm and defaults (not its code):

* one env; a replay buffer of the last 10,000 transitions;
* epsilon-greedy with epsilon linear from 1.0 to 0.05 over the first half of the frame
  budget (``exploration_fraction`` 0.5 of ``--frames``), then 0.05;
* learning starts after 10,000 frames; from then on one gradient step every 10 frames on a
  uniform batch of 128 transitions (12.8 sampled transitions per stored one);
* the 1-step target ``r + gamma (1 - terminated) max_a Q_target(s', a)``, gamma 0.99: a
  truncation (CartPole's 500-step limit) bootstraps from the real final observation;
* the mean squared TD error, Adam at 2.5e-4, no gradient clipping;
* a hard target-network copy every 500 frames (``tau`` 1);
* the Q-network an MLP ``obs -> 120 -> 84 -> actions`` with ReLUs.

Logs the mean return of the last 100 episodes against frames, as CSV rows on stdout
(``frames,time_s,episodes,mean_return``) and, with ``--csv``, into a file. With
``--target R`` it stops once that mean reaches ``R``; with ``--json`` its last line is the
run's result for ``benchmarks/train.py`` (as the Stable-Baselines3 references print it),
its seconds counted from the process's start as a launch's are: the interpreter, the
imports, the env and the network included.
``--q-network millpond`` swaps in millpond's ``mlp_q`` with its defaults (Tanh layers,
orthogonal init; ``cartpole-dqn.yaml`` takes ReLU and ``nn.Linear``'s own weights, this
network's), and changes nothing else::

    python benchmarks/cleanrl_dqn.py --seed 0 --frames 500000
    python benchmarks/cleanrl_dqn.py --seed 0 --frames 500000 --q-network millpond
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sb3 import process_start


@dataclass(frozen=True)
class Config:
    env_id: str = "CartPole-v1"
    frames: int = 500_000
    learning_rate: float = 2.5e-4
    buffer_size: int = 10_000
    gamma: float = 0.99
    tau: float = 1.0
    target_network_frequency: int = 500  # frames
    batch_size: int = 128
    start_e: float = 1.0
    end_e: float = 0.05
    exploration_fraction: float = 0.5
    learning_starts: int = 10_000  # frames
    train_frequency: int = 10  # frames per gradient step


def q_network(obs_dim: int, n_actions: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(obs_dim, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, n_actions),
    )


def millpond_q_network(obs_dim: int, n_actions: int) -> nn.Module:
    """millpond's ``mlp_q`` with the same widths and its defaults (Tanh, orthogonal)."""
    from millpond.learner.networks import mlp_q

    obs_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
    return mlp_q(obs_space, gym.spaces.Discrete(n_actions), (120, 84))


Q_NETWORKS = {"cleanrl": q_network, "millpond": millpond_q_network}


def epsilon(cfg: Config, frame: int) -> float:
    duration = cfg.exploration_fraction * cfg.frames
    slope = (cfg.end_e - cfg.start_e) / duration
    return max(cfg.end_e, cfg.start_e + slope * frame)


class Buffer:
    """A ring buffer of transitions ``(s, a, r, s', terminated)``."""

    def __init__(self, capacity: int, obs_dim: int) -> None:
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.action = np.zeros(capacity, dtype=np.int64)
        self.reward = np.zeros(capacity, dtype=np.float32)
        self.terminated = np.zeros(capacity, dtype=np.float32)
        self.capacity, self.size, self.pos = capacity, 0, 0

    def add(self, obs, action, reward, next_obs, terminated) -> None:
        i = self.pos
        self.obs[i], self.action[i], self.reward[i] = obs, action, reward
        self.next_obs[i], self.terminated[i] = next_obs, terminated
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
        idx = rng.integers(0, self.size, n)
        return tuple(
            torch.from_numpy(x[idx])
            for x in (self.obs, self.action, self.reward, self.next_obs, self.terminated)
        )


def train(
    cfg: Config,
    seed: int,
    on_log: Callable[[int, float, int, float], None] | None = None,
    stop_at_return: float | None = None,
    make_q: Callable[[int, int], nn.Module] = q_network,
    window: int = 100,
) -> dict:
    """Run DQN for ``cfg.frames`` frames, or until the mean return of the last ``window``
    episodes reaches ``stop_at_return``. Returns ``curve`` (``[(frames, mean return of the
    last window episodes)]``, one point per finished episode, each also passed to ``on_log`` as
    ``(frames, seconds, episodes, mean)``), ``frames``, ``wall_s`` and ``updates``
    (gradient steps). The epsilon schedule follows ``cfg.frames`` whether or not the run
    stops early."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = gym.make(cfg.env_id)
    env.action_space.seed(seed)
    obs_dim = env.observation_space.shape[0]
    n_actions = env.action_space.n
    q = make_q(obs_dim, n_actions)
    target = make_q(obs_dim, n_actions)
    target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=cfg.learning_rate)
    buffer = Buffer(cfg.buffer_size, obs_dim)
    returns: collections.deque[float] = collections.deque(maxlen=window)
    curve: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    obs, _ = env.reset(seed=seed)
    episode_return, episodes, updates, frame = 0.0, 0, 0, 0
    for frame in range(1, cfg.frames + 1):
        if random.random() < epsilon(cfg, frame - 1):
            action = int(env.action_space.sample())
        else:
            with torch.no_grad():
                action = int(q(torch.as_tensor(obs, dtype=torch.float32)).argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        # next_obs is the real final observation at a truncation: bootstrap from it.
        buffer.add(obs, action, reward, next_obs, float(terminated))
        episode_return += float(reward)
        if terminated or truncated:
            episodes += 1
            returns.append(episode_return)
            mean = float(np.mean(returns))
            curve.append((frame, mean))
            if on_log is not None:
                on_log(frame, time.perf_counter() - t0, episodes, mean)
            episode_return = 0.0
            if stop_at_return is not None and mean >= stop_at_return:
                break
            obs, _ = env.reset()
        else:
            obs = next_obs
        if frame > cfg.learning_starts:
            if frame % cfg.train_frequency == 0:
                s, a, r, s2, term = buffer.sample(cfg.batch_size, rng)
                with torch.no_grad():
                    y = r + cfg.gamma * (1.0 - term) * target(s2).max(-1).values
                q_sa = q(s).gather(1, a.unsqueeze(1)).squeeze(1)
                loss = nn.functional.mse_loss(q_sa, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                updates += 1
            if frame % cfg.target_network_frequency == 0:
                with torch.no_grad():
                    for tp, p in zip(target.parameters(), q.parameters(), strict=True):
                        tp.lerp_(p, cfg.tau)
    env.close()
    return {
        "curve": curve,
        "frames": frame,
        "wall_s": time.perf_counter() - t0,
        "updates": updates,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=500_000)
    p.add_argument("--csv", type=Path, help="also write the curve to this CSV file")
    p.add_argument("--q-network", choices=sorted(Q_NETWORKS), default="cleanrl")
    p.add_argument("--every", type=int, default=5000, help="print a row every N frames")
    p.add_argument("--target", type=float, help="stop once the mean return reaches this")
    p.add_argument("--window", type=int, default=100, help="episodes the mean return averages")
    p.add_argument("--json", action="store_true", help="end with the result as a JSON line")
    args = p.parse_args()
    started = process_start()
    torch.set_num_threads(1)
    cfg = Config(frames=args.frames)
    rows: list[str] = []
    last = [-args.every]
    reached: list[tuple[int, float]] = []

    def on_log(frame: int, t: float, episodes: int, mean: float) -> None:
        row = f"{frame},{t:.1f},{episodes},{mean:.1f}"
        rows.append(row)
        if args.target is not None and mean >= args.target and not reached:
            reached.append((frame, time.time() - started))
        if frame - last[0] >= args.every:
            last[0] = frame
            print(row, flush=True)

    print("frames,time_s,episodes,mean_return", flush=True)
    make_q = Q_NETWORKS[args.q_network]
    trained_at = time.time()
    run = train(cfg, args.seed, on_log, args.target, make_q, args.window)
    if args.json:
        curve = run["curve"]
        print(
            json.dumps(
                {
                    "stopped_by": "return" if reached else "frames",
                    "frames_to_target": reached[0][0] if reached else None,
                    "seconds_to_target": reached[0][1] if reached else None,
                    "startup_s": trained_at - started,  # the interpreter, the imports
                    "frames": run["frames"],
                    "wall_s": time.time() - started,
                    "loop_s": run["wall_s"],
                    "final_return": curve[-1][1] if curve else None,
                    "eval_return": None,
                    "eval_s": 0.0,
                    "updates": run["updates"],
                    "curve": curve,
                    "eval_curve": [],
                }
            ),
            flush=True,
        )
    if args.csv is not None:
        args.csv.write_text("frames,time_s,episodes,mean_return\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
