"""Evaluations of a ``millpond launch`` run's policy: during the run and at its end.

With ``run.eval_episodes`` > 0 the driver plays the trained policy greedily
(:func:`~millpond.deploy.evaluation.evaluate`, episode ``i`` reset with seed
``run.seed + i``, the same episodes each time):

- every ``run.eval_every_frames`` frames (when set), on the latest weights the learner
  published, fetched from the replay service, in a thread of the driver process: the
  training goes on meanwhile; an evaluation still playing when the next is due delays it;
- once at the end of a run that reached its frames, return or time, or was stopped from
  Python (not one interrupted by a signal, or failed), on the run's ``checkpoint.pt``, as
  ``millpond eval RUN_DIR`` does.

Each result goes to the next metrics row (``eval_frames``, ``eval_return``,
``eval_return_std``: ``metrics.csv``, TensorBoard, the progress line, ``return.png``'s second
series), and all of them to ``summary.json`` (``evaluations``; the last one's mean and std
as ``eval_return`` / ``eval_return_std``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from millpond.errors import MillpondError

if TYPE_CHECKING:
    from millpond.deploy.evaluation import Evaluation
    from millpond.deploy.launch_config import LaunchConfig
    from millpond.deploy.trained_policy import TrainedPolicy

__all__ = ["RunEvaluation"]

log = logging.getLogger("millpond.launch")

#: Why a run stopped, for which it is evaluated at its end (not "interrupted" or "error").
FINISHED = ("frames", "return", "timeout", "stopped")


class RunEvaluation:
    """The evaluations of one run (see the module docstring).

    Args:
        config: the job's config (``run.eval_episodes``, ``run.eval_every_frames``,
            ``run.seed``).
        say: prints a line of the job's progress.
        frames: the frames collected before (a resumed run's): the first evaluation
            during the run comes at the next multiple of ``run.eval_every_frames``.
    """

    def __init__(self, config: LaunchConfig, say: Callable[[str], None], frames: int = 0) -> None:
        self.config = config
        self.episodes = config.run.eval_episodes
        self.every = config.run.eval_every_frames
        self.history: list[Evaluation] = []
        self._say = say
        self._next = (frames // self.every + 1) * self.every if self.every else None
        self._policy: TrainedPolicy | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._unreported: Evaluation | None = None

    def poll(self, frames: int, client: Any) -> None:
        """Start an evaluation of the latest published weights when ``frames`` reached the
        next one and none is playing (called by the job's loop)."""
        if self._next is None or frames < self._next:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        try:
            state, version = client.get_weights()
        except MillpondError as e:  # a shard down: try again at the next poll
            log.warning("evaluation: cannot fetch the weights: %s", e)
            return
        if state is None:
            return
        self._next = (frames // self.every + 1) * self.every
        if self._policy is None:
            from millpond.deploy.trained_policy import build_policy  # deferred: torch, envs

            self._policy = build_policy(self.config)
        self._policy.load_weights(state, version)
        self._thread = threading.Thread(
            target=self._play, args=(self._policy, frames), name="millpond-eval", daemon=True
        )
        self._thread.start()

    def _play(self, policy: TrainedPolicy, frames: int) -> None:
        from millpond.deploy.evaluation import evaluate

        try:
            result = evaluate(
                policy,
                self.episodes,
                seed=self.config.run.seed,
                frames=frames,
                cancel=self._cancel,
            )
        except Exception as e:  # an evaluation must not stop the training
            log.error("evaluation at %d frames failed: %s", frames, e)
            return
        if result is not None:
            self._record(result)

    def _record(self, result: Evaluation) -> None:
        with self._lock:
            self.history.append(result)
            self._unreported = result
        where = f"{result.frames} frames" if result.frames is not None else "the end"
        self._say(f"eval at {where} (weights version {result.version}): {result.line()}")

    def annotate(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with the evaluation finished since the last row, if any (its frames,
        mean and std return)."""
        with self._lock:
            result, self._unreported = self._unreported, None
        if result is not None:
            row["eval_frames"] = result.frames if result.frames is not None else row["frames"]
            row["eval_return"] = result.mean_return
            row["eval_return_std"] = result.std_return
        return row

    def close(self) -> None:
        """Stop an evaluation still playing."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def final(self, run_dir: Path, reason: str, frames: int) -> None:
        """Evaluate ``run_dir``'s ``checkpoint.pt`` at the end of a run that stopped for
        ``reason`` after ``frames`` frames (nothing when evaluation is off, or the run was
        interrupted or failed)."""
        self.close()
        if self.episodes == 0 or reason not in FINISHED:
            return
        if not (run_dir / "checkpoint.pt").is_file():
            self._say("eval: skipped, the run has no checkpoint.pt")
            return
        from millpond.deploy.evaluation import evaluate  # deferred: torch, the envs
        from millpond.deploy.trained_policy import load_policy

        policy = load_policy(run_dir)
        result = evaluate(policy, self.episodes, seed=self.config.run.seed, frames=frames)
        assert result is not None  # not cancelled
        self._record(result)

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` records of the evaluations."""
        last = self.history[-1] if self.history else None
        return {
            "eval_return": last.mean_return if last else None,
            "eval_return_std": last.std_return if last else None,
            "eval_episodes": len(last.returns) if last else None,
            "evaluations": [e.as_dict() for e in self.history],
        }
