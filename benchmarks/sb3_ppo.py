"""Stable-Baselines3's PPO on CartPole-v1 with rl-zoo's hyperparameters, stopped at a return.

The reference ``benchmarks/train.py --configs sb3-ppo`` runs, each seed in a fresh process
of this script, so that its wall time counts the interpreter and the imports as a launch's
does. rl-zoo's ``hyperparams/ppo.yml`` for CartPole-v1: 8 envs, ``n_steps`` 32, batch size
256, ``gae_lambda`` 0.8, ``gamma`` 0.98, 20 epochs, ``ent_coef`` 0.0, learning rate and clip
range both linear from 0.001 and 0.2, ``MlpPolicy`` with its defaults, no normalisation. The
run stops when the mean return of the last 100 episodes reaches ``--target`` (SB3's own
100-episode window) or at ``--max-frames``; prints one JSON line with the frames and the
seconds since this process started, and the curve of mean returns against frames::

    python benchmarks/sb3_ppo.py --seed 0 --target 450

Needs the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _process_start() -> float:
    """This process's start (wall clock), the interpreter's start included, as
    ``millpond launch`` counts it (psutil, which comes with Ray and not with SB3, or
    Linux's ``/proc``; else this module's import)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        pass
    try:
        import os

        with open("/proc/self/stat") as f:  # field 22: started, in ticks since boot
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.time() - (up - started_ticks / os.sysconf("SC_CLK_TCK"))
    except Exception:  # pragma: no cover - not Linux
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=450.0)
    p.add_argument("--max-frames", type=int, default=500_000)
    args = p.parse_args()
    started = _process_start()

    import numpy as np
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    def linear(start: float):
        return lambda progress_remaining: progress_remaining * start

    curve: list[tuple[int, float]] = []
    reached: dict[str, float] = {}

    class StopAtReturn(BaseCallback):
        def _on_step(self) -> bool:
            buffer = self.model.ep_info_buffer
            if buffer is None or len(buffer) < 100:
                return True
            mean = float(np.mean([e["r"] for e in buffer]))
            frames = self.model.num_timesteps
            if not curve or frames - curve[-1][0] >= 2048:
                curve.append((frames, mean))
                if len(curve) % 10 == 0:
                    print(f"{frames} frames, mean return {mean:.1f}", file=sys.stderr, flush=True)
            if mean >= args.target:
                curve.append((frames, mean))
                reached.update(frames=frames, seconds=time.time() - started)
                return False
            return True

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
    )
    learn_started = time.time()
    model.learn(total_timesteps=args.max_frames, callback=StopAtReturn())
    ended = time.time()
    result = {
        "frames_to_target": reached.get("frames"),
        "seconds_to_target": reached.get("seconds"),
        "startup_s": learn_started - started,  # the interpreter, the imports, the model
        "frames": model.num_timesteps,
        "wall_s": ended - started,
        "final_return": curve[-1][1] if curve else None,
        "updates": model._n_updates,
        "curve": curve,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
