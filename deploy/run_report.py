"""What a ``millpond launch`` run leaves behind: a metrics CSV, a plot and a summary.

:class:`RunReport` appends one row per status interval to ``metrics.csv`` (flushed each
time, so a killed run keeps its rows), and at the end draws ``return.png`` (mean return
against frames, with the greedy evaluations' returns when the run made any, and frames/s
and achieved samples-per-insert beneath) and writes
``summary.json`` plus the human-readable table it prints.

The same rows can go to TensorBoard (``tensorboard``) and to Weights & Biases: when the
``wandb`` package is installed and the environment configures it (``WANDB_PROJECT`` or
``WANDB_MODE`` set, and ``WANDB_MODE`` not ``disabled``), each row is logged to a wandb run
named after the run directory, against ``frames``; its id is kept in ``RUN_DIR/wandb-run-id``
so that a resumed run goes on logging to the same wandb run.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from millpond.errors import InvalidConfigError

__all__ = [
    "COLUMNS",
    "RunReport",
    "format_summary",
    "progress_line",
    "return_limits",
    "wandb_configured",
]

log = logging.getLogger("millpond.launch")
#: Where a run directory keeps the id of its wandb run (so that a resumed run continues it).
WANDB_ID_FILE = "wandb-run-id"

COLUMNS: tuple[str, ...] = (
    "time_s",
    "frames",
    "frames_per_s",
    "episodes",
    "mean_return",
    "buffer_size",
    "buffer_fill",
    "inserts_per_s",
    "samples_per_s",
    "samples_per_insert",
    "acting_lag",
    "acting_lag_steps",
    "acting_lag_max",
    "sample_age",
    "sample_age_steps",
    "publish_wait_s",
    "stale_steps",
    "learner_steps",
    "weights_version",
    "loss",
    "actor_restarts",
    # Shards unreachable now, to the driver, a learner or an env actor's writer
    # (deploy/status_rows.py), and the seconds since the rows first said so.
    "shards_unavailable",
    "unavailable_for_s",
    # A greedy evaluation of the policy that finished since the row before (run.eval_*):
    # the frames when its weights were taken, its mean and std return.
    "eval_frames",
    "eval_return",
    "eval_return_std",
)


class RunReport:
    """The files of one run directory (see the module docstring).

    ``tensorboard``: also write each row's numbers as TensorBoard scalars
    (``RUN_DIR/tensorboard``, step = frames): ``"auto"`` when the ``tensorboard`` package is
    installed, ``"on"`` (an error naming the extra without it) or ``"off"``. ``append``:
    keep the rows of an existing ``metrics.csv`` and add to them (a resumed run).
    """

    def __init__(self, run_dir: str | Path, tensorboard: str = "off", append: bool = False) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._events = _event_writer(self.dir / "tensorboard", tensorboard)
        self._wandb = _wandb_run(self.dir, append) if wandb_configured() else None
        self.metrics_path = self.dir / "metrics.csv"
        self.plot_path = self.dir / "return.png"
        self.summary_path = self.dir / "summary.json"
        self.rows: list[dict[str, Any]] = []
        if append and self.metrics_path.exists():
            self._open_to_append()
            return
        self._file: TextIO = self.metrics_path.open("w", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        self._file.flush()

    def _open_to_append(self) -> None:
        """Keep ``metrics.csv``'s rows (a resumed run): read them for the plot, and append
        new rows under the file's own header."""
        header, self.rows = _read_rows(self.metrics_path)
        self._file = self.metrics_path.open("a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=header, extrasaction="ignore")

    def record(self, row: Mapping[str, Any]) -> None:
        """Append one row (keys of :data:`COLUMNS`; missing ones stay empty)."""
        clean = {k: _cell(row.get(k)) for k in self._csv.fieldnames}
        self.rows.append(dict(row))
        self._csv.writerow(clean)
        self._file.flush()
        if self._events is not None:
            frames = int(row.get("frames") or 0)
            for key in COLUMNS[2:]:  # time and frames are the axes
                value = row.get(key)
                if key == "eval_frames" or not (
                    isinstance(value, int | float) and math.isfinite(value)
                ):
                    continue
                # An evaluation is of the weights at its own frames.
                step = int(row["eval_frames"]) if key.startswith("eval_") else frames
                self._events.add_scalar(f"millpond/{key}", value, global_step=step)
            self._events.flush()
        if self._wandb is not None:
            self._log_wandb(row)

    def _log_wandb(self, row: Mapping[str, Any]) -> None:
        """Log ``row``'s finite numbers to the wandb run (``millpond/KEY``, against frames);
        a failing wandb is logged and left, the run goes on."""
        values: dict[str, Any] = {"frames": int(row.get("frames") or 0)}
        for key in (COLUMNS[0], *COLUMNS[2:]):
            value = row.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                values[f"millpond/{key}"] = value
        try:
            self._wandb.log(values)
        except Exception as e:  # wandb's own errors: a dashboard must not stop the run
            log.warning("wandb: cannot log a row (%s); the run goes on without wandb", e)
            self._finish_wandb()

    def _finish_wandb(self) -> None:
        run, self._wandb = self._wandb, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:  # as above
                log.warning("wandb: cannot finish the run: %s", e)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._events is not None:
            self._events.close()
            self._events = None
        self._finish_wandb()

    def plot(self, title: str = "") -> Path | None:
        """Draw ``return.png``; ``None`` when there is nothing to draw yet."""
        points = [r for r in self.rows if r.get("mean_return") is not None]
        if not points:
            return None
        import matplotlib

        matplotlib.use("Agg")  # files only, no screen
        import matplotlib.pyplot as plt

        frames = [r["frames"] for r in self.rows]
        fig, (top, middle, bottom) = plt.subplots(
            3, 1, figsize=(7, 7), sharex=True, height_ratios=(3, 1, 1)
        )
        top.plot(
            [r["frames"] for r in points],
            [r["mean_return"] for r in points],
            lw=2,
            label="training episodes (mean)",
        )
        evals = [r for r in self.rows if _has(r, "eval_return")]
        if evals:
            top.errorbar(
                [r["eval_frames"] for r in evals],
                [r["eval_return"] for r in evals],
                yerr=[r.get("eval_return_std") or 0 for r in evals],
                fmt="o-",
                color="tab:red",
                capsize=3,
                label="greedy evaluation (mean ± std)",
            )
            top.legend(loc="best", fontsize="small")
        top.set_ylim(
            *return_limits([r["mean_return"] for r in points] + [r["eval_return"] for r in evals])
        )
        top.set_ylabel("mean return")
        top.grid(alpha=0.3)
        top.set_title(title)
        middle.plot(frames, [r.get("frames_per_s") or 0 for r in self.rows], color="tab:green")
        middle.set_ylabel("frames/s")
        middle.grid(alpha=0.3)
        spi = [
            (r["frames"], r["samples_per_insert"])
            for r in self.rows
            if _has(r, "samples_per_insert")
        ]
        if spi:
            bottom.plot(*zip(*spi), color="tab:orange")
        bottom.set_ylabel("samples/insert")
        bottom.set_xlabel("frames")
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)
        return self.plot_path

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        """Write ``summary.json`` (atomically enough: the whole file at once)."""
        self.summary_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        return self.summary_path


