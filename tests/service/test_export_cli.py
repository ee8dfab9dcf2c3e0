"""``millpond export`` / ``millpond import`` as a user runs them: real CLI processes on a shard
directory, exports compared bit for bit with the table's rows, round trips, TorchRL's
FlatStorageCheckpointer restoring an export, and bad input answered in one line, exit 2."""

import gc
import signal
import subprocess
import sys
from collections import defaultdict

import gymnasium
import pytest
import torch
from tensordict import TensorDict

from millpond import Shard, Table, TableConfig
from millpond.cli import main
from millpond.errors import InvalidDataError
from millpond.service.export import export_ted, load_hdf5
from millpond.testing import TED_ROW_KEYS, rollout


# -- helpers --------------------------------------------------------------------------------
def cli(*args):
    """Run ``python -m millpond.cli ARGS``; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "millpond.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
    )


def leaves(td):
    return dict(td.items(include_nested=True, leaves_only=True))


def assert_same_rows(a, b):
    """Same keys, dtypes, shapes and bytes, row for row (NaNs and -0.0 included)."""
    la, lb = leaves(a), leaves(b)
    assert set(la) == set(lb)
    for key, value in la.items():
        other = lb[key]
        assert (value.dtype, value.shape) == (other.dtype, other.shape), key
        assert torch.equal(
            value.contiguous().view(torch.uint8), other.contiguous().view(torch.uint8)
        ), key


def rows_by_step(td, ids, steps):
    """{(episode, step): bytes of the row's TED_ROW_KEYS}."""
    cols = [td[k].reshape(td.shape[0], -1).contiguous().view(torch.uint8) for k in TED_ROW_KEYS]
    return {
        (e, s): tuple(c[i].numpy().tobytes() for c in cols)
        for i, (e, s) in enumerate(zip(ids, steps, strict=True))
    }


def recorded_by_step(td):
    """The rollout's rows keyed by (trajectory id, step within it), lane after lane."""
    td = td if td.batch_dims == 2 else td.unsqueeze(0)
    ids, steps, counter = [], [], defaultdict(int)
    for tid in td["collector", "traj_ids"].reshape(-1).tolist():
        ids.append(tid)
        steps.append(counter[tid])
        counter[tid] += 1
    return rows_by_step(td.reshape(-1), ids, steps)


def exported_by_step(out):
    return rows_by_step(out, out["episode_id"].tolist(), out["step"].tolist())


ONE_LANE = rollout(gymnasium.make("CartPole-v1"), 120, seed=0)
TWO_LANES = torch.stack(
    [rollout(gymnasium.make("CartPole-v1"), 60, seed=p, episode_offset=100 * p) for p in (1, 2)]
)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """A shard directory as ``millpond serve --dir`` leaves it: table ``one`` (one lane,
    extended in two calls: episodes span them; the last is unfinished) and ``two`` (two
    lanes, each ending in an unfinished episode)."""
    path = tmp_path_factory.mktemp("shard")
    with Shard(path) as shard:
        one = shard.create_table(TableConfig.uniform("one", 400))
        one.extend(ONE_LANE[:50])
        one.extend(ONE_LANE[50:])
        shard.create_table(TableConfig.uniform("two", 400)).extend(TWO_LANES)
    del shard, one
    released()
    return path


def released():
    """Drop closed tables' memory maps: a process that maps a table's files writable holds
    it, for the CLI's check, until the maps are gone."""
    gc.collect()


def table_rows(shard_dir, name, out):
    """The table's rows as exported in-process (the reference for the CLI's)."""
    table = Table.open(shard_dir / "tables" / name)
    try:
        return export_ted(table, out)
    finally:
        table.close()
        del table
        released()


# -- export, import, round trips ----------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt, flags",
    [("ted", []), ("hdf5", ["--compression", "gzip", "--compression-level", "6"])],
)
def test_export_import_export_is_bitwise(shard_dir, tmp_path, fmt, flags):
    if fmt == "hdf5":
        pytest.importorskip("h5py")
    name = "out" if fmt == "ted" else "out.h5"
    first = cli("export", shard_dir, "--table", "one", "--format", fmt, *flags, tmp_path / name)
    assert first.returncode == 0, first.stderr
    line = first.stdout.strip()
    assert line.startswith(f"millpond: exported 120 rows of table 'one' to {tmp_path / name}")
    assert "bytes)" in line and "\n" not in line
    assert "FlatStorageCheckpointer" not in first.stderr  # one lane: no break

    load = TensorDict.load_memmap if fmt == "ted" else load_hdf5
    out = load(tmp_path / name)
    assert_same_rows(out, table_rows(shard_dir, "one", tmp_path / "reference"))
    assert exported_by_step(out) == recorded_by_step(ONE_LANE)
    if fmt == "hdf5":
        import h5py

        with h5py.File(tmp_path / name) as f:
            ds = f["next/observation"]
            assert (ds.compression, ds.compression_opts) == ("gzip", 6)

    imported = cli("import", tmp_path / name, "--format", fmt, tmp_path / "new", "--table", "t")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith("millpond: imported 120 rows into table 't' of ")
    again = cli("export", tmp_path / "new", "--table", "t", "--format", fmt, *flags, tmp_path / "2")
    assert again.returncode == 0, again.stderr
    assert_same_rows(load(tmp_path / "2"), out)  # same rows, same order, every key
    # it says the largest batch the new table samples, and that batch works, one more not
    largest = int(imported.stdout.split("batches of at most ")[1].split()[0])
    table = Table.open(tmp_path / "new" / "tables" / "t")
    try:
        assert largest == table.config.capacity
        assert table.sample(largest).batch_size == (largest,)
        with pytest.raises(InvalidDataError, match="exceeds the capacity"):
            table.sample(largest + 1)
    finally:
        table.close()


