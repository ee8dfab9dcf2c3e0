"""Stable-Baselines3's DQN on CartPole-v1 with rl-zoo's hyperparameters, stopped at a return.

The reference ``benchmarks/train.py --configs sb3-dqn`` runs, each seed in a fresh process
of this script, so that its wall time counts the interpreter and the imports as a launch's
does. rl-zoo's ``hyperparams/dqn.yml`` for CartPole-v1 ("almost tuned", for 50,000 frames):
one env, ``MlpPolicy`` with ``net_arch`` [256, 256], learning rate 2.3e-3 (constant), batch
size 64, a 100,000-step buffer, ``learning_starts`` 1,000, ``gamma`` 0.99,
``target_update_interval`` 10, ``train_freq`` 256 and ``gradient_steps`` 128 (128 gradient
steps after every 256 frames), ``exploration_fraction`` 0.16 and ``exploration_final_eps``
0.04. SB3 spans the exploration over a fraction of the frames ``learn`` is given; rl-zoo's
0.16 of its 50,000 frames is epsilon from 1 down to 0.04 over the first 8,000 frames, and so
it is here whatever ``--max-frames`` is (the fraction passed is 8,000 / ``--max-frames``),
epsilon staying at 0.04 after. One torch thread.

The run stops when SB3's mean *training* return of the last ``--window`` episodes (100
unless told; epsilon-greedy, as every config of ``train.py`` is compared) reaches ``--target``, or at ``--max-frames``.
rl-zoo reports a different measure: the return of the deterministic (greedy) policy on an
evaluation env (its training evaluates every 25,000 frames over 5 episodes). So this script
also evaluates the greedy policy over ``--eval-episodes`` episodes on an env of its own
(seeded ``seed + 10,000``) every ``--eval-every`` frames and once at the end, its time left
out of the timed figures. Prints one JSON line with the frames and the seconds since this
process started, the final training and evaluation returns and both curves::

    python benchmarks/sb3_dqn.py --seed 0 --target 475

Needs the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import sys

from _sb3 import learn_zoo, parse, parser, process_start

#: rl-zoo's ``hyperparams/dqn.yml`` entry for CartPole-v1, its keys as written there.
ZOO_CARTPOLE = {
    "n_timesteps": 50_000,
    "policy": "MlpPolicy",
    "learning_rate": 2.3e-3,
    "batch_size": 64,
    "buffer_size": 100_000,
    "learning_starts": 1_000,
    "gamma": 0.99,
    "target_update_interval": 10,
    "train_freq": 256,
    "gradient_steps": 128,
    "exploration_fraction": 0.16,
    "exploration_final_eps": 0.04,
    "policy_kwargs": {"net_arch": [256, 256]},
}


def main() -> int:
    args = parse(parser(__doc__, eval_every=25_000))
    started = process_start()

    from stable_baselines3 import DQN

    hyper = dict(ZOO_CARTPOLE)
    # SB3 spans the exploration over a fraction of the frames `learn` is given, rl-zoo's
    # over its own 50k: the same 8,000 frames here, whatever the budget.
    explore_frames = hyper["exploration_fraction"] * hyper["n_timesteps"]
    hyper["exploration_fraction"] = min(1.0, explore_frames / args.max_frames)
    learn_zoo(DQN, "CartPole-v1", hyper, args, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
