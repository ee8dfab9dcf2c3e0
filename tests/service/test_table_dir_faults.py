"""A damaged table directory is refused by name, never dropped or served as data.

Each test writes a real shard with a real :class:`Shard`, damages a copy of it the way an
operator, a failed create or a disk could (a missing or edited ``meta.json``, a missing
``counters.bin``, garbled JSON, a read-only directory, an OSError half-way through a
create), and checks what a caller then sees: the exception class and a message naming the
file and the fix, the shard's other tables still served, nothing stored overwritten.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import Shard, Table, TableConfig
from millpond.errors import (
    InvalidConfigError,
    ResourceExhaustedError,
    StorageCorruptedError,
)
from millpond.segments import Segment
from millpond.service import storage as storage_module
from millpond.testing import stored_segments


def segment(ep: int, n: int = 4, obs_dtype=torch.float32) -> Segment:
    obs = torch.arange(n + 1, dtype=torch.float32)[:, None].expand(n + 1, 3) + 1000 * ep
    flags = torch.zeros(n, 1, dtype=torch.bool)
    term = flags.clone()
    term[-1] = True
    steps = TensorDict(
        {
            "observation": obs[:-1].to(obs_dtype),
            "action": torch.arange(n, dtype=torch.int64),
            "next": {"reward": torch.ones(n, 1), "terminated": term, "truncated": flags},
        },
        [n],
    )
    return Segment(steps, TensorDict({"observation": obs[-1].to(obs_dtype)}, []), ep, 0)


def fill(table: Table, first_ep: int, n: int) -> np.ndarray:
    return np.concatenate(
        [table.insert_many([segment(ep)]) for ep in range(first_ep, first_ep + n)]
    )


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` and a hash of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def shard_dir(tmp_path) -> Path:
    """A shard with tables ``a`` (uniform, 30 segments) and ``b`` (prioritized, 5)."""
    d = tmp_path / "shard"
    with Shard(d) as shard:
        fill(shard.create_table(TableConfig.uniform("a", 400, seed=0)), 1, 30)
        fill(shard.create_table(TableConfig.prioritized("b", 100, seed=0)), 100, 5)
    return d


# -- (6) a table directory without meta.json ------------------------------------------------
def test_lost_meta_json_is_rebuilt_exactly_from_its_copy(shard_dir, caplog):
    table_dir = shard_dir / "tables" / "a"
    meta_before = json.loads((table_dir / "meta.json").read_text())
    (table_dir / "meta.json").unlink()
    with caplog.at_level(logging.WARNING), Shard(shard_dir) as shard:
        assert sorted(shard.tables) == ["a", "b"]
        a = shard["a"]
        assert any("rebuilt" in r.getMessage() for r in caplog.records)
        assert json.loads((table_dir / "meta.json").read_text()) == meta_before
        old = stored_segments(a)
        assert len(old) == 30 and a.info()["inserts"] == 120
        new = fill(a, 31, 30)
        assert new.min() == max(old.values()) + 1
    with Shard(shard_dir) as shard:
        assert len(stored_segments(shard["a"])) == 60
        assert shard["a"].info()["inserts"] == 240


def lose_meta(table_dir: Path) -> None:
    """meta.json and its copy gone: nothing left says what the files hold."""
    (table_dir / "meta.json").unlink()
    (table_dir / "data" / "config.json").unlink()


def test_table_without_meta_but_with_data_is_refused_by_name(shard_dir, caplog):
    lose_meta(shard_dir / "tables" / "a")
    before = tree_digest(shard_dir / "tables" / "a")
    with caplog.at_level(logging.ERROR), Shard(shard_dir) as shard:
        assert sorted(shard.tables) == ["b"]  # the other table is served
        assert shard["b"].size == 5 * 4
        assert list(shard.refused) == ["a"] and "meta.json" in shard.refused["a"]
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("meta.json" in m and "tables/a" in m for m in logged), logged
        for call in (
            lambda: shard.table("a"),
            lambda: shard.create_table(TableConfig.uniform("a", 400, seed=0)),
            lambda: shard.drop_table("a"),
        ):
            with pytest.raises(StorageCorruptedError) as e:
                call()
            message = str(e.value)
            assert "'a'" in message and "meta.json" in message
            assert "backup" in message and "move" in message
    # Nothing there was overwritten, and the refusal holds across restarts.
    assert tree_digest(shard_dir / "tables" / "a") == before
    with Shard(shard_dir) as shard, pytest.raises(StorageCorruptedError):
        shard.create_table(TableConfig.uniform("a", 400, seed=0))


def test_the_remains_of_a_create_without_data_are_reused(shard_dir):
    # What a create that failed before meta.json (written last) leaves: no published segment.
    remains = shard_dir / "tables" / "c"
    with Shard(shard_dir) as shard:
        shard.create_table(TableConfig.uniform("c", 50))
    (remains / "meta.json").unlink()
    (remains / "data" / "segments.bin").unlink()
    with Shard(shard_dir) as shard:
        assert "c" not in shard.tables
        c = shard.create_table(TableConfig.uniform("c", 50, seed=1))
        assert list(fill(c, 1, 3)) == [1, 2, 3]
    with Shard(shard_dir) as shard:
        assert shard["c"].size == 12


def test_meta_missing_then_restored_keeps_every_acknowledged_segment(shard_dir):
    """The loss the refusal prevents: re-creating the table used to restart generations."""
    meta = shard_dir / "tables" / "a" / "meta.json"
    saved = meta.read_bytes()
    lose_meta(shard_dir / "tables" / "a")
    with Shard(shard_dir) as shard, pytest.raises(StorageCorruptedError):
        shard.create_table(TableConfig.uniform("a", 400, seed=0))
    meta.write_bytes(saved)  # the fix the message names
    with Shard(shard_dir) as shard:
        a = shard["a"]
        old = stored_segments(a)
        assert len(old) == 30
        new = fill(a, 31, 30)
        assert new.min() > max(old.values())
    with Shard(shard_dir) as shard:
        assert len(stored_segments(shard["a"])) == 60


# -- (7) a failed create leaves nothing behind ---------------------------------------------
def test_too_large_capacity_is_refused_before_touching_disk(tmp_path):
    with Shard(tmp_path / "s") as shard:
        with pytest.raises(InvalidConfigError, match="capacity"):
            shard.create_table(TableConfig.uniform("big", 2**45))
        assert not (tmp_path / "s" / "tables" / "big").exists()
        shard.create_table(TableConfig.uniform("big", 100))
    with Shard(tmp_path / "s") as shard:
        assert shard["big"].config.capacity == 100


@pytest.mark.parametrize(
    ("code", "error", "words"),
    [
        (errno.ENOSPC, ResourceExhaustedError, "disk full"),
        (errno.ENOMEM, ResourceExhaustedError, "memory"),
        (errno.EACCES, StorageCorruptedError, "permission"),
    ],
)
def test_oserror_half_way_through_create_is_named_and_cleaned_up(
    tmp_path, monkeypatch, code, error, words
):
    real = storage_module.SegmentStorage._open_map
    calls = []

    def failing(self, file, *args, **kwargs):
        calls.append(file)
        if len(calls) == 2:  # slots.bin is there already: what used to poison the name
            raise OSError(code, "injected", str(file))
        return real(self, file, *args, **kwargs)

    with Shard(tmp_path / "s") as shard:
        monkeypatch.setattr(storage_module.SegmentStorage, "_open_map", failing)
        with pytest.raises(error) as e:
            shard.create_table(TableConfig.uniform("t", 100))
        assert words in str(e.value).lower() and "'t'" in str(e.value)
        assert not (tmp_path / "s" / "tables" / "t").exists()
        monkeypatch.setattr(storage_module.SegmentStorage, "_open_map", real)
        fill(shard.create_table(TableConfig.uniform("t", 100)), 1, 2)
    with Shard(tmp_path / "s") as shard:
        assert shard["t"].size == 8


def test_path_too_long_for_the_filesystem_is_a_config_error(tmp_path):
    # A valid name whose path passes the filesystem's limit (PATH_MAX) under a deep shard.
    deep = tmp_path
    while len(str(deep)) < 3700:
        deep = deep / ("d" * 200)
    with Shard(deep) as shard:
        with pytest.raises(InvalidConfigError, match="too long") as e:
            shard.create_table(TableConfig.uniform("x" * 250, 100))
        assert "shorter" in str(e.value)
        assert list((deep / "tables").iterdir()) == []
        shard.create_table(TableConfig.uniform("x", 100))


# -- (9) edited or damaged table files -------------------------------------------------------
def edit_meta(path: Path, change) -> None:
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text())
    change(meta["config"])
    meta_file.write_text(json.dumps(meta))


def _dtype_to_int32(config: dict) -> None:
    for f in config["spec"]:
        if f["dtype"] == "float32":
            f["dtype"] = "int32"


@pytest.mark.parametrize(
    "change",
    [
        _dtype_to_int32,
        lambda c: c.update(sampler="queue"),
        lambda c: c.update(capacity=c["capacity"] + 2),
        lambda c: c.update(seed=7),
    ],
    ids=["dtype", "sampler", "capacity", "seed"],
)
def test_edited_meta_json_is_refused(shard_dir, change):
    table_dir = shard_dir / "tables" / "a"
    edit_meta(table_dir, change)
    with pytest.raises(StorageCorruptedError) as e:
        Table.open(table_dir)
    message = str(e.value)
    assert "meta.json" in message and "edited" in message and "backup" in message
    assert "rebuild it from data/config.json" in message
    # The fix it names: without the edited meta.json, the table opens as it was written.
    (table_dir / "meta.json").unlink()
    table = Table.open(table_dir)
    assert table.config.sampler == "uniform" and table.config.capacity == 400
    assert len(stored_segments(table)) == 30
    table.close()
    edit_meta(table_dir, change)
    with Shard(shard_dir) as shard:  # the shard serves the rest and refuses this one
        assert sorted(shard.tables) == ["b"]
        with pytest.raises(StorageCorruptedError, match="meta.json"):
            shard.table("a")


def test_meta_json_of_another_table_is_refused(tmp_path):
    """A self-consistent meta.json that describes other files (copied over by mistake)."""
    with Shard(tmp_path / "s") as shard:
        fill(shard.create_table(TableConfig.uniform("a", 100)), 1, 2)
        fill(shard.create_table(TableConfig.uniform("p", 100)), 1, 2)
    tables = tmp_path / "s" / "tables"
    shutil.copy(tables / "p" / "meta.json", tables / "a" / "meta.json")
    with pytest.raises(StorageCorruptedError, match="table 'p'.*directory"):
        Table.open(tables / "a", name="a")
    with Shard(tmp_path / "s") as shard:
        assert sorted(shard.tables) == ["p"]
        with pytest.raises(StorageCorruptedError, match="table 'a'.*describes table 'p'"):
            shard.table("a")


def test_meta_json_without_a_config_digest_still_opens(shard_dir):
    """meta.json as written before it carried the digest of its config."""
    meta_file = shard_dir / "tables" / "a" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["config_sha256"]
    meta_file.write_text(json.dumps(meta))
    table = Table.open(shard_dir / "tables" / "a")
    assert len(stored_segments(table)) == 30
    table.close()
    assert "config_sha256" in json.loads(meta_file.read_text())


def test_sampler_files_must_agree_with_meta(tmp_path):
    with Shard(tmp_path / "s") as shard:
        fill(shard.create_table(TableConfig.prioritized("p", 100)), 1, 2)
        fill(shard.create_table(TableConfig.uniform("u", 100)), 1, 2)
    tables = tmp_path / "s" / "tables"
    (tables / "p" / "priorities.bin").unlink()
    with pytest.raises(StorageCorruptedError, match="priorities.bin"):
        Table.open(tables / "p")
    (tables / "u" / "priorities.bin").write_bytes(b"\0" * 808)
    with pytest.raises(StorageCorruptedError, match="priorities.bin"):
        Table.open(tables / "u")


def test_spec_must_agree_with_the_column_index(shard_dir):
    table_dir = shard_dir / "tables" / "a"
    index_file = table_dir / "data" / "columns" / "index.json"
    index = json.loads(index_file.read_text())
    index["columns"] = index["columns"][1:]
    index_file.write_text(json.dumps(index))
    with pytest.raises(StorageCorruptedError, match="index.json"):
        Table.open(table_dir)


def test_missing_column_file_is_refused_not_recreated_empty(shard_dir):
    table_dir = shard_dir / "tables" / "a"
    (table_dir / "data" / "columns" / "action.bin").unlink()
    with pytest.raises(StorageCorruptedError, match="action.bin"):
        Table.open(table_dir)
    assert not (table_dir / "data" / "columns" / "action.bin").exists()


def test_missing_data_directory_is_refused_by_name(shard_dir):
    table_dir = shard_dir / "tables" / "a"
    shutil.rmtree(table_dir / "data")
    with pytest.raises(StorageCorruptedError, match="data is missing"):
        Table.open(table_dir)
    assert not (table_dir / "data").exists()


def test_missing_counters_bin_is_refused_by_name(shard_dir):
    table_dir = shard_dir / "tables" / "a"
    (table_dir / "counters.bin").unlink()
    with pytest.raises(StorageCorruptedError) as e:
        Table.open(table_dir)
    assert "counters.bin" in str(e.value) and "backup" in str(e.value)
    (table_dir / "counters.bin").write_bytes(b"\0" * 10)
    with pytest.raises(StorageCorruptedError, match="counters.bin"):
        Table.open(table_dir)


@pytest.mark.parametrize(
    "text",
    [
        b"not json",
        b"\xff\xfe\x00garbage",
        b"[]",
        b"null",
        b'{"format": 2}',
        b'{"format": 2, "config": []}',
        b'{"format": 2, "config": {"name": "a", "capacity": 400, "spec": 5}}',
        b"",
    ],
)
def test_garbled_meta_json_is_one_refusal_naming_it(shard_dir, text):
    table_dir = shard_dir / "tables" / "a"
    (table_dir / "meta.json").write_bytes(text)
    with pytest.raises(StorageCorruptedError) as e:
        Table.open(table_dir)
    message = str(e.value)
    assert "meta.json" in message and "\n" not in message and "backup" in message


@pytest.mark.parametrize("text", [b"not json", b"[1, 2]", b"null", b'{"x": "y"}', b"\xff"])
def test_garbled_writers_json_is_one_refusal_naming_it(shard_dir, text):
    table_dir = shard_dir / "tables" / "a"
    (table_dir / "writers.json").write_bytes(text)
    with pytest.raises(StorageCorruptedError) as e:
        Table.open(table_dir)
    message = str(e.value)
    assert "writers.json" in message and "\n" not in message and "delete" in message


# -- read-only directories -------------------------------------------------------------------
@pytest.fixture
def read_only_copy(shard_dir, tmp_path):
    """A read-only bind mount of the shard (read-only for root too); skips without mount."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    bind = subprocess.run(["mount", "--bind", str(shard_dir), str(mnt)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount (needs root): {bind.stderr.decode().strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only: {ro.stderr.decode().strip()}")
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_read_only_shard_directory_is_refused_by_name(read_only_copy):
    with pytest.raises(StorageCorruptedError) as e:
        Shard(read_only_copy)
    message = str(e.value)
    assert str(read_only_copy) in message and "writable" in message and "\n" not in message


