"""Stable-Baselines3's PPO on CartPole-v1 with rl-zoo's hyperparameters, stopped at a return.

The reference ``benchmarks/train.py --configs sb3-ppo`` runs, each seed in a fresh process
of this script, so that its wall time counts the interpreter and the imports as a launch's
does. rl-zoo's ``hyperparams/ppo.yml`` for CartPole-v1: 8 envs, ``n_steps`` 32, batch size
256, ``gae_lambda`` 0.8, ``gamma`` 0.98, 20 epochs, ``ent_coef`` 0.0, learning rate and clip
range both linear from 0.001 and 0.2, ``MlpPolicy`` with its defaults, no normalisation. The
run stops when the mean return of the last ``--window`` episodes (100 unless told) reaches
``--target`` or at ``--max-frames``; prints one JSON line with the frames and the
seconds since this process started, and the curve of mean returns against frames::

    python benchmarks/sb3_ppo.py --seed 0 --target 450

Needs the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import sys

from _sb3 import learn, parse, parser, process_start


def main() -> int:
    args = parse(parser(__doc__))
    started = process_start()

    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    def linear(start: float):
        return lambda progress_remaining: progress_remaining * start

    env = make_vec_env("CartPole-v1", n_envs=8, seed=args.seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=linear(0.001),
        clip_range=linear(0.2),
        seed=args.seed,
        device="cpu",
        verbose=0,
        stats_window_size=args.window,
    )
    learn(model, args, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
