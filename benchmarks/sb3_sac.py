"""Stable-Baselines3's SAC on Pendulum-v1 with rl-zoo's hyperparameters, stopped at a return.

The reference ``benchmarks/train.py --configs sb3-sac`` runs, each seed in a fresh process
of this script, so that its wall time counts the interpreter and the imports as a launch's
does. rl-zoo's ``hyperparams/sac.yml`` for Pendulum-v1 sets 20,000 frames, ``MlpPolicy``
and a learning rate of 1e-3, and leaves the rest at SAC's defaults: one env, a 1e6-step
buffer, ``learning_starts`` 100, batch size 256, ``tau`` 0.005, ``gamma`` 0.99, one
gradient step per frame (``train_freq`` 1, ``gradient_steps`` 1), the entropy coefficient
learned from 1.0 towards an entropy of -1 (``ent_coef`` and ``target_entropy`` "auto"),
the target networks updated every step, 256x256 networks. One torch thread, as a millpond
learner's default ``learner.threads``.

The run stops when SB3's mean *training* return (actions sampled from the policy) of the
last ``--window`` episodes reaches ``--target`` (``train.py`` passes 10 episodes for
Pendulum-v1, as ``deploy/configs/pendulum-sac.yaml``'s ``run.return_window``), or at
``--max-frames``. The deterministic policy (the squashed mean) is also evaluated over
``--eval-episodes`` episodes on an env of its own (seeded ``seed + 10,000``) every
``--eval-every`` frames (0, the default: only at the end), its time left out of the timed
figures. Prints one JSON line with the frames and the seconds since this process started,
the final training and evaluation returns and both curves::

    python benchmarks/sb3_sac.py --seed 0 --target -200 --window 10 --max-frames 20000

Needs the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import sys

from _sb3 import learn_zoo, parse, parser, process_start

#: rl-zoo's ``hyperparams/sac.yml`` entry for Pendulum-v1, its keys as written there.
ZOO_PENDULUM = {"n_timesteps": 20_000, "policy": "MlpPolicy", "learning_rate": 1e-3}


def main() -> int:
    args = parse(parser(__doc__, eval_every=0))
    started = process_start()

    from stable_baselines3 import SAC

    learn_zoo(SAC, "Pendulum-v1", ZOO_PENDULUM, args, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