def test_import_keeps_steps_and_random_episode_ids(tmp_path):
    """Rows whose episodes began before the oldest stored segment (evicted) and episode ids
    from data without trajectory ids (random, >= 2**62) come back as they were."""
    with Shard(tmp_path / "a") as shard:
        table = shard.create_table(TableConfig.uniform("ring", 60))
        for start in range(0, 120, 30):  # the ring keeps the newest ~60 slots
            table.extend(ONE_LANE[start : start + 30])
        table.extend(TWO_LANES[0].exclude("collector"))  # fresh random episode ids
    del shard, table
    released()
    out = table_rows(tmp_path / "a", "ring", tmp_path / "ref")
    assert (out["episode_id"] >= 2**62).any()
    assert main(["export", str(tmp_path / "a"), "--table", "ring", "--format", "ted",
                 str(tmp_path / "e")]) == 0  # fmt: skip
    assert main(["import", str(tmp_path / "e"), "--format", "ted", str(tmp_path / "b"),
                 "--table", "ring"]) == 0  # fmt: skip
    assert_same_rows(table_rows(tmp_path / "b", "ring", tmp_path / "again"), out)
    # --source: the episodes numbered anew in that source's range, all else kept.
    assert main(["import", str(tmp_path / "e"), "--format", "ted", str(tmp_path / "b"),
                 "--table", "sourced", "--source", "offline"]) == 0  # fmt: skip
    sourced = table_rows(tmp_path / "b", "sourced", tmp_path / "sourced")
    assert len(set(sourced["episode_id"].tolist())) == len(set(out["episode_id"].tolist()))
    assert (sourced["episode_id"] < 2**62).all()
    assert_same_rows(
        sourced.exclude("episode_id", "collector"), out.exclude("episode_id", "collector")
    )


# -- TorchRL's flat checkpointer --------------------------------------------------------------
def flat_restore(export, path, checkpointer):
    """``export`` through a TorchRL ReplayBuffer dumped with ``checkpointer`` and loaded
    into a fresh one; returns the loaded buffer's rows."""
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    n = export.batch_size[0]
    rb = ReplayBuffer(storage=LazyMemmapStorage(n + 10))
    rb.storage.checkpointer = checkpointer()
    rb.extend(export)
    rb.dumps(path)
    restored = ReplayBuffer(storage=LazyMemmapStorage(n + 10))
    restored.storage.checkpointer = checkpointer()
    restored.loads(path)
    assert len(restored) == n
    return restored[:]


