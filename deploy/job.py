"""A training job from Python: ``millpond launch`` as an object (docs/python_api.md).

::

    from millpond import Job, job_config

    config = job_config("deploy/configs/cartpole-ppo.yaml", {"run.frames": 50_000})
    job = Job(config, on_progress=lambda row: print(row["frames"], row["mean_return"]))
    result = job.run()  # blocks until the job ends; job.stop() from another thread ends it
    result.run_dir, result.summary["mean_return"]
    policy = result.load_policy()

:func:`job_config` checks a config exactly as ``millpond launch`` checks a file and its
``--set`` overrides; :class:`Job` runs it as :class:`~millpond.deploy.launch.Launch` does
for the command line (Ray: a local instance of its own, shut down at the end, unless this
process has called ``ray.init`` already, or ``ray.address`` names a cluster).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from millpond.deploy.config_files import apply_override, read_config_doc, set_key
from millpond.deploy.config_mapping import from_mapping, to_mapping
from millpond.deploy.launch_config import LaunchConfig
from millpond.errors import InvalidConfigError

if TYPE_CHECKING:
    from millpond.deploy.trained_policy import TrainedPolicy

__all__ = ["Job", "JobResult", "job_config"]

#: What :func:`job_config` starts from.
ConfigSource = LaunchConfig | Mapping[str, Any] | str | Path | None


def job_config(
    source: ConfigSource = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
) -> LaunchConfig:
    """A checked job config.

    Args:
        source: a YAML config file, a mapping of sections as a file holds them
            (``{"learner": {"algorithm": "dqn"}, ...}``), a config to change, or ``None``
            (every default).
        overrides: dotted keys and their values (``{"learner.ppo.lr": 3e-4}``), or
            ``"key=value"`` strings read as ``--set`` reads them (the value as YAML).

    Raises :class:`~millpond.errors.InvalidConfigError` naming the key of any unknown key,
    wrong type or bad value.
    """
    if isinstance(source, LaunchConfig):
        doc = to_mapping(source)
    elif isinstance(source, str | Path):
        doc = read_config_doc(source)
    elif isinstance(source, Mapping):
        doc = copy.deepcopy(dict(source))
    elif source is None:
        doc = {}
    else:
        raise InvalidConfigError(
            f"config: expected a file, a mapping or a LaunchConfig, got {type(source).__name__}"
        )
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_key(doc, str(key), copy.deepcopy(value))
    elif overrides is not None:
        if isinstance(overrides, str):
            raise InvalidConfigError(f"overrides: a list of 'key=value' strings, not {overrides!r}")
        for item in overrides:
            apply_override(doc, item)
    return from_mapping(LaunchConfig, doc)


@dataclass(frozen=True)
class JobResult:
    """What a finished :class:`Job` left.

    Attributes:
        run_dir: the run directory (``config.yaml``, ``metrics.csv``, ``return.png``,
            ``summary.json``, ``checkpoint.pt``).
        summary: the run's summary, as ``summary.json`` holds it.
        config: the job's config.
    """

    run_dir: Path
    summary: dict[str, Any]
    config: LaunchConfig

    @property
    def stopped_by(self) -> str:
        """Why the job ended: ``frames``, ``return``, ``timeout``, ``stopped`` (by
        :meth:`Job.stop` or a callback), ``interrupted`` (Ctrl-C, SIGTERM) or ``error``."""
        return str(self.summary["stopped_by"])

    @property
    def mean_return(self) -> float | None:
        """The mean return of the last training episodes (``run.return_window`` of them)."""
        return self.summary.get("mean_return")

    @property
    def eval_return(self) -> float | None:
        """The mean return of the last greedy evaluation (``run.eval_episodes``), if any."""
        return self.summary.get("eval_return")

    def load_policy(self, *, deterministic: bool = True, seed: int | None = None) -> TrainedPolicy:
        """The trained policy (:func:`~millpond.deploy.trained_policy.load_policy`)."""
        from millpond.deploy.trained_policy import load_policy  # deferred: torch, the envs

        return load_policy(self.run_dir, deterministic=deterministic, seed=seed)


class Job:
    """One training job: replay shards, env actors and learners on Ray, to the config's
    frame budget (``millpond launch``, from Python).

    Args:
        config: a :class:`~millpond.deploy.launch_config.LaunchConfig`, or what
            :func:`job_config` takes (a YAML file, a mapping of sections).
        overrides: changes to it, as :func:`job_config` takes them.
        run_dir: where the run writes, new or empty; ``None``: a new
            ``run.dir/NAME-TIMESTAMP-XXXX``.
        on_progress: called in the thread that runs the job with each metrics row (a dict:
            ``frames``, ``frames_per_s``, ``episodes``, ``mean_return``, ``eval_return``...,
            see ``docs/training.md``), every ``run.status_every_s``; returning ``False``
            stops the job cleanly.
        replay: a running ``millpond serve`` service (``"host:port,..."``) to use instead
            of starting shards.
        out: where the progress lines go (default: standard output; e.g. ``io.StringIO()``
            to keep them).
    """

    def __init__(
        self,
        config: ConfigSource,
        *,
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
        run_dir: str | Path | None = None,
        on_progress: Callable[[dict[str, Any]], Any] | None = None,
        replay: str | None = None,
        out: TextIO | None = None,
    ) -> None:
        from millpond.deploy.launch import Launch  # deferred: imports Ray and torch

        if not isinstance(config, LaunchConfig) or overrides:
            config = job_config(config, overrides)
        self.config = config
        self._launch = Launch(
            config, replay=replay, run_dir=run_dir, out=out, on_progress=on_progress
        )
        self._started = threading.Lock()

    @property
    def run_dir(self) -> Path | None:
        """Where the run writes: the directory named, or once :meth:`run` has claimed a new
        one, that (``None`` before then)."""
        return self._launch.run_dir

    def run(self) -> JobResult:
        """Run the job to its end (its frames, ``run.stop_at_return``, ``run.timeout_s``,
        :meth:`stop`, Ctrl-C); what it left. A job runs once."""
        if not self._started.acquire(blocking=False):
            raise InvalidConfigError("Job.run: this job ran already; make a new Job")
        summary = self._launch.run()
        assert self.run_dir is not None  # claimed by the run
        return JobResult(self.run_dir, summary, self.config)

    def stop(self) -> None:
        """Ask the job to stop cleanly (from any thread, or from ``on_progress``): the env
        actors flushed, the learner's checkpoint written, the summary recorded."""
        self._launch.stop()
