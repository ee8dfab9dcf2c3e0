"""``millpond eval RUN_DIR``: play a run's trained policy and print its mean return.

The policy is the run's ``checkpoint.pt``, rebuilt from its ``config.yaml``
(:func:`~millpond.deploy.trained_policy.load_policy`), playing greedily (PPO: the mode of
its policy; DQN: ``argmax Q``) in the run's env with the run's wrappers. Episode ``i``
starts from ``reset(seed=SEED + i)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["build_parser", "run"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``millpond eval`` command line, added to ``parser`` (or a parser of its own)."""
    p = parser or argparse.ArgumentParser(prog="millpond eval", description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a millpond launch run directory")
    p.add_argument("--episodes", type=int, default=10, help="episodes to play (default 10)")
    p.add_argument("--seed", type=int, default=0, help="episode i resets with SEED + i (0)")
    video = "record each episode as a video in DIR (gymnasium's RecordVideo; needs moviepy)"
    p.add_argument("--video", metavar="DIR", help=video)
    p.add_argument(
        "--env",
        metavar="ID",
        help="play in this gymnasium env instead of the run's (the run's env kwargs and "
        "wrappers applied; its spaces must be the run's)",
    )
    p.add_argument(
        "--sample",
        action="store_true",
        help="sample the policy's actions instead of taking its mode (PPO; seeded by --seed)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Evaluate the run of ``args``; prints each episode and the mean ± std return."""
    # Deferred: imports torch and the env packages (the CLI lists commands without them).
    from millpond.deploy.evaluation import evaluate
    from millpond.deploy.trained_policy import load_policy

    policy = load_policy(args.run_dir, deterministic=not args.sample, seed=args.seed)
    c = policy.config
    how = "sampling" if args.sample else "greedy"
    print(
        f"eval {Path(args.run_dir)}: {c.learner.algorithm} policy (weights version "
        f"{policy.version}), {how}, on {args.env or c.env.id}",
        flush=True,
    )
    result = evaluate(policy, args.episodes, seed=args.seed, env_id=args.env, video_dir=args.video)
    assert result is not None  # not cancelled
    for i, (ret, steps) in enumerate(zip(result.returns, result.lengths)):
        print(f"  episode {i + 1} (seed {args.seed + i}): return {ret:g} in {steps} steps")
    if args.video:
        print(f"videos: {args.video}")
    print(result.line(), flush=True)
    return 0
