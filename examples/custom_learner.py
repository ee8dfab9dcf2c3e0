"""Connect a learner of your own to a standalone ``millpond serve``: DQN with a TorchRL loss.

millpond stores and serves the experience; the learning is yours. This example trains
DQN on CartPole-v1 with TorchRL's ``DQNLoss``, fed straight from ``client.iterate``: every
sampled batch is already a TorchRL TED TensorDict (``"observation"``, ``"action"`` as an
int64 index, ``("next", "observation")``, ``("next", "reward")``, ``("next", "done")``,
``("next", "terminated")``, ...), so the loss takes it as is.

TorchRL is not a dependency of millpond; install it with ``pip install 'millpond[bench]'``
(or ``pip install torchrl``). Then run a server in one terminal and the example in another::

    millpond serve --dir /tmp/replay --port 50051
    python examples/custom_learner.py --replay 127.0.0.1:50051

With ``millpond serve ... --shards N``, pass the address list the server prints
(``--replay 127.0.0.1:50051,127.0.0.1:50052``); add ``--token`` when it checks tokens.

What happens:

1. The learner creates a uniform replay table on every shard and publishes its initial
   Q-network weights (shard 0 keeps them for the actors).
2. An actor, millpond's Ray-free :class:`~millpond.actors.Collector` stepping four CartPole
   lanes, acts epsilon-greedily with the latest published weights (``weight_source=client``)
   and writes compact segments through a :class:`~millpond.Writer`. A writer is pinned to
   one shard, so with several shards the others stay empty: more actors spread the data.
3. The learner samples batches, takes DQN steps (Double DQN, soft target updates) and
   publishes its weights after every chunk; the actor loads them before its next chunk.

In a deployment the actors run elsewhere (millpond's Ray ``ActorFleet``, or any process
with a writer) and the table's ``samples_per_insert`` lets the server pace the learner
against them. Here one actor runs in this process, interleaved with the learner: a chunk
of 64 frames, then ``UPDATES_PER_CHUNK`` batches of ``BATCH`` (32 samples per inserted
step). The loop keeps that ratio itself, so the table has no rate limit, which could
otherwise hold back this single thread's own inserts or samples and stall it.
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import torch
from torchrl.modules import QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector, EpsilonGreedy, ReturnTracker
from millpond.learner.networks import mlp_q

ENV = "CartPole-v1"
LANES, CHUNK = 4, 16  # the actor's vector env: a chunk is 16 steps of 4 lanes, 64 frames
WARMUP = 1_000  # frames stored before learning starts (the table's min_size)
BATCH = 128
UPDATES_PER_CHUNK = 16  # one gradient step per 4 frames
LOG_EVERY = 32 * LANES * CHUNK  # frames between progress lines (2048)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replay", required=True, help="HOST:PORT[,HOST:PORT...] of the shards")
    p.add_argument("--frames", type=int, default=30_000, help="env steps to collect")
    p.add_argument("--table", default="custom-learner-dqn", help="replay table name")
    p.add_argument("--token", help="bearer token, if the server checks tokens")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # tiny networks: one thread is fastest
    torch.manual_seed(args.seed)

    # The learner's network, and TorchRL's loss around it. The actor builds its own copy
    # from the same factory (mlp_q), so the state dicts match.
    env = gym.make(ENV)
    q_net = mlp_q(env.observation_space, env.action_space)
    env.close()
    value_net = QValueActor(q_net, in_keys=["observation"], action_space="categorical")
    loss_module = DQNLoss(
        value_net, action_space="categorical", double_dqn=True, loss_function="smooth_l1"
    )
    loss_module.make_value_estimator(gamma=0.99)
    target_updater = SoftUpdate(loss_module, tau=0.01)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-3)

    client = ReplayClient(args.replay, token=args.token)
    # An identical existing table is fine: a rerun adds to what a previous run stored.
    # (Prioritized replay: TableConfig.prioritized(...), loss_module.set_keys(priority_weight=
    # "weight"), and client.update_priorities(table, batch["index"], batch["td_error"]).)
    client.create_table(TableConfig.uniform(args.table, capacity=100_000, min_size=WARMUP))
    # A server keeps the latest weights across runs; a new version must be newer (-1: none).
    version = client.info()["weights_version"]
    version = client.publish_weights(q_net.state_dict(), version + 1)

    collector = Collector(
        ENV,
        client.writer(args.table),
        num_envs=LANES,
        chunk_len=CHUNK,
        policy=mlp_q,  # called with the env's spaces; acts by argmax Q ...
        deterministic=True,
        epsilon=EpsilonGreedy(1.0, 0.05, decay_frames=args.frames // 3),  # ... or at random
        weight_source=client,  # loads each newly published version
        weight_sync_every=CHUNK,  # look for one before every chunk
        seed=args.seed,
    )
    returns, episodes = ReturnTracker(LANES, window=20), 0
    batches = None  # client.iterate(...), once the table holds WARMUP frames
    loss = torch.tensor(float("nan"))
    try:
        while collector.frames < args.frames:
            returns.update(collector.run_chunk())
            episodes += len(returns.drain())  # episodes finished in this chunk
            if collector.frames >= WARMUP:
                if batches is None:  # keeps 4 sample requests in flight from now on
                    batches = client.iterate(args.table, BATCH)
                for _ in range(UPDATES_PER_CHUNK):
                    loss = loss_module(next(batches))["loss"]
                    optimizer.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(loss_module.parameters(), 10.0)
                    optimizer.step()
                    target_updater.step()
                version = client.publish_weights(q_net.state_dict(), version + 1)
            if collector.frames % LOG_EVERY == 0:
                mean = returns.mean_return
                print(
                    f"frames {collector.frames:6d}  episodes {episodes:5d}  "
                    f"mean return {float('nan') if mean is None else mean:6.1f}  "
                    f"loss {loss.item():.4f}  weights v{collector.policy_version}",
                    flush=True,
                )
    finally:
        if batches is not None:
            batches.close()  # cancels the prefetched requests
        collector.close()  # flushes the writer: every segment is stored
    info = client.info(args.table)
    client.close()
    per_shard = [shard.get("size") for shard in info["shards"]]
    print(f"table {args.table!r} holds {info['size']} steps (per shard: {per_shard})")
    mean = returns.mean_return
    print(
        f"mean return {float('nan') if mean is None else mean:.1f} over the last "
        f"{len(returns.recent)} episodes"
    )


if __name__ == "__main__":
    main()
