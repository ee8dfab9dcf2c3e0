"""Stable-Baselines3's SAC on Pendulum-v1 or HalfCheetah-v5 with rl-zoo's hyperparameters.

The reference ``benchmarks/train.py --configs sb3-sac`` runs, each seed in a fresh process
of this script, so that its wall time counts the interpreter and the imports as a launch's
does. rl-zoo's ``hyperparams/sac.yml`` for Pendulum-v1 sets 20,000 frames, ``MlpPolicy``
and a learning rate of 1e-3, and leaves the rest at SAC's defaults: one env, a 1e6-step
buffer, ``learning_starts`` 100, batch size 256, ``tau`` 0.005, ``gamma`` 0.99, one
gradient step per frame (``train_freq`` 1, ``gradient_steps`` 1), the entropy coefficient
learned from 1.0 towards an entropy of -1 (``ent_coef`` and ``target_entropy`` "auto"),
the target networks updated every step, 256x256 networks. One torch thread, as a millpond
learner's default ``learner.threads``.

``--env HalfCheetah-v5`` takes rl-zoo's MuJoCo entry instead (``HalfCheetah-v3`` and its
siblings there): 1M frames, ``MlpPolicy``, ``learning_starts`` 10,000, the rest SAC's
defaults (learning rate 3e-4, the entropy aimed at -6), as
``deploy/configs/halfcheetah-sac.yaml`` maps them. ``--learning-starts`` overrides rl-zoo's
(for a short budget, to match a millpond config's ``replay.table.min_size``).

The run stops when SB3's mean *training* return (actions sampled from the policy) of the
last ``--window`` episodes reaches ``--target`` (``train.py`` passes 10 episodes, as
``deploy/configs/pendulum-sac.yaml``'s and ``halfcheetah-sac.yaml``'s
``run.return_window``; no target: never), at ``--max-frames`` or once ``--max-seconds``
passed since the process's start. The deterministic policy (the squashed mean) is also
evaluated over ``--eval-episodes`` episodes on an env of its own (seeded ``seed + 10,000``) every
``--eval-every`` frames (0, the default: only at the end), its time left out of the timed
figures. Prints one JSON line with the frames and the seconds since this process started,
the final training and evaluation returns and both curves::

    python benchmarks/sb3_sac.py --seed 0 --target -200 --window 10 --max-frames 20000
    python benchmarks/sb3_sac.py --env HalfCheetah-v5 --window 10 --max-seconds 480 \
        --learning-starts 1000

Needs the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import sys

from _sb3 import learn_zoo, parse, parser, process_start

#: rl-zoo's ``hyperparams/sac.yml`` entry for Pendulum-v1, its keys as written there.
ZOO_PENDULUM = {"n_timesteps": 20_000, "policy": "MlpPolicy", "learning_rate": 1e-3}
#: Its MuJoCo entry (``HalfCheetah-v3: &mujoco-defaults``), for HalfCheetah-v5.
ZOO_HALFCHEETAH = {"n_timesteps": 1_000_000, "policy": "MlpPolicy", "learning_starts": 10_000}
ZOO = {"Pendulum-v1": ZOO_PENDULUM, "HalfCheetah-v5": ZOO_HALFCHEETAH}


def main() -> int:
    p = parser(__doc__, eval_every=0, target=None)
    p.add_argument("--env", choices=list(ZOO), default="Pendulum-v1")
    p.add_argument("--learning-starts", type=int, help="default: rl-zoo's for the env")
    args = parse(p)
    if args.learning_starts is not None and args.learning_starts < 0:
        p.error(f"--learning-starts ({args.learning_starts}) must be >= 0")
    started = process_start()

    from stable_baselines3 import SAC

    hyper = dict(ZOO[args.env])
    if args.learning_starts is not None:
        hyper["learning_starts"] = args.learning_starts
    learn_zoo(SAC, args.env, hyper, args, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
