"""Training benchmark: frames and wall time to reach a mean return (CartPole-v1, Pendulum-v1),
or what a fixed wall-time budget buys (HalfCheetah-v5).

Runs ``millpond launch`` for each shipped config, each seed in a fresh process (``python -m
millpond.cli launch``), on a local Ray instance with ``ray.num_cpus`` CPUs, stopping when the
mean return over the last ``--window`` episodes reaches ``--target`` or at ``--max-frames``,
and reports per config and seed:

* frames and wall-clock seconds to the target (``-`` if not reached), the seconds counted
  from the process's start (the interpreter, the imports and the job's startup included), and
  of those the startup: until the first inserted step (``startup_s`` in ``summary.json``);
* the final return: the mean training return of the last ``--window`` episodes
  (exploration on, as the target is measured), and ``eval return``, the mean return of the
  deterministic policy on an evaluation env (``-`` where a config has no evaluation: all but
  ``sb3-dqn`` and ``sb3-sac``);
* end-to-end frames/s (collected frames over the training loop's wall time);
* the pipeline's share of time: the actors' time split between acting (env + policy) and
  inserting (cutting, processing, handing segments to the writer, which blocks when the
  writer's window or the table's rate limiter is full), and the learner's time split between
  waiting for samples and learning (loss, backward, optimiser, publishing weights).

``ppo-2learners`` is the PPO config with ``learner.num_learners=2`` (data-parallel), each rank
sampling 512-step batches in 256-row minibatches: the same global batch (1,024 steps) and
minibatches (512 rows) as one learner.

``cleanrl-dqn`` runs the single-process reference of ``benchmarks/cleanrl_dqn.py``
(CleanRL's DQN: one env, no Ray, no millpond), one process per seed timed from that
process's start as a launch is, with the same seeds, target and frame budget (its epsilon schedule spans half of ``--max-frames``, as CleanRL's spans
half of its ``total_timesteps``), so that millpond's DQN can be read against the algorithm
it follows; it has no actors or sampling to split, and its learner steps are its gradient
steps.

``sb3-ppo`` runs Stable-Baselines3's PPO with rl-zoo's CartPole-v1 hyperparameters
(``benchmarks/sb3_ppo.py``, the ``bench`` extra), one process per seed, timed from that
process's start as a launch is; its learner steps are its gradient steps.

``sb3-dqn`` runs Stable-Baselines3's DQN with rl-zoo's CartPole-v1 hyperparameters
(``benchmarks/sb3_dqn.py``) the same way, with one torch thread; its epsilon falls from 1 to
0.04 over the first 8,000 frames whatever ``--max-frames`` is (rl-zoo's exploration fraction
0.16 of its 50,000 frames). It stops at the same 100-episode *training* return as the rest;
rl-zoo's own figure is the deterministic policy's return, which it also measures (10
episodes on an env of its own, every 25,000 frames and at the end: ``eval return``, the
curve in ``eval_curve``), the evaluations' time (``eval_s``) left out of its seconds and
frames/s.

The configs of one run train one env, compared on one target and window: ``ppo``,
``ppo-2learners``, ``dqn`` and the references ``cleanrl-dqn``, ``sb3-ppo`` and ``sb3-dqn``
CartPole-v1 (by default a target of 475 over 100 episodes); ``sac``
(``deploy/configs/pendulum-sac.yaml``), ``td3`` (``pendulum-td3.yaml``) and the reference
``sb3-sac`` Pendulum-v1 (by default -200 over 10 episodes, the configs' ``run.return_window``).
``--target`` and ``--window`` apply alike to every config of the run (``run.return_window``
of a launch, the references' own windows); configs of different envs in one run are refused.

``sb3-sac`` runs Stable-Baselines3's SAC with rl-zoo's Pendulum-v1 hyperparameters
(``benchmarks/sb3_sac.py``) the same way as ``sb3-dqn``, with one torch thread, its
deterministic policy evaluated over 10 episodes at the end (``eval return``).

``halfcheetah-sac`` (``deploy/configs/halfcheetah-sac.yaml``) and ``sb3-sac`` train
HalfCheetah-v5 (``sb3-sac`` takes the env of the run's millpond configs: rl-zoo's MuJoCo
entry there), by default with no target (a fixed-budget run) over 10 episodes.
``--max-seconds S`` gives every config and reference of the run the same wall time, from its
process's start to its stop: a reference stops itself once ``S`` seconds passed, a launch is
sent SIGTERM ``S`` seconds after its process started and stops cleanly (its summary written,
``stopped_by: interrupted``). ``--learning-starts N`` sets ``replay.table.min_size`` of the
millpond configs and SB3's ``learning_starts`` alike (SAC and TD3 runs only).

The runs go seed by seed, each seed's configs back to back (``--configs`` order), so that a
machine whose speed drifts during the run weighs on every config alike; with a reference
(``cleanrl-dqn``, ``sb3-*``) in the run, a table gives each other config's seconds to the
target over the reference's, seed by seed, and their median.

Every run also gets a budget table (and its medians): frames reached, seconds from the
process's start to the stop, frames/s and learner updates/s over those seconds (startup
included), the final training return and the evaluation's. A launch's frames and steps are
counted at its shutdown: a few after its decision to stop are in.

Writes ``train.md`` (the table and the medians), ``train.json`` and ``train.png`` (mean
return against frames for every run) into ``--out``::

    python benchmarks/train.py                      # ppo and dqn, 1 seed
    python benchmarks/train.py --configs ppo sb3-ppo --seeds 3 --target 450
    python benchmarks/train.py --configs ppo ppo-2learners --seeds 3 --target 450
    python benchmarks/train.py --configs dqn cleanrl-dqn --seeds 3
    python benchmarks/train.py --configs dqn sb3-dqn --seeds 3
    python benchmarks/train.py --configs sac sb3-sac --seeds 3 --max-frames 20000
    python benchmarks/train.py --configs sac td3 --seeds 3 --target -200 --window 10
    python benchmarks/train.py --configs ppo --set learner.ppo.epochs=10 --out /tmp/try
    python benchmarks/train.py --configs halfcheetah-sac sb3-sac --max-seconds 480 \
        --learning-starts 1000
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import code_version, log  # noqa: E402

CONFIGS = {  # a config and the overrides of its variant
    "ppo": (ROOT / "deploy" / "configs" / "cartpole-ppo.yaml", []),
    "ppo-2learners": (
        ROOT / "deploy" / "configs" / "cartpole-ppo.yaml",
        # Each rank half of one learner's batch and minibatch: the same global update.
        ["learner.num_learners=2", "learner.ppo.batch_size=512", "learner.ppo.minibatch_size=256"],
    ),
    "dqn": (ROOT / "deploy" / "configs" / "cartpole-dqn.yaml", []),
    "sac": (ROOT / "deploy" / "configs" / "pendulum-sac.yaml", []),
    "td3": (ROOT / "deploy" / "configs" / "pendulum-td3.yaml", []),
    "halfcheetah-sac": (ROOT / "deploy" / "configs" / "halfcheetah-sac.yaml", []),
}
# Single-process references, each seed a process of its own (their scripts).
SCRIPTS = {
    "cleanrl-dqn": "cleanrl_dqn.py",
    "sb3-ppo": "sb3_ppo.py",
    "sb3-dqn": "sb3_dqn.py",
    "sb3-sac": "sb3_sac.py",
}
REFERENCES = tuple(SCRIPTS)
# The envs a reference trains: the run's millpond configs' env if among them, else the first.
REFERENCE_ENVS = {
    "cleanrl-dqn": ("CartPole-v1",),
    "sb3-ppo": ("CartPole-v1",),
    "sb3-dqn": ("CartPole-v1",),
    "sb3-sac": ("Pendulum-v1", "HalfCheetah-v5"),
}
# Per env: the default target (None: none, a fixed-budget run) and the episodes its mean
# return averages.
ENV_DEFAULTS = {
    "CartPole-v1": (475.0, 100),
    "Pendulum-v1": (-200.0, 10),
    "HalfCheetah-v5": (None, 10),
}
# Off-policy configs whose learning starts at a replay size (--learning-starts).
_LEARNING_STARTS = {"sac", "td3", "halfcheetah-sac", "sb3-sac"}
# A reference has no actors or sampling whose time to split.
_NO_PIPELINE = dict.fromkeys(
    ("actors_acting", "actors_inserting", "learner_sampling", "learner_learning")
)


def env_of(name: str, run_env: str | None = None) -> str:
    """The env config ``name`` trains (a millpond config's ``env.id``); a reference's is
    ``run_env`` (the run's millpond configs') where it trains that one."""
    if name in REFERENCE_ENVS:
        envs = REFERENCE_ENVS[name]
        return run_env if run_env in envs else envs[0]
    import yaml

    return yaml.safe_load(CONFIGS[name][0].read_text())["env"]["id"]


def run_one(name: str, seed: int, args: argparse.Namespace, work: Path) -> dict:
    """``millpond launch`` in a fresh process, timed from that process's start."""
    path, extra = CONFIGS[name]
    overrides = [
        f"run.seed={seed}",
        *([] if args.target is None else [f"run.stop_at_return={args.target}"]),
        *(
            []
            if args.learning_starts is None
            else [f"replay.table.min_size={args.learning_starts}"]
        ),
        f"run.frames={args.max_frames}",
        f"run.return_window={args.window}",
        f"ray.num_cpus={args.num_cpus}",
        "run.status_every_s=2",
        "run.eval_episodes=0",  # the time measured is the training's, with no evaluation after
        *extra,
        *args.set,
    ]
    run_dir = work / f"{name}-{seed}"
    log(f"{name} seed {seed}: launching ({_budget(args)})")
    command = [sys.executable, "-m", "millpond.cli", "launch", str(path), "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    launched = time.time()
    # SIGTERM stops a launch cleanly, its summary written (exit status 130).
    process_wall = _stream(command, f"  {name}/{seed} ", args.max_seconds)[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    # The job's times count from its command line's start; the interpreter's start before
    # it counts here too, as it does for the single-process references.
    before = max(0.0, summary.get("started_at", launched) - launched)
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    reached = next(
        (
            r
            for r in rows
            if args.target is not None
            and r["mean_return"]
            and float(r["mean_return"]) >= args.target
        ),
        None,
    )
    startup = summary.get("startup_s") or {}
    # The job stops as soon as the return is reached (the status rows come only every 2 s):
    # when it decided to stop is the time to the target. Its shutdown (actors flushed,
    # learners and shards stopped) is not counted.
    seconds = None
    if summary["stopped_by"] == "return" and summary.get("stopped_at_s") is not None:
        seconds = summary["stopped_at_s"] + before
    frames = summary["frames"] if summary["stopped_by"] == "return" else None
    if frames is None and reached:
        frames = int(reached["frames"])
    act, write = summary["actors_act_s"], summary["actors_write_s"]
    wait, learn = summary["learner_sample_s"], summary["learner_update_s"]
    stopped_by = summary["stopped_by"]
    if stopped_by == "interrupted" and args.max_seconds is not None:
        stopped_by = "time"  # the SIGTERM sent at the budget's end
    stop_s = summary.get("stopped_at_s")
    stop_s = None if stop_s is None else stop_s + before
    return {
        "config": name,
        "seed": seed,
        "stopped_by": stopped_by,
        "stop_s": stop_s,
        "frames_to_target": frames,
        "seconds_to_target": seconds,
        "startup_s": startup["first_insert"] + before if "first_insert" in startup else None,
        "startup": startup,
        # As SB3's: none before a whole window of episodes ended.
        "final_return": summary["mean_return"] if summary["episodes"] >= args.window else None,
        "eval_return": None,
        "frames": summary["frames"],
        "wall_s": summary["wall_s"],
        "process_s": process_wall,
        "frames_per_s": summary["frames_per_s"],
        "actors_acting": act / (act + write) if act + write else None,
        "actors_inserting": write / (act + write) if act + write else None,
        "learner_sampling": wait / (wait + learn) if wait + learn else None,
        "learner_learning": learn / (wait + learn) if wait + learn else None,
        "learner_steps": summary["learner_steps"],
        "curve": [(int(r["frames"]), float(r["mean_return"])) for r in rows if r["mean_return"]],
    }


def run_reference(name: str, seed: int, args: argparse.Namespace) -> dict:
    """A single-process reference (``benchmarks/cleanrl_dqn.py``, ``sb3_ppo.py``,
    ``sb3_dqn.py``, ``sb3_sac.py``) in a fresh process, timed from that process's start."""
    log(f"{name} seed {seed}: running ({_budget(args)})")
    script = str(ROOT / "benchmarks" / SCRIPTS[name])
    command = [sys.executable, script, "--seed", str(seed), "--window", str(args.window)]
    if name == "cleanrl-dqn":
        command += ["--frames", str(args.max_frames), "--json"]
    else:
        command += ["--max-frames", str(args.max_frames)]
    if args.target is not None:
        command += ["--target", str(args.target)]
    if args.max_seconds is not None:
        command += ["--max-seconds", str(args.max_seconds)]
    if name == "sb3-sac":
        command += ["--env", args.env]
        if args.learning_starts is not None:
            command += ["--learning-starts", str(args.learning_starts)]
    lines, process_wall = _stream(command, f"  {name}/{seed} ")
    run = json.loads(lines[-1])
    return {
        "config": name,
        "seed": seed,
        "stopped_by": run["stopped_by"],
        "stop_s": run["wall_s"],  # from the process's start, the evaluations' time left out
        "frames_to_target": run["frames_to_target"],
        "seconds_to_target": run["seconds_to_target"],
        "startup_s": run["startup_s"],
        "final_return": run["final_return"],
        "eval_return": run["eval_return"],
        "eval_s": run["eval_s"],
        "frames": run["frames"],
        "wall_s": run["wall_s"],
        "process_s": process_wall,
        # CleanRL's over its training loop (loop_s), as a launch's are; SB3's over wall_s
        "frames_per_s": run["frames"] / run.get("loop_s", run["wall_s"]),
        **_NO_PIPELINE,
        "learner_steps": run["updates"],
        "curve": run["curve"],
        "eval_curve": run["eval_curve"],
    }


def _budget(args: argparse.Namespace) -> str:
    target = "no target" if args.target is None else f"target {args.target:g}"
    seconds = "" if args.max_seconds is None else f", at most {args.max_seconds:g} s"
    return f"{target}, at most {args.max_frames} frames{seconds}"


def _stream(
    command: list[str], prefix: str, terminate_after_s: float | None = None
) -> tuple[list[str], float]:
    """Run ``command``, echoing its output indented; returns its stdout lines and wall time.
    With ``terminate_after_s``, it is sent SIGTERM that many seconds after its start, and
    exit status 130 (a launch's, stopped so) counts as success."""
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = None
    if terminate_after_s is not None:
        timer = threading.Timer(terminate_after_s, process.terminate)
        timer.start()
    lines = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.strip() and not line.startswith("{"):
                print(prefix + line, flush=True)
        status = process.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if status != 0 and not (timer is not None and status == 130):
        raise SystemExit(f"{' '.join(command)} failed ({status})")
    return lines, time.monotonic() - started


def _fmt(value, spec=".0f"):
    return "-" if value is None else format(value, spec)


def table(results: list[dict], target: float | None) -> str:
    """The time-to-target table and its medians (with a target), then the budget's."""
    if target is None:
        return budget_table(results)
    fmt = _fmt
    lines = [
        f"| config | seed | frames to {target:g} | seconds to {target:g} | of which startup | "
        "final return | eval return | frames/s | actors: acting / inserting | learner: sampling / learning "
        "| learner steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['seed']} | {fmt(r['frames_to_target'])} | "
            f"{fmt(r['seconds_to_target'], '.1f')} | {fmt(r.get('startup_s'), '.1f')} | "
            f"{fmt(r['final_return'], '.1f')} | {fmt(r.get('eval_return'), '.1f')} | "
            f"{fmt(r['frames_per_s'])} | {fmt(r['actors_acting'], '.0%')} / "
            f"{fmt(r['actors_inserting'], '.0%')} | {fmt(r['learner_sampling'], '.0%')} / "
            f"{fmt(r['learner_learning'], '.0%')} | {r['learner_steps']} |"
        )
    lines += ["", medians(results, target)]
    pairs = paired(results)
    if pairs:
        lines += ["", pairs]
    lines += ["", budget_table(results)]
    return "\n".join(lines)


def paired(results: list[dict]) -> str:
    """Each config's seconds to the target over the run's reference's, seed by seed (the two
    ran back to back), and their median: ``""`` where the run has no reference, or no other
    config."""
    reference = next((r["config"] for r in results if r["config"] in REFERENCES), None)
    if reference is None:
        return ""
    base = {r["seed"]: r["seconds_to_target"] for r in results if r["config"] == reference}
    lines = []
    for name in dict.fromkeys(r["config"] for r in results if r["config"] != reference):
        ratios = {
            r["seed"]: r["seconds_to_target"] / base[r["seed"]]
            for r in results
            if r["config"] == name
            and r["seconds_to_target"] is not None
            and base.get(r["seed"]) is not None
        }
        each = ", ".join(f"{seed}: {ratio:.2f}x" for seed, ratio in sorted(ratios.items()))
        median = f"{statistics.median(ratios.values()):.2f}x" if ratios else "-"
        lines.append(f"| {name} | {each or '-'} | {median} |")
    if not lines:
        return ""
    head = [
        f"| config | seconds to the target over {reference}'s, by seed | median |",
        "| --- | --- | ---: |",
    ]
    return "\n".join(head + lines)


def _median(runs: list[dict], key: str, spec: str) -> str:
    """The median of ``key`` over the ``runs`` that have it, formatted (``-``: none)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return format(statistics.median(values), spec) if values else "-"


def _per_budget(r: dict) -> dict:
    """``r``'s frames/s and learner updates/s over the seconds from its process's start to
    its stop."""
    seconds = r.get("stop_s")
    return {
        "frames_per_s": r["frames"] / seconds if seconds else None,
        "updates_per_s": r["learner_steps"] / seconds if seconds else None,
    }


def budget_table(results: list[dict]) -> str:
    """Per run: what its wall time bought, end to end; then the medians per config."""
    lines = [
        "| config | seed | stopped by | seconds | frames | frames/s | learner updates | "
        "updates/s | final return | eval return |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        per = _per_budget(r)
        lines.append(
            f"| {r['config']} | {r['seed']} | {r.get('stopped_by', '-')} | "
            f"{_fmt(r.get('stop_s'), '.1f')} | {r['frames']} | {_fmt(per['frames_per_s'], '.1f')} "
            f"| {r['learner_steps']} | {_fmt(per['updates_per_s'], '.1f')} | "
            f"{_fmt(r['final_return'], '.1f')} | {_fmt(r.get('eval_return'), '.1f')} |"
        )
    lines += [
        "",
        "| config | seeds | median frames | median frames/s | median updates/s | "
        "median final return | median eval return |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in dict.fromkeys(r["config"] for r in results):
        runs = [{**r, **_per_budget(r)} for r in results if r["config"] == name]

        lines.append(
            f"| {name} | {len(runs)} | {_median(runs, 'frames', '.0f')} | "
            f"{_median(runs, 'frames_per_s', '.1f')} | {_median(runs, 'updates_per_s', '.1f')} | "
            f"{_median(runs, 'final_return', '.1f')} | {_median(runs, 'eval_return', '.1f')} |"
        )
    return "\n".join(lines)


def medians(results: list[dict], target: float) -> str:
    """Per config: the median frames and seconds to the target over the seeds that reached it."""
    lines = [
        f"| config | seeds reaching {target:g} | median frames | median seconds | "
        "median startup s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in dict.fromkeys(r["config"] for r in results):
        runs = [r for r in results if r["config"] == name]
        done = [r for r in runs if r["frames_to_target"] is not None]

        lines.append(
            f"| {name} | {len(done)}/{len(runs)} | {_median(done, 'frames_to_target', '.0f')} | "
            f"{_median(done, 'seconds_to_target', '.1f')} | {_median(done, 'startup_s', '.1f')} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], args: argparse.Namespace, env: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r["curve"]:
            ax.plot(*zip(*r["curve"]), label=f"{r['config']} (seed {r['seed']})", lw=2)
        if r.get("eval_curve"):
            ax.plot(
                *zip(*r["eval_curve"]),
                "o--",
                label=f"{r['config']} (seed {r['seed']}), deterministic evaluation",
            )
    if args.target is not None:
        ax.axhline(args.target, color="gray", ls="--", lw=1, label=f"target {args.target:g}")
    ax.set_xlabel("frames")
    ax.set_ylabel(f"mean return (lines: last {args.window} training episodes)")
    ax.set_title(f"{env}: millpond launch (and single-process references)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=[*CONFIGS, *REFERENCES], default=["ppo", "dqn"])
    p.add_argument("--seeds", type=int, default=1, help="seeds per config (0, 1, ...)")
    p.add_argument(
        "--target",
        type=float,
        help="default: the env's (475 CartPole, -200 Pendulum, none HalfCheetah)",
    )
    p.add_argument("--max-frames", type=int, default=500_000)
    p.add_argument(
        "--max-seconds",
        type=float,
        help="every run's wall time, from its process's start to its stop (default: none)",
    )
    p.add_argument(
        "--learning-starts",
        type=int,
        help="replay.table.min_size of the millpond configs and SB3's learning_starts "
        "(SAC and TD3 runs; default: each config's own)",
    )
    p.add_argument(
        "--window",
        type=int,
        help="episodes the mean return averages, for every config (default: the env's, "
        "100 CartPole, 10 Pendulum and HalfCheetah)",
    )
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every millpond run (as `millpond launch --set`)",
    )
    args = p.parse_args()
    ours = {env_of(name) for name in args.configs if name in CONFIGS}
    run_env = next(iter(ours)) if len(ours) == 1 else None
    envs = {name: env_of(name, run_env) for name in args.configs}
    if len(set(envs.values())) > 1:
        p.error(
            "one target and window compare one env; these configs train different ones ("
            + ", ".join(f"{n}: {e}" for n, e in envs.items())
            + "): run them apart"
        )
    env = args.env = next(iter(envs.values()))
    target, window = ENV_DEFAULTS.get(env, (None, 100))
    args.target = target if args.target is None else args.target
    args.window = window if args.window is None else args.window
    if args.window < 1:
        p.error(f"--window ({args.window}) must be >= 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        p.error(f"--max-seconds ({args.max_seconds}) must be > 0")
    if args.learning_starts is not None:
        if args.learning_starts < 1:
            p.error(f"--learning-starts ({args.learning_starts}) must be >= 1")
        others = [n for n in args.configs if n not in _LEARNING_STARTS]
        if others:
            p.error(f"--learning-starts: {', '.join(others)} start learning otherwise")
    if args.max_seconds is not None and "cleanrl-dqn" in args.configs:
        p.error("cleanrl-dqn runs to a target and a frame budget, not a wall time")
    log(f"code {code_version(['service', 'actors', 'learner', 'deploy'])}")
    results = []
    with tempfile.TemporaryDirectory(prefix="millpond-train-") as work:
        # Seed by seed, every config of a seed back to back: a machine whose speed drifts
        # over the run (shared hosts do, by a third within minutes) then slows both sides
        # of a comparison alike, where config after config it would favour one.
        for seed in range(args.seeds):
            for name in args.configs:
                if name in REFERENCES:
                    results.append(run_reference(name, seed, args))
                else:
                    results.append(run_one(name, seed, args, Path(work)))
    results.sort(key=lambda r: (args.configs.index(r["config"]), r["seed"]))
    text = table(results, args.target)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.md").write_text(text + "\n")
    (args.out / "train.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args, env, args.out / "train.png")
    log(f"wrote {args.out / 'train.md'}, {args.out / 'train.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
