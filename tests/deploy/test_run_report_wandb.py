"""Weights & Biases from ``millpond launch``'s run report: with wandb installed and configured
(here offline, into a temporary WANDB_DIR), every metrics row is logged to a wandb run against
frames, read back from the run's own files; a resumed run logs to the same wandb run; and
without configuration nothing of wandb happens."""

import math
import struct
import time
from pathlib import Path

import pytest

from millpond.deploy.run_report import WANDB_ID_FILE, RunReport, wandb_configured

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

_BLOCK = 32 * 1024
_HEADER = 7  # ":W&B", magic (uint16), version (uint8); then per record crc, length, type


def history(run_file: Path) -> list[dict[str, float]]:
    """The history rows of an offline run file (``run-ID.wandb``): wandb's record log, a
    LevelDB-style log of 32 KiB blocks whose records are ``wandb_internal_pb2.Record``."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", _HEADER
    while offset + 7 <= len(data):
        block_left = _BLOCK - offset % _BLOCK
        if block_left < 7:  # the block's tail is padding
            offset += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if length == 0 and kind == 0:  # zeros: padding to the block's end
            offset += block_left
            continue
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL, LAST
            records.append(pending)
            pending = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = float(item.value_json) if item.value_json else math.nan
        rows.append(row)
    return rows


def rows_logged(wandb_dir: Path, expected: int) -> list[dict[str, float]]:
    """The rows of every offline run under ``wandb_dir``, once ``expected`` are there:
    wandb's service process writes its run file on its own, after ``finish()`` returns."""
    deadline = time.monotonic() + 60
    while True:
        runs = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
        rows = [row for run in runs for row in history(run)]
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """wandb configured offline, writing under a temporary WANDB_DIR."""
    for name in ("WANDB_PROJECT", "WANDB_API_KEY", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    return tmp_path / "wandb-dir"


ROWS = [
    {"time_s": 1.0, "frames": 1000, "frames_per_s": 1000.0, "episodes": 3, "mean_return": None},
    {"time_s": 2.0, "frames": 2500, "frames_per_s": 1500.0, "episodes": 7, "mean_return": 21.5},
    {"time_s": 3.0, "frames": 4000, "frames_per_s": 1500.0, "loss": float("nan"), "episodes": 9},
]


def test_each_row_is_logged_to_an_offline_wandb_run_against_frames(tmp_path, offline):
    assert wandb_configured()
    report = RunReport(tmp_path / "run")
    for row in ROWS:
        report.record(row)
    report.close()
    logged = rows_logged(offline, len(ROWS))
    assert len(list(offline.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    assert [r["frames"] for r in logged] == [1000, 2500, 4000]
    assert [r["millpond/frames_per_s"] for r in logged] == [1000.0, 1500.0, 1500.0]
    assert [r["millpond/episodes"] for r in logged] == [3, 7, 9]
    assert [r["millpond/time_s"] for r in logged] == [1.0, 2.0, 3.0]
    # What is missing or not finite is not logged (as TensorBoard leaves it out)
    assert "millpond/mean_return" not in logged[0] and logged[1]["millpond/mean_return"] == 21.5
    assert "millpond/loss" not in logged[2]
    # The CSV is written as ever
    assert len((tmp_path / "run" / "metrics.csv").read_text().splitlines()) == 1 + len(ROWS)


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, offline):
    report = RunReport(tmp_path / "run")
    report.record(ROWS[0])
    report.close()
    run_id = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
    resumed = RunReport(tmp_path / "run", append=True)
    resumed.record(ROWS[1])
    resumed.close()
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == run_id
    runs = sorted(offline.glob("wandb/offline-run-*/run-*.wandb"))
    assert {run.name for run in runs} == {f"run-{run_id}.wandb"}
    assert [r["frames"] for r in rows_logged(offline, 2)] == [1000, 2500]


def test_without_configuration_nothing_of_wandb_happens(tmp_path, monkeypatch):
    for name in ("WANDB_PROJECT", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    assert not wandb_configured()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_PROJECT", "p")
    assert not wandb_configured()  # wandb's own off switch
    report = RunReport(tmp_path / "run")
    report.record(ROWS[0])
    report.close()
    assert not (tmp_path / "wandb-dir").exists() and not (tmp_path / "run" / "wandb").exists()
    assert not (tmp_path / "run" / WANDB_ID_FILE).exists()