def test_read_only_table_directory_is_refused_by_name(tmp_path):
    with Shard(tmp_path / "s") as shard:
        fill(shard.create_table(TableConfig.uniform("a", 100)), 1, 2)
        shard.create_table(TableConfig.uniform("b", 100))
    table_dir = tmp_path / "s" / "tables" / "a"
    mnt = table_dir
    bind = subprocess.run(["mount", "--bind", str(mnt), str(mnt)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip("cannot bind-mount (needs root)")
    try:
        ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip("cannot remount read-only")
        with pytest.raises(StorageCorruptedError) as e:
            Table.open(table_dir)
        assert "writable" in str(e.value) and str(table_dir) in str(e.value)
        with Shard(tmp_path / "s") as shard:
            assert sorted(shard.tables) == ["b"]
            with pytest.raises(StorageCorruptedError, match="writable"):
                shard.table("a")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- millpond serve on a damaged directory ---------------------------------------------------
def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "millpond.cli", "serve", "--port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_serve_on_a_damaged_table_it_is_asked_to_create_exits_with_one_line(shard_dir, tmp_path):
    (shard_dir / "tables" / "a" / "meta.json").write_text("{garbled")
    tables = tmp_path / "tables.yaml"
    tables.write_text("tables:\n  - name: a\n    sampler: uniform\n    capacity: 400\n")
    done = serve("--dir", str(shard_dir), "--tables", str(tables))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("millpond: error:")]
    assert len(errors) == 1 and "meta.json" in errors[0], done.stderr


def test_serve_on_a_read_only_shard_exits_with_one_line(read_only_copy):
    done = serve("--dir", str(read_only_copy))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("millpond: error:")]
    assert len(errors) == 1 and "writable" in errors[0], done.stderr


