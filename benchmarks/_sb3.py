"""What the Stable-Baselines3 references (``sb3_ppo.py``, ``sb3_dqn.py``, ``sb3_sac.py``)
share: the process's start, their command line, and a run of ``model.learn`` that follows
SB3's mean return over the last ``--window`` episodes, stops at the target (if any) or once
``--max-seconds`` passed since the process's start, evaluates the deterministic policy where
asked, and prints the result as one JSON line for
``benchmarks/train.py``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_IMPORTED_AT = time.time()


def process_start() -> float:
    """This process's start (wall clock), the interpreter's start included, as
    ``millpond launch`` counts it (psutil, which comes with Ray and not with SB3, or
    Linux's ``/proc``; else this module's import)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        pass
    try:
        with open("/proc/self/stat") as f:  # field 22: started, in ticks since boot
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.time() - (up - started_ticks / os.sysconf("SC_CLK_TCK"))
    except Exception:  # pragma: no cover - not Linux
        return _IMPORTED_AT


def parser(
    doc: str | None, eval_every: int | None = None, target: float | None = 450.0
) -> argparse.ArgumentParser:
    """``--seed``, ``--target`` (``target`` by default; ``None``: no target, the budget
    alone stops the run), ``--max-frames``, ``--max-seconds`` and ``--window``, as
    ``train.py`` passes them; with ``eval_every``, also ``--eval-every`` (that the default) and
    ``--eval-episodes`` for the deterministic policy's evaluation (see :func:`learn`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=target)
    p.add_argument("--max-frames", type=int, default=500_000)
    p.add_argument(
        "--max-seconds",
        type=float,
        help="stop once this many seconds passed since the process's start (none: no limit)",
    )
    p.add_argument(
        "--window", type=int, default=100, help="episodes the mean return averages (>= 1)"
    )
    if eval_every is not None:
        p.add_argument(
            "--eval-every", type=int, default=eval_every, help="frames; 0: at the end only"
        )
        p.add_argument("--eval-episodes", type=int, default=10)
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """``p``'s arguments, refusing a budget, a window or an evaluation out of range."""
    args = p.parse_args()
    if args.max_frames < 1 or args.window < 1:
        p.error("--max-frames and --window must be >= 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        p.error(f"--max-seconds ({args.max_seconds}) must be > 0")
    if getattr(args, "eval_every", 0) < 0 or getattr(args, "eval_episodes", 1) < 1:
        p.error("--eval-every must be >= 0 and --eval-episodes >= 1")
    return args


def learn(
    model,
    args: argparse.Namespace,
    started: float,
    eval_env=None,
    eval_every: int = 0,
    eval_episodes: int = 10,
) -> dict:
    """``model.learn`` for at most ``args.max_frames`` frames, stopped when SB3's mean return
    of the last ``args.window`` episodes reaches ``args.target`` (unless ``None``) or once
    ``args.max_seconds`` (unless ``None``) passed since ``started``, the evaluations' time
    left out (``stopped_by``: ``return``, ``time`` or ``frames``); prints and returns the
    result. The model keeps that many (``stats_window_size=args.window``) or it is refused.

    With ``eval_env``, the deterministic policy is also evaluated over ``eval_episodes``
    episodes on it every ``eval_every`` frames (none if 0) and once at the end: the mean
    returns go to ``eval_curve`` and the last to ``eval_return``. The evaluations' time
    (``eval_s``) is left out of ``seconds_to_target`` and ``wall_s``, which time the
    training alone, as for the other configs; a deterministic prediction draws no random
    number, so the training runs the same with or without them."""
    import numpy as np
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    curve: list[tuple[int, float]] = []
    eval_curve: list[tuple[int, float]] = []
    reached: dict[str, float] = {}
    out_of_time = [False]
    eval_s = [0.0]
    spacing = min(2048, max(1, args.max_frames // 100))  # frames between the curve's points

    def evaluate(frames: int) -> None:
        t0 = time.time()
        mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=eval_episodes)
        eval_s[0] += time.time() - t0
        eval_curve.append((frames, float(mean)))
        print(f"{frames} frames, deterministic evaluation {mean:.1f}", file=sys.stderr, flush=True)

    if model._stats_window_size != args.window:  # else its mean would cover other episodes
        raise SystemExit(
            f"the model keeps the returns of {model._stats_window_size} episodes, the window "
            f"is {args.window}: build it with stats_window_size=args.window"
        )

    def mean_return() -> float | None:
        """SB3's mean return of the last ``args.window`` episodes (None before that many
        have ended)."""
        buffer = model.ep_info_buffer
        if buffer is None or len(buffer) < args.window:
            return None
        return float(np.mean([e["r"] for e in buffer]))

    class StopAtReturn(BaseCallback):
        def _on_step(self) -> bool:
            frames = self.model.num_timesteps
            if (
                eval_env is not None
                and eval_every
                and frames % eval_every < self.training_env.num_envs
            ):
                evaluate(frames)
            if (
                args.max_seconds is not None
                and time.time() - started - eval_s[0] >= args.max_seconds
            ):
                out_of_time[0] = True
                return False
            mean = mean_return()
            if mean is None:
                return True
            if not curve or frames - curve[-1][0] >= spacing:
                curve.append((frames, mean))
                if len(curve) % 10 == 0:
                    print(f"{frames} frames, mean return {mean:.1f}", file=sys.stderr, flush=True)
            if args.target is not None and mean >= args.target:
                if curve[-1][0] != frames:
                    curve.append((frames, mean))
                reached.update(frames=frames, seconds=time.time() - started - eval_s[0])
                return False
            return True

    learn_started = time.time()
    model.learn(total_timesteps=args.max_frames, callback=StopAtReturn())
    ended = time.time()
    wall = ended - started - eval_s[0]
    last = mean_return()  # the curve's points are `spacing` apart: the last one may be stale
    if last is not None and (not curve or curve[-1][0] != model.num_timesteps):
        curve.append((model.num_timesteps, last))
    if eval_env is not None and (not eval_curve or eval_curve[-1][0] != model.num_timesteps):
        evaluate(model.num_timesteps)
    stopped_by = "return" if reached else "time" if out_of_time[0] else "frames"
    result = {
        "stopped_by": stopped_by,
        "frames_to_target": reached.get("frames"),
        "seconds_to_target": reached.get("seconds"),
        "startup_s": learn_started - started,  # the interpreter, the imports, the model
        "frames": model.num_timesteps,
        "wall_s": wall,
        "final_return": curve[-1][1] if curve else None,
        "eval_return": eval_curve[-1][1] if eval_curve else None,
        "eval_s": eval_s[0],
        "updates": model._n_updates,
        "curve": curve,
        "eval_curve": eval_curve,
    }
    print(json.dumps(result))
    return result


def learn_zoo(algorithm, env_id: str, hyper: dict, args: argparse.Namespace, started: float):
    """SB3's ``algorithm`` (its class) with rl-zoo's ``hyper`` (its keys as its yml writes
    them, ``policy`` among them; ``n_timesteps`` is left out, the budget being
    ``args.max_frames``) on one env of ``env_id`` seeded ``args.seed``, on the CPU with one
    torch thread, through :func:`learn`; its deterministic policy is evaluated on an env of
    its own (seeded ``args.seed + 10,000``) as ``args.eval_every`` and
    ``args.eval_episodes`` say."""
    import torch
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)
    hyper = {k: v for k, v in hyper.items() if k != "n_timesteps"}
    policy = hyper.pop("policy")
    env = make_vec_env(env_id, n_envs=1, seed=args.seed)
    eval_env = make_vec_env(env_id, n_envs=1, seed=args.seed + 10_000)
    model = algorithm(
        policy, env, seed=args.seed, device="cpu", verbose=0, stats_window_size=args.window, **hyper
    )
    return learn(model, args, started, eval_env, args.eval_every, args.eval_episodes)
