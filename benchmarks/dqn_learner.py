"""The DQN learner's step through the service against the same update loop alone, in one run.

One ``millpond serve`` process holds a uniform table of ~10,000 CartPole transitions (random
actions) with no rate limit, so the learner never waits for actors. The client process runs
the :class:`~millpond.learner.dqn.DQNLearner` that ``millpond launch`` builds for
``deploy/configs/cartpole-dqn.yaml`` (``--config`` to read another; its network, loss, target
period and ``prefetch``; ``--prefetch`` and ``--publish-every`` change those two) in turns:

* ``service``: ``step()`` as a launch runs it, sampling the shard (colocated reads where the
  shard's files are on this host, the default);
* ``service-wire``: the same with ``colocated=False``: every batch's rows on the wire;
* ``alone``: the same ``step()`` on batches sampled before the clock starts: the loss,
  backward pass, optimiser and target copies, no sampling (the floor the issue measures the
  service against: the same update loop run alone).

``alone`` does not publish weights. The ``service`` systems publish every ``N`` steps
(``--publish-every N``, the config's ``publish_every`` by default; 0: never), as a launch's
learner does, on a thread of its own while the next steps run; ``--publish-every`` adds
``service-publish-in-step``: the same learner calling :meth:`~DQNLearner.publish` after
every ``N``-th step, which returns once the shard has stored the weights (what a
publication in the step would cost). One torch thread. Prints learner steps/s of each,
their ratio, and the CPU time per step of this process and of the shard's, and the p50/p99
time of one step.

``--shape atari`` runs ``atari-dqn.yaml``'s learner instead: a frame-stacked, zstd table of
real Breakout frames (``uint8[4, 84, 84]``, random actions; the ``atari`` extra), the Nature
CNN, batch 32 (``--batch-size`` to change), Double DQN and the Huber loss. ``--device cuda``
puts the network on a GPU: the samples still arrive on the host and each step moves its batch
over, as a launch's learner does. The table then also shows the share of each step spent
waiting for its batch (``sample_s`` of the step's metrics).

    python benchmarks/dqn_learner.py                 # 5 turns of 300 steps each
    python benchmarks/dqn_learner.py --reps 3 --calls 200 --prefetch 4
    python benchmarks/dqn_learner.py --shape atari --device cuda --calls 500
    python benchmarks/dqn_learner.py --publish-every 0   # no publications
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fill_random, log, millpond_serve, time_in_turns

TABLE = "replay"
STEPS = 10_000
NEVER = 10**9  # a publish_every out of reach


def fill(client, steps: int, seed: int = 0) -> None:
    """``steps`` CartPole transitions of random actions, episode by episode (TED rows)."""
    fill_random(client, TABLE, "CartPole-v1", steps, seed)


def fill_atari(client, steps: int, seed: int = 0) -> None:
    """``steps`` or more real Breakout transitions (random actions) in chunks of 32 steps."""
    from _common import collect_atari

    lanes, chunk_len = 8, 32
    chunks = -(-steps // (lanes * chunk_len))
    for batch in collect_atari("ALE/Breakout-v5", lanes, chunk_len, chunks, seed):
        client.extend(TABLE, batch)


def _setup(args: argparse.Namespace, client, device: torch.device):
    """The table, its contents, the learner's config and a network factory for ``--shape``."""
    from millpond import TableConfig
    from millpond.learner.dqn import DQNConfig
    from millpond.learner.networks import nature_cnn_q

    if args.shape == "cartpole":
        return _setup_from_config(args, client, device)
    common = {"prefetch": args.prefetch or 2, "publish_every": args.publish_every or NEVER}
    from _common import ATARI_WRAPPERS

    from millpond.actors.envs import make_env

    env = make_env("ALE/Breakout-v5", {"frameskip": 1}, ATARI_WRAPPERS)
    spaces = env.observation_space, env.action_space
    env.close()
    client.create_table(
        TableConfig.uniform(
            TABLE,
            args.atari_steps + args.atari_steps // 16,
            samples_per_insert=None,
            compression="zstd",
            frame_stacks={"observation": 4},
        )
    )
    fill_atari(client, args.atari_steps)
    config = DQNConfig(
        batch_size=args.batch_size or 32,
        lr=1e-4,
        double_dqn=True,
        huber=True,
        max_grad_norm=10.0,
        target_update_every=1000,
        **common,
    )
    what = f"Breakout uint8[4, 84, 84], Nature CNN, batch {config.batch_size}, Double DQN"
    return config, what, lambda: nature_cnn_q(*spaces).to(device)