def test_serve_refuses_a_damaged_table_by_name_and_serves_the_rest(shard_dir):
    import grpc

    from millpond.protos import millpond_pb2 as pb
    from millpond.protos import millpond_pb2_grpc as pb_grpc

    lose_meta(shard_dir / "tables" / "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "millpond.cli", "serve", "--port", "0", "--dir", str(shard_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = None
        for line in proc.stdout:
            if line.startswith("ADDRESSES "):
                address = line.split()[1]
                break
        assert address is not None, proc.stderr.read()
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ReplayStub(channel)
            info = stub.Info(pb.InfoRequest(), timeout=10)
            assert [t.config.name for t in info.tables] == ["b"]
            # An operator asking the shard sees the refused table and why.
            assert list(info.refused_tables) == ["a"]
            assert "meta.json" in info.refused_tables["a"]
            from millpond import ReplayClient

            client = ReplayClient(address)
            try:
                refused = client.info()["shards"][0]["refused_tables"]
                assert list(refused) == ["a"] and "backup" in refused["a"]
            finally:
                client.close()
            with pytest.raises(grpc.RpcError) as e:
                stub.Info(pb.InfoRequest(table="a"), timeout=10)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS
            assert "meta.json" in e.value.details() and "backup" in e.value.details()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert "Traceback" not in stderr
    logged = [line for line in stderr.splitlines() if "ERROR" in line]
    assert len(logged) == 1 and "tables/a" in logged[0] and "meta.json" in logged[0], stderr