def test_export_restores_through_torchrl_flat_checkpointer_exactly(shard_dir, tmp_path):
    pytest.importorskip("torchrl")
    from torchrl.data import FlatStorageCheckpointer

    done = cli("export", shard_dir, "--table", "one", "--format", "ted", tmp_path / "export")
    assert done.returncode == 0, done.stderr
    export = TensorDict.load_memmap(tmp_path / "export")
    restored = flat_restore(export, tmp_path / "rb", FlatStorageCheckpointer)
    assert_same_rows(restored, export)  # every key of every row, bit for bit
    assert_same_rows(restored, table_rows(shard_dir, "one", tmp_path / "reference"))
    assert exported_by_step(restored) == recorded_by_step(ONE_LANE)
    # What makes it flat: each observation stored once, plus one per trajectory end (the
    # unfinished last one ends at the cursor), over the buffer's 130 rows.
    stored = TensorDict.load_memmap(tmp_path / "rb" / "storage")
    episodes = int(export["next", "done"].sum()) + 1
    assert stored["observation"].shape[0] == 130 + episodes
    assert ("next", "observation") not in stored.keys(True)


@pytest.mark.parametrize("order", ["publication", "episode"])
def test_export_says_when_the_flat_checkpointer_would_not_be_exact(shard_dir, tmp_path, order):
    """Two lanes, each ending in an unfinished episode: a row whose next observation is not
    the following row's, without done. The export counts such rows; TorchRL's flat
    checkpointer rebuilds exactly those wrong, its default checkpointer none."""
    pytest.importorskip("torchrl")
    from torchrl.data import FlatStorageCheckpointer
    from torchrl.data.replay_buffers.checkpointers import TensorStorageCheckpointer

    args = ["--table", "two", "--format", "ted", "--order", order, tmp_path / "export"]
    done = cli("export", shard_dir, *args)
    assert done.returncode == 0, done.stderr
    note = done.stderr.strip().splitlines()[-1]
    assert "TorchRL's FlatStorageCheckpointer would not restore this export exactly" in note
    breaks = int(note.split("note: ")[1].split()[0])
    export = TensorDict.load_memmap(tmp_path / "export")
    flat = flat_restore(export, tmp_path / "flat", FlatStorageCheckpointer)
    wrong = (flat["next", "observation"] != export["next", "observation"]).any(-1)
    assert int(wrong.sum()) == breaks >= 1
    assert_same_rows(flat.exclude("next"), export.exclude("next"))
    assert_same_rows(flat_restore(export, tmp_path / "plain", TensorStorageCheckpointer), export)
    if order == "episode":  # each episode's rows together, in step order
        ids, steps = export["episode_id"].tolist(), export["step"].tolist()
        for episode in set(ids):
            rows = [i for i, e in enumerate(ids) if e == episode]
            assert rows == list(range(rows[0], rows[-1] + 1))
            assert [steps[i] for i in rows] == sorted(steps[i] for i in rows)
    assert exported_by_step(export) == recorded_by_step(TWO_LANES)


def test_flat_breaks_are_counted_across_chunks(shard_dir, tmp_path, monkeypatch):
    """The count does not depend on where the exporter's chunks of rows fall."""
    import millpond.service.export as export_module

    whole = table_rows(shard_dir, "two", tmp_path / "whole")
    expected = export_module.flat_checkpoint_breaks(whole)
    assert expected >= 1
    monkeypatch.setattr(export_module, "EXPORT_CHUNK_ROWS", 7)
    assert export_module.flat_checkpoint_breaks(whole) == expected
    table = Table.open(shard_dir / "tables" / "two")
    try:
        summary = export_module.export_table(table, tmp_path / "chunked")
    finally:
        table.close()
        del table
        released()
    assert summary == export_module.ExportSummary(rows=120, flat_breaks=expected)
    assert_same_rows(TensorDict.load_memmap(tmp_path / "chunked"), whole)