def return_limits(returns: list[float]) -> tuple[float, float]:
    """The return axis of ``return.png``: the returns and zero, with a margin.

    Zero is always on the axis, so that a run whose returns hardly move (Pong from -21.0 to
    -20.2) is drawn as the flat line it is, not stretched over the whole panel into what
    looks like learning; a run that learns still fills most of it.
    """
    lo, hi = min(min(returns), 0.0), max(max(returns), 0.0)
    margin = 0.05 * (hi - lo) or 1.0
    return lo - margin, hi + margin


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The header and the rows of an existing ``metrics.csv``, numbers parsed (empty
    cells: ``None``)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or COLUMNS)
        rows = [{k: _number(v) for k, v in row.items() if k is not None} for row in reader]
    return header, rows


def _number(cell: str | None) -> Any:
    if cell is None or cell == "":
        return None
    for kind in (int, float):
        try:
            return kind(cell)
        except ValueError:
            pass
    return cell


def _event_writer(directory: Path, mode: str) -> Any:
    """A TensorBoard ``SummaryWriter`` in ``directory``, or ``None`` (see :class:`RunReport`)."""
    if mode == "off":
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if mode == "on":
            raise InvalidConfigError(
                "run.tensorboard: on needs the tensorboard package: "
                "pip install 'millpond[tensorboard]'"
            ) from None
        return None
    return SummaryWriter(log_dir=str(directory))