def _setup_from_config(args: argparse.Namespace, client, device: torch.device):
    """:func:`_setup` for CartPole: the table of ``--config``'s capacity, the learner's
    config and network as ``millpond launch`` builds them from that file."""
    from millpond import TableConfig
    from millpond.deploy.launch_config import load_config
    from millpond.deploy.preflight import env_spaces
    from millpond.learner.networks import mlp_q

    overrides = []
    if args.prefetch is not None:
        overrides.append(f"learner.dqn.prefetch={args.prefetch}")
    if args.publish_every is not None:
        overrides.append(f"learner.dqn.publish_every={args.publish_every or NEVER}")
    if args.batch_size is not None:
        overrides.append(f"learner.dqn.batch_size={args.batch_size}")
    launch = load_config(Path(__file__).resolve().parent.parent / args.config, overrides)
    if launch.learner.algorithm != "dqn":
        raise SystemExit(f"{args.config}: learner.algorithm is {launch.learner.algorithm!r}")
    spaces = env_spaces(launch)
    table = launch.replay.table_config()
    client.create_table(TableConfig.uniform(TABLE, table.capacity, samples_per_insert=None))
    fill(client, STEPS)
    config = launch.learner.dqn
    c = launch.learner
    what = (
        f"{launch.env.id} MLP {tuple(c.hidden_sizes)} {c.activation}, batch "
        f"{config.batch_size}, {'Double DQN' if config.double_dqn else 'DQN'}, "
        f"{'Huber' if config.huber else 'squared'} loss ({args.config})"
    )

    def network():  # as make_learner builds it for an MLP
        return mlp_q(*spaces, tuple(c.hidden_sizes), c.dueling, c.activation, c.init).to(device)

    return config, what, network


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="turns of each system")
    parser.add_argument("--calls", type=int, default=300, help="learner steps per turn")
    parser.add_argument(
        "--config",
        default="deploy/configs/cartpole-dqn.yaml",
        help="the launch config whose DQN learner runs (--shape cartpole; relative paths "
        "from the repository's root)",
    )
    parser.add_argument(
        "--prefetch", type=int, help="batches asked ahead (default: the config's; atari 2)"
    )
    parser.add_argument("--shape", choices=("cartpole", "atari"), default="cartpole")
    parser.add_argument("--batch-size", type=int, help="default: 128 cartpole, 32 atari")
    parser.add_argument("--device", default="cpu", help="the learner's torch device")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--atari-steps", type=int, default=20_000, help="frames to store")
    parser.add_argument(
        "--publish-every",
        type=int,
        help="steps between publications (0: none; default: the config's, atari none)",
    )
    args = parser.parse_args()

    import dataclasses

    from millpond import ReplayClient
    from millpond.learner.dqn import DQNLearner

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as scratch, millpond_serve(Path(scratch)) as server:
        client = ReplayClient(server.addresses)
        config, what, network = _setup(args, client, device)
        log(f"filled {client.info(TABLE)['size']} steps")

        through = DQNLearner(client, TABLE, config, network())
        wire_client = ReplayClient(server.addresses, colocated=False)
        wire = DQNLearner(wire_client, TABLE, config, network())
        unpublished = dataclasses.replace(config, publish_every=NEVER)
        every = config.publish_every if config.publish_every < NEVER else 0
        alone = DQNLearner(client, TABLE, unpublished, network())
        batches = itertools.cycle([client.sample(TABLE, config.batch_size) for _ in range(64)])
        alone._batches.next = lambda: next(batches)  # the same step, its batches sampled before
        waits: dict[str, list[float]] = {}

        def timed(name: str, learner: DQNLearner, publish_every: int = NEVER):
            def step() -> None:
                metrics = learner.step()
                if learner.updates % publish_every == 0:
                    learner.publish()
                waits.setdefault(name, []).append(metrics["sample_s"])

            return step

        systems = {
            "service": timed("service", through),
            "service-wire": timed("service-wire", wire),
            "alone": timed("alone", alone),
        }
        turns = {}
        if every:
            in_step = DQNLearner(client, TABLE, unpublished, network())
            systems["service-publish-in-step"] = timed("service-publish-in-step", in_step, every)

            @contextlib.contextmanager
            def publishing(learner: DQNLearner):
                # go on from the versions the other systems published; the last publication
                # stored before the next turn (untimed: one of the turn's calls // N)
                learner.version = int(client.info()["weights_version"])
                yield
                learner.flush()

            for name, learner in [
                ("service", through),
                ("service-wire", wire),
                ("service-publish-in-step", in_step),
            ]:
                turns[name] = functools.partial(publishing, learner)
        lat, wall, cpu = time_in_turns(
            systems, args.reps, args.calls, turns, servers=[server.proc.pid]
        )
        for learner in (through, wire, alone, *([in_step] if every else [])):
            learner.close()
        wire_client.close()
        client.close()

    steps = args.reps * args.calls
    rate = {name: steps / wall[name] for name in wall}
    print(
        f"\nDQN learner steps, {what}, prefetch {config.prefetch}, "
        + (f"publishing every {every} steps, " if every else "")
        + f"on {device}; "
        f"{args.reps} turns of {args.calls} steps; {platform.processor() or platform.machine()}, "
        f"{args.threads} torch thread(s)"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
        + "\n"
    )
    print(
        "| system | steps/s | vs alone | p50 / p99 ms | waiting for the batch "
        "| client CPU ms/step | shard CPU ms/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in systems:
        client_cpu, shard_cpu = cpu[name]
        print(
            f"| {name} | {rate[name]:,.0f} | {rate[name] / rate['alone']:.2f} | "
            f"{1000 * np.percentile(lat[name], 50):.2f} / {1000 * np.percentile(lat[name], 99):.2f} | "
            f"{sum(waits[name]) / wall[name]:.0%} | "
            f"{1000 * client_cpu / steps:.2f} | {1000 * shard_cpu / steps:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
