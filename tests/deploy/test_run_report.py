"""RunReport: rows reach the CSV as they come, the plot and summary are written at the end."""

import csv
import json

from millpond.deploy.run_report import (
    COLUMNS,
    RunReport,
    format_summary,
    progress_line,
    return_limits,
)


def row(t, frames, ret):
    return {
        "time_s": t,
        "frames": frames,
        "frames_per_s": 1000.0,
        "episodes": frames // 20,
        "mean_return": ret,
        "buffer_fill": 0.5,
        "samples_per_insert": 1.0 if ret is not None else None,
        "acting_lag": 0.5,
        "not_a_column": "ignored",
    }


def test_rows_are_flushed_as_they_come_and_drawn_at_the_end(tmp_path):
    report = RunReport(tmp_path / "run")
    report.record(row(1.0, 1000, None))
    report.record(row(2.0, 2000, 25.5))
    # Readable before close: a killed run keeps its rows.
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert [r["frames"] for r in rows] == ["1000", "2000"]
    assert rows[0]["mean_return"] == "" and rows[1]["mean_return"] == "25.5"
    assert list(rows[0]) == list(COLUMNS)
    path = report.plot("test")
    assert path.read_bytes()[:4] == b"\x89PNG"
    report.write_summary({"frames": 2000, "mean_return": 25.5})
    assert json.loads(report.summary_path.read_text())["frames"] == 2000
    report.close()


def test_no_plot_without_a_return(tmp_path):
    report = RunReport(tmp_path)
    report.record(row(1.0, 10, None))
    assert report.plot() is None and not report.plot_path.exists()
    report.close()


def test_progress_line_and_summary_table():
    line = progress_line(row(12.5, 5000, 30.25), budget=10_000)
    assert line.startswith("[   12.5s] frames     5000 ( 50.0%)")
    assert "return 30.2" in line and "buffer 50%" in line and "spi 1.00" in line
    assert "ins/s -" in line  # missing numbers show as '-'
    table = format_summary({"frames": 5000, "nested": {"a": 1}, "mean_return": 30.25})
    assert "frames" in table and "30.25" in table and "nested" not in table

    assert "UNAVAILABLE" not in line


def test_progress_line_names_the_shards_found_unreachable():
    down = {**row(3.0, 100, None), "unavailable_shards": [0, 2], "unavailable_for_s": 6.4}
    line = progress_line(down, budget=1000)
    assert line.endswith("  UNAVAILABLE shard 0,2 for 6s"), line
    healed = {**row(4.0, 200, None), "unavailable_shards": [], "unavailable_for_s": None}
    assert "UNAVAILABLE" not in progress_line(healed, budget=1000)


def test_rows_reach_tensorboard_as_scalars_by_frames(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = RunReport(tmp_path / "run", tensorboard="on")
    report.record(row(1.0, 1000, None))
    report.record({**row(2.0, 2000, 25.5), "loss": 0.75})
    report.close()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"millpond/mean_return", "millpond/frames_per_s", "millpond/loss"} <= tags
    returns = events.Scalars("millpond/mean_return")
    assert [(e.step, e.value) for e in returns] == [(2000, 25.5)]  # a missing value: no point
    assert [e.step for e in events.Scalars("millpond/frames_per_s")] == [1000, 2000]
    assert "millpond/time_s" not in tags and "millpond/frames" not in tags
    # the CSV is written as ever
    assert len(list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))) == 2


def test_tensorboard_off_writes_no_events(tmp_path):
    report = RunReport(tmp_path / "run", tensorboard="off")
    report.record(row(1.0, 1000, 10.0))
    report.close()
    assert not (tmp_path / "run" / "tensorboard").exists()


def red_pixels(path) -> int:
    """Pixels of matplotlib's tab:red (the evaluation series) in a PNG."""
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(str(path))[..., :3]
    red = np.array([0xD6, 0x27, 0x28]) / 255
    return int((np.abs(image - red).max(-1) < 0.02).sum())


def test_evaluations_reach_the_csv_tensorboard_the_line_and_the_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = RunReport(tmp_path / "plain")
    plain.record(row(1.0, 1000, 20.0))
    plain.record(row(2.0, 2000, 25.5))
    plain.plot("test")
    plain.close()
    assert red_pixels(plain.plot_path) == 0

    report = RunReport(tmp_path / "run", tensorboard="on")
    report.record(row(1.0, 1000, 20.0))
    evaluated = {**row(2.0, 2000, 25.5), "eval_frames": 1500, "eval_return": 40.0}
    report.record({**evaluated, "eval_return_std": 2.5})
    report.plot("test")
    report.close()
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert [(r["eval_frames"], r["eval_return"], r["eval_return_std"]) for r in rows] == [
        ("", "", ""),
        ("1500", "40", "2.5"),
    ]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    # An evaluation is drawn at the frames of the weights it played, not of its row.
    assert [(e.step, e.value) for e in events.Scalars("millpond/eval_return")] == [(1500, 40.0)]
    assert "millpond/eval_frames" not in events.Tags()["scalars"]
    assert red_pixels(report.plot_path) > 100
    line = progress_line({**evaluated, "eval_return_std": 2.5}, budget=10_000)
    assert line.endswith("eval 40.0±2.5")
    assert "eval" not in progress_line(row(2.0, 2000, 25.5), budget=10_000)


def test_the_return_axis_always_holds_zero_so_a_flat_run_looks_flat():
    """Pong's -21.0 -> -20.2 is drawn on an axis from below -21 to above 0 (where the
    autoscaled axis spanned 0.8 and looked like learning); a run that learns fills it."""
    lo, hi = return_limits([-21.0, -20.7, -20.2])
    assert lo < -21.0 and hi > 0.0
    assert (-20.2 - -21.0) / (hi - lo) < 0.05  # the change takes under a twentieth of it
    lo, hi = return_limits([9.0, 120.0, 500.0])  # CartPole learning: zero is just below
    assert lo < 0.0 and hi > 500.0 and (500.0 - 9.0) / (hi - lo) > 0.85
    lo, hi = return_limits([-1500.0, -150.0])  # Pendulum: all negative, zero on top
    assert lo < -1500.0 and hi > 0.0
    assert return_limits([0.0, 0.0]) == (-1.0, 1.0)  # nothing moved: still an axis
