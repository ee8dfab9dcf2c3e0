"""A job's run directory: claimed by one launch at a time, an earlier run never written over
unless ``overwrite`` says so, default names that cannot collide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from millpond.deploy.run_dir import LOCK_FILE, claim_run_dir
from millpond.errors import InvalidConfigError


def earlier_run(path: Path) -> dict[str, bytes]:
    """A directory holding a run's files; returns their bytes by name."""
    (path / "replay" / "shard-0").mkdir(parents=True)
    files = {
        "config.yaml": b"name: earlier\n",
        "summary.json": b'{"frames": 1234}\n',
        "metrics.csv": b"time_s,frames\n1.0,1234\n",
        "checkpoint.pt": bytes(range(256)),
        "replay/shard-0/data": b"\x00\x01" * 100,
    }
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def contents(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def test_a_directory_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path):
    files = earlier_run(tmp_path / "run")
    with pytest.raises(InvalidConfigError, match="holds an earlier run.*--resume.*--overwrite"):
        claim_run_dir(tmp_path / "run")
    assert contents(tmp_path / "run") == files
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # refused before touching anything


def test_overwrite_replaces_an_earlier_run_but_never_other_files(tmp_path):
    earlier_run(tmp_path / "run")
    claim = claim_run_dir(tmp_path / "run", overwrite=True)
    assert contents(tmp_path / "run") == {}
    claim.release()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(InvalidConfigError, match="not a millpond run's"):
        claim_run_dir(tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_a_new_or_empty_directory_is_claimed(tmp_path):
    claim = claim_run_dir(tmp_path / "a" / "b")
    assert claim.path.is_dir() and claim.created
    claim.release()
    (tmp_path / "empty").mkdir()
    claim = claim_run_dir(tmp_path / "empty")
    assert not claim.created
    claim.release()


def test_two_claims_of_one_directory_cannot_both_hold_it(tmp_path):
    first = claim_run_dir(tmp_path / "run")
    with pytest.raises(InvalidConfigError, match="another millpond launch is writing to it"):
        claim_run_dir(tmp_path / "run")
    with pytest.raises(InvalidConfigError, match="another millpond launch"):
        claim_run_dir(tmp_path / "run", resume=True)
    # another process too (flock is per open file, so per process as well)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from millpond.deploy.run_dir import claim_run_dir\n"
            "try:\n    claim_run_dir(sys.argv[1])\nexcept Exception as e:\n    print(e)",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "another millpond launch is writing to it" in other.stdout, other.stderr
    first.release()
    claim_run_dir(tmp_path / "run").release()  # free again once released


def test_default_names_do_not_collide_within_a_second(tmp_path):
    claims = [claim_run_dir(None, parent=tmp_path, name="job") for _ in range(50)]
    paths = {c.path for c in claims}
    assert len(paths) == 50
    assert all(p.parent == tmp_path and p.name.startswith("job-") for p in paths)
    for claim in claims:
        claim.release()


def test_an_abandoned_claim_leaves_no_directory_behind(tmp_path):
    claim = claim_run_dir(tmp_path / "new")
    claim.abandon()
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    claim = claim_run_dir(tmp_path / "kept")
    claim.abandon()
    assert (tmp_path / "kept").is_dir()  # not made by the claim: not removed


def test_resume_needs_the_directory(tmp_path):
    with pytest.raises(InvalidConfigError, match="no such run directory"):
        claim_run_dir(tmp_path / "missing", resume=True)
    earlier_run(tmp_path / "run")
    claim = claim_run_dir(tmp_path / "run", resume=True)
    assert contents(tmp_path / "run")["checkpoint.pt"] == bytes(range(256))
    claim.release()
