"""The DQN learner's step through the service against the same update loop alone, in one run.

One ``millpond serve`` process holds a uniform table of ~10,000 CartPole transitions (random
actions) with no rate limit, so the learner never waits for actors. The client process runs
:class:`~millpond.learner.dqn.DQNLearner` with ``cartpole-dqn.yaml``'s hyperparameters
(batch 128, ``prefetch`` 2, the MLP of 120 and 84 units) two ways, in turns:

* ``service``: ``step()`` as a launch runs it, sampling the shard (colocated reads where the
  shard's files are on this host, the default);
* ``service-wire``: the same with ``colocated=False``: every batch's rows on the wire;
* ``alone``: the same ``step()`` on batches sampled before the clock starts: the loss,
  backward pass, optimiser and target copies, no sampling (the floor the issue measures the
  service against: the same update loop run alone).

Neither publishes weights (``publish_every`` is out of reach), so both do the same update
work. One torch thread. Prints learner steps/s of each, their ratio, and the CPU time per step
of this process and of the shard's, and the p50/p99 time of one step.

    python benchmarks/dqn_learner.py                 # 5 turns of 300 steps each
    python benchmarks/dqn_learner.py --reps 3 --calls 200 --prefetch 4
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import log, millpond_serve, time_in_turns

TABLE = "replay"
STEPS = 10_000


def fill(client, steps: int, seed: int = 0) -> None:
    """``steps`` CartPole transitions of random actions, episode by episode (TED rows)."""
    import gymnasium as gym
    from tensordict import TensorDict

    env = gym.make("CartPole-v1")
    written, episode = 0, 0
    while written < steps:
        obs, _ = env.reset(seed=seed + episode)
        rows: dict[str, list] = {
            k: [] for k in ("obs", "next", "action", "reward", "term", "trunc")
        }
        done = False
        while not done:
            action = env.action_space.sample()
            nxt, reward, term, trunc, _ = env.step(action)
            for key, value in zip(rows, (obs, nxt, action, reward, term, trunc)):
                rows[key].append(value)
            obs, done = nxt, term or trunc
        n = len(rows["action"])
        client.extend(
            TABLE,
            TensorDict(
                {
                    "observation": torch.from_numpy(np.stack(rows["obs"])),
                    "action": torch.tensor(rows["action"]),
                    "next": {
                        "observation": torch.from_numpy(np.stack(rows["next"])),
                        "reward": torch.tensor(rows["reward"]).float().unsqueeze(-1),
                        "terminated": torch.tensor(rows["term"]).unsqueeze(-1),
                        "truncated": torch.tensor(rows["trunc"]).unsqueeze(-1),
                    },
                },
                [n],
            ),
        )
        written += n
        episode += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="turns of each system")
    parser.add_argument("--calls", type=int, default=300, help="learner steps per turn")
    parser.add_argument("--prefetch", type=int, default=2, help="sample requests in flight")
    args = parser.parse_args()

    from millpond import ReplayClient, TableConfig
    from millpond.learner.dqn import DQNConfig, DQNLearner
    from millpond.learner.networks import mlp_q

    torch.set_num_threads(1)
    torch.manual_seed(0)
    env_spaces = __import__("gymnasium").make("CartPole-v1")
    spaces = env_spaces.observation_space, env_spaces.action_space
    config = DQNConfig(batch_size=128, lr=2.5e-4, prefetch=args.prefetch, publish_every=10**9)
    with tempfile.TemporaryDirectory() as scratch, millpond_serve(Path(scratch)) as server:
        client = ReplayClient(server.addresses)
        client.create_table(TableConfig.uniform(TABLE, 11_000, samples_per_insert=None))
        fill(client, STEPS)
        log(f"filled {client.info(TABLE)['size']} steps")

        through = DQNLearner(client, TABLE, config, mlp_q(*spaces, hidden=(120, 84)))
        wire_client = ReplayClient(server.addresses, colocated=False)
        wire = DQNLearner(wire_client, TABLE, config, mlp_q(*spaces, hidden=(120, 84)))
        alone = DQNLearner(client, TABLE, config, mlp_q(*spaces, hidden=(120, 84)))
        batches = itertools.cycle([client.sample(TABLE, 128) for _ in range(64)])
        alone._next_batch = lambda: next(batches)  # the same step, its batches sampled before
        lat, wall, cpu = time_in_turns(
            {"service": through.step, "service-wire": wire.step, "alone": alone.step},
            args.reps,
            args.calls,
            servers=[server.proc.pid],
        )
        through.close()
        wire.close()
        wire_client.close()
        client.close()

    steps = args.reps * args.calls
    rate = {name: steps / wall[name] for name in wall}
    print(
        f"\nDQN learner steps, CartPole MLP (120, 84), batch 128, prefetch {args.prefetch}; "
        f"{args.reps} turns of {args.calls} steps; {platform.processor() or platform.machine()}, "
        "1 torch thread\n"
    )
    print("| system | steps/s | vs alone | p50 / p99 ms | client CPU ms/step | shard CPU ms/step |")
    print("|---|---|---|---|---|---|")
    for name in ("service", "service-wire", "alone"):
        client_cpu, shard_cpu = cpu[name]
        print(
            f"| {name} | {rate[name]:,.0f} | {rate[name] / rate['alone']:.2f} | "
            f"{1000 * np.percentile(lat[name], 50):.2f} / {1000 * np.percentile(lat[name], 99):.2f} | "
            f"{1000 * client_cpu / steps:.2f} | {1000 * shard_cpu / steps:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