def wandb_configured() -> bool:
    """Whether runs log to Weights & Biases: the ``wandb`` package is installed and the
    environment configures it (``WANDB_PROJECT`` or ``WANDB_MODE`` set; ``WANDB_MODE=disabled``
    turns it off)."""
    mode = os.environ.get("WANDB_MODE", "")
    if mode == "disabled" or not (mode or os.environ.get("WANDB_PROJECT")):
        return False
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def _wandb_run(run_dir: Path, append: bool) -> Any:
    """A wandb run for ``run_dir`` (the one it logged to before when ``append``), or
    ``None`` when wandb refuses to start one (logged: the launch goes on without it)."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if append and id_file.exists() else None
    try:
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "millpond",
            name=run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            reinit="create_new",
        )
        run.define_metric("frames")
        run.define_metric("millpond/*", step_metric="frames")
    except Exception as e:  # wandb's own errors (no API key, no network, ...)
        log.warning("wandb: cannot start a run (%s); the run goes on without wandb", e)
        return None
    id_file.write_text(run.id + "\n")
    return run


def format_summary(summary: Mapping[str, Any], keys: Sequence[str] | None = None) -> str:
    """A two-column table of a summary's scalar entries."""
    items = [(k, v) for k, v in summary.items() if keys is None or k in keys]
    items = [(k, v) for k, v in items if not isinstance(v, Mapping | list)]
    width = max((len(k) for k, _ in items), default=0)
    return "\n".join(f"  {k:<{width}}  {_cell(v)}" for k, v in items)


def progress_line(row: Mapping[str, Any], budget: int) -> str:
    """One status line of a metrics row (``budget``: the run's frame budget)."""

    def num(key: str, fmt: str = ".0f") -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    pct = 100 * row["frames"] / budget
    return (
        f"[{row['time_s']:7.1f}s] frames {row['frames']:>8} ({pct:5.1f}%)  "
        f"{num('frames_per_s')} fps  episodes {row['episodes']}  return {num('mean_return', '.1f')}  "
        f"buffer {num('buffer_fill', '.0%')}  ins/s {num('inserts_per_s')}  "
        f"smp/s {num('samples_per_s')}  spi {num('samples_per_insert', '.2f')}  "
        f"acting lag {num('acting_lag', '.2f')} v / {num('acting_lag_steps')} steps "
        f"(max {num('acting_lag_max')} v)  "
        f"sample age {num('sample_age', '.1f')} v / {num('sample_age_steps')} steps"
        + (
            f"  eval {row['eval_return']:.1f}±{row.get('eval_return_std') or 0:.1f}"
            if _has(row, "eval_return")
            else ""
        )
        + (
            f"  UNAVAILABLE shard {','.join(map(str, row['unavailable_shards']))} for "
            f"{row.get('unavailable_for_s') or 0:.0f}s"
            if row.get("unavailable_shards")
            else ""
        )
    )


def _has(row: Mapping[str, Any], key: str) -> bool:
    value = row.get(key)
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value