# -- a running server, bad input --------------------------------------------------------------------
def test_a_table_a_running_server_holds_is_refused(shard_dir, tmp_path):
    table_rows(shard_dir, "one", tmp_path / "export")  # (before the server holds the table)
    server = subprocess.Popen(
        [sys.executable, "-m", "millpond.cli", "serve", "--dir", shard_dir, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in server.stdout:
            if line.startswith("ADDRESSES "):
                break
        result = cli("export", shard_dir, "--table", "one", "--format", "ted", tmp_path / "x")
        assert result.returncode == 2
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("millpond: error: table 'one' of ")
        assert "open in another process (a running `millpond serve" in last
        assert not (tmp_path / "x").exists()
        # Importing into a new table of a served shard: refused too, nothing created.
        result = cli("import", tmp_path / "export", "--format", "ted", shard_dir, "--table", "z")
        assert result.returncode == 2
        assert "open in another process" in result.stderr.strip().splitlines()[-1]
        assert not (shard_dir / "tables" / "z").exists()
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        server.stdout.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "{tmp}/nowhere", "--table", "one", "--format", "ted", "{tmp}/o"],
         "millpond: error: {tmp}/nowhere does not exist: pass a shard directory (what "
         "`millpond serve --dir` serves)"),
        (["export", "{shard}", "--table", "nope", "--format", "ted", "{tmp}/o"],
         "millpond: error: no table 'nope' in {shard} (tables: one, two)"),
        (["export", "{shard}", "--table", "one", "--format", "csv", "{tmp}/o"],
         "millpond: error: unknown format 'csv'; expected ted, hdf5 or minari"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(shard_dir, tmp_path, args, message):
    subs = {"tmp": tmp_path, "shard": shard_dir}
    result = cli(*[a.format(**subs) for a in args])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [message.format(**subs)]
    assert not (tmp_path / "o").exists()


def test_more_bad_input(shard_dir, tmp_path, capsys):
    def error(*args):
        assert main([str(a) for a in args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("millpond: error: "), lines
        return lines[0].removeprefix("millpond: error: ")

    (tmp_path / "many" / "shard-0" / "tables").mkdir(parents=True)
    (tmp_path / "many" / "shard-1" / "tables").mkdir(parents=True)
    assert error("export", tmp_path / "many", "--table", "one", "--format", "ted", tmp_path / "o")\
        .startswith(f"{tmp_path / 'many'} holds 2 shards (shard-0, shard-1), as `millpond serve "
                    f"--shards N` writes them: pass one shard directory, e.g. "
                    f"{tmp_path / 'many' / 'shard-0'}")  # fmt: skip
    table_dir = shard_dir / "tables" / "one"
    assert error("export", table_dir, "--table", "one", "--format", "ted", tmp_path / "o") == (
        f"{table_dir} is a table directory: pass its shard directory, {shard_dir}, with --table one"
    )
    (tmp_path / "exists").mkdir()
    assert error("export", shard_dir, "--table", "one", "--format", "ted", tmp_path / "exists") \
        == f"{tmp_path / 'exists'} exists: remove it or choose another path"  # fmt: skip
    assert "--compression is for --format hdf5" in error(
        "export", shard_dir, "--table", "one", "--format", "ted", "--compression", "gzip",
        tmp_path / "o",
    )  # fmt: skip
    assert "unknown HDF5 compression 'zip'" in error(
        "export", shard_dir, "--table", "one", "--format", "hdf5", "--compression", "zip",
        tmp_path / "o.h5",
    )  # fmt: skip
    assert "a compression level is for gzip only" in error(
        "export", shard_dir, "--table", "one", "--format", "hdf5", "--compression", "lzf",
        "--compression-level", "3", tmp_path / "o.h5",
    )  # fmt: skip
    # import: a missing or wrong input, a table that exists otherwise, rows that do not fit
    assert error("import", tmp_path / "none", "--format", "ted", tmp_path / "d", "--table", "t") \
        == f"{tmp_path / 'none'} does not exist"  # fmt: skip
    assert "is not a memory-mapped TensorDict directory" in error(
        "import", tmp_path / "exists", "--format", "ted", tmp_path / "d", "--table", "t"
    )
    assert not (tmp_path / "d").exists()  # nothing created for a failed import
    assert main(["export", str(shard_dir), "--table", "one", "--format", "ted",
                 str(tmp_path / "e")]) == 0  # fmt: skip
    assert error("import", tmp_path / "e", "--format", "ted", shard_dir, "--table", "one",
                 "--capacity", "999") == (
        "table 'one' exists with capacity 400; leave out --capacity to import into it as it is"
    )  # fmt: skip
    assert "more than table 'small' holds (capacity 100): pass --capacity" in error(
        "import", tmp_path / "e", "--format", "ted", tmp_path / "d", "--table", "small",
        "--capacity", "100",
    )  # fmt: skip
