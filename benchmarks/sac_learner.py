"""The SAC learner's gradient step against Stable-Baselines3's, alone and through the service,
in one run.

One ``millpond serve`` process holds a uniform table of ``--steps`` Pendulum-v1 transitions
(random actions) with no rate limit, so the learner never waits for actors; SB3's SAC gets
its own replay buffer of as many random steps. With ``pendulum-sac.yaml``'s learner (batch
256, two 256x256 networks per critic and one for the policy, lr 1e-3, ``prefetch`` 4) and
SB3's with rl-zoo's Pendulum-v1 hyperparameters (the same networks, batch and learning
rate), each of these takes ``--calls`` steps in turn, ``--reps`` times over:

* ``sb3``: ``SAC.train(gradient_steps=1, batch_size=256)``, sampling its in-process buffer:
  the step ``benchmarks/sb3_sac.py`` takes once per frame;
* ``alone``: :meth:`~millpond.learner.SACLearner.step` on batches sampled before the clock
  starts: losses, backward pass, Adam, target update, metrics; no sampling, no publishing;
* ``service``: the same step sampling the shard (colocated reads where the shard's files
  are on this host, the default), no publishing;
* ``service-wire``: the same with ``colocated=False``: every batch's rows on the wire;
* ``service+publish``: as ``service``, publishing the policy every ``--publish-every`` steps
  (``pendulum-sac.yaml``'s 2): a launch's learner step.

One torch thread (``--threads``), as SB3's reference and a launch's learner. Prints steps/s,
the ratio to SB3's, p50/p99 of one step, and the CPU time per step of this process (all its
threads: the learner's and its sampling, publishing and gRPC threads) and of the shard:
a shared machine's slow phases fall on every system alike, and CPU time per step counts the
work whatever the load.

    python benchmarks/sac_learner.py                    # 5 turns of 200 steps each
    python benchmarks/sac_learner.py --reps 3 --calls 100

Needs the ``bench`` extra (``pip install -e .[bench]``) for Stable-Baselines3.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fill_random, log, millpond_serve, time_in_turns

TABLE = "replay"
ENV = "Pendulum-v1"


def sb3_step(steps: int, lr: float, batch_size: int, hidden: list[int], seed: int = 0):
    """SB3's SAC with ``steps`` random transitions in its buffer; its one gradient step."""
    from stable_baselines3 import SAC

    model = SAC(
        "MlpPolicy",
        ENV,
        learning_rate=lr,
        learning_starts=steps,  # random actions until the buffer holds them all
        batch_size=batch_size,
        policy_kwargs={"net_arch": hidden},
        seed=seed,
        device="cpu",
        verbose=0,
    )
    model.learn(steps)
    return lambda: model.train(gradient_steps=1, batch_size=batch_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="turns of each system")
    parser.add_argument("--calls", type=int, default=200, help="steps per turn")
    parser.add_argument("--prefetch", type=int, default=4, help="sample requests in flight")
    parser.add_argument("--publish-every", type=int, default=2, help="service+publish's")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", default="256,256", help="hidden widths of every network")
    parser.add_argument("--steps", type=int, default=5_000, help="transitions stored")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    hidden = [int(h) for h in args.hidden.split(",")]

    import gymnasium as gym

    from millpond import ReplayClient, TableConfig
    from millpond.learner.box_networks import TwinQ, mlp_sac_actor
    from millpond.learner.sac import SACConfig, SACLearner

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = gym.make(ENV)
    spaces = env.observation_space, env.action_space
    lr = 1e-3  # rl-zoo's Pendulum-v1
    sb3 = sb3_step(args.steps, lr, args.batch_size, hidden)
    log(f"SB3's buffer holds {args.steps} steps")

    def learner(client, publish_every: int = 10**9) -> SACLearner:
        config = SACConfig(
            batch_size=args.batch_size, lr=lr, prefetch=args.prefetch, publish_every=publish_every
        )
        policy = mlp_sac_actor(*spaces, tuple(hidden))
        return SACLearner(client, TABLE, config, policy, TwinQ(*spaces, tuple(hidden)), spaces[1])

    with tempfile.TemporaryDirectory() as scratch, millpond_serve(Path(scratch)) as server:
        client = ReplayClient(server.addresses)
        client.create_table(TableConfig.uniform(TABLE, args.steps + 1_000, samples_per_insert=None))
        fill_random(client, TABLE, ENV, args.steps)
        log(f"filled {client.info(TABLE)['size']} steps")
        wire_client = ReplayClient(server.addresses, colocated=False)
        through, wire = learner(client), learner(wire_client)
        publishing = learner(client, args.publish_every)
        publishing.publish()
        alone = learner(client)
        batches = itertools.cycle([client.sample(TABLE, args.batch_size) for _ in range(64)])
        alone._batches.next = lambda: next(batches)  # the same step, its batches sampled before
        systems = {
            "sb3": sb3,
            "alone": alone.step,
            "service": through.step,
            "service-wire": wire.step,
            "service+publish": publishing.step,
        }
        lat, wall, cpu = time_in_turns(systems, args.reps, args.calls, servers=[server.proc.pid])
        for one in (through, wire, publishing, alone):
            one.close()
        wire_client.close()
        client.close()

    steps = args.reps * args.calls
    rate = {name: steps / wall[name] for name in wall}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\nSAC learner steps on {ENV}, batch {args.batch_size}, networks {hidden}, prefetch "
        f"{args.prefetch}; {args.reps} turns of {args.calls} steps; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (load average "
        f"{load} at the end), {torch.get_num_threads()} torch thread(s)\n"
    )
    print(
        "| system | steps/s | vs sb3 | p50 / p99 ms | CPU ms/step (this process) | shard CPU ms/step |"
    )
    print("|---|---|---|---|---|---|")
    for name in systems:
        client_cpu, shard_cpu = cpu[name]
        print(
            f"| {name} | {rate[name]:,.0f} | {rate[name] / rate['sb3']:.2f} | "
            f"{1000 * np.percentile(lat[name], 50):.2f} / {1000 * np.percentile(lat[name], 99):.2f} | "
            f"{1000 * client_cpu / steps:.2f} | {1000 * shard_cpu / steps:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
