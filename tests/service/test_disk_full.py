"""A full disk refuses inserts and keeps the shard serving.

A real ``millpond serve`` process keeps its tables on a small tmpfs, with tables whose
capacity needs several times what the filesystem holds. Segments are written through the
real client, one acknowledged at a time, until the shard refuses one: the refusal must be a
:class:`ResourceExhaustedError` saying "disk full", the process must stay alive, every
acknowledged segment must sample back bit for bit, and once space is freed inserts work
again. (The column and metadata files are sparse memory maps: writing a page that has no
block behind it on a full filesystem is a SIGBUS, which kills the process unless the
storage reserves the blocks first.)

Mounting needs root (or CAP_SYS_ADMIN); without it the tests skip.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from millpond import MillpondError, ReplayClient, ResourceExhaustedError, TableConfig
from millpond.service.table import Table
from millpond.testing import pattern, pattern_segment

TMPFS_BYTES = 4 * 1024 * 1024
OBS_SHAPE = (1024,)  # 1 KiB per slot: the tmpfs holds a few thousand
CAPACITY = 16_384  # a 16 MiB observation column: four times the tmpfs
SEGMENT_LEN = 32
BALLAST_BYTES = 256 * 1024  # deleted once the disk is full, so that inserts can resume
START_TIMEOUT_S = 90.0


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A tmpfs of :data:`TMPFS_BYTES`, unmounted at teardown."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mnt)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def server(small_disk, tmp_path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A one-shard ``millpond serve`` on the tmpfs; its address."""
    out, err = tmp_path / "server.out", tmp_path / "server.err"
    cmd = [sys.executable, "-m", "millpond.cli", "serve", "--dir", str(small_disk / "shard")]
    cmd += ["--port", "0"]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        address = None
        while address is None:
            for line in out.read_text().splitlines():
                if line.startswith("ADDRESSES "):
                    address = line.split()[1]
            if address is None:
                assert proc.poll() is None, f"server exited early:\n{err.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.05)
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def segment(episode: int) -> tuple[TensorDict, TensorDict]:
    """Steps and tail of one segment whose observations encode ``(episode, step)``."""
    made = pattern_segment(episode, 0, SEGMENT_LEN, OBS_SHAPE)
    return made.steps, made.tail


def fill_until_refused(
    client: ReplayClient, proc: subprocess.Popen, table: str, first_episode: int
) -> list[int]:
    """Write segments one at a time until the shard refuses one; the episodes stored."""
    writer = client.writer(table)
    stored = []
    episode = first_episode
    try:
        while episode < first_episode + CAPACITY:  # the ring never wraps before the disk fills
            td, tail = segment(episode)
            writer.write_segment(td, tail, episode_id=episode, first_step=0)
            writer.flush(20)
            stored.append(episode)
            episode += 1
    except MillpondError as e:
        refused = e
        with contextlib.suppress(MillpondError):  # a refused writer's close raises it again
            writer.close(timeout_s=5)
    else:
        raise AssertionError("the disk never filled up")
    assert proc.poll() is None, f"the shard died on a full disk (exit code {proc.returncode})"
    assert isinstance(refused, ResourceExhaustedError), repr(refused)
    assert "disk full" in str(refused) and "table dir" in str(refused), refused
    return stored


def check_samples(client: ReplayClient, table: str, episodes: list[int]) -> None:
    """Samples return only stored rows, each bit-exact, and cover most of them."""
    expected = set(episodes)
    seen = set()
    for _ in range(20):
        batch = client.sample(table, 512, timeout_s=30)
        obs = batch["observation"].reshape(len(batch), -1)
        head = obs[:, :16].contiguous().view(torch.int64)  # pattern's (episode, step) header
        eps, steps = head[:, 0], head[:, 1]
        assert set(eps.tolist()) <= expected
        assert torch.equal(obs, pattern(eps, steps, OBS_SHAPE).reshape(len(batch), -1))
        assert torch.equal(
            batch["next", "observation"].reshape(len(batch), -1),
            pattern(eps, steps + 1, OBS_SHAPE).reshape(len(batch), -1),
        )
        assert torch.equal(batch["action"], torch.stack([eps, steps], 1))
        assert torch.equal(batch["episode_id"], eps)
        assert torch.equal(batch["step"], steps)
        seen.update(eps.tolist())
    assert len(seen) > len(expected) // 2


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_full_disk_refuses_inserts_and_the_shard_keeps_serving(server, small_disk, sampler):
    proc, address = server
    client = ReplayClient(address)
    table = f"full_{sampler}"
    try:
        config = TableConfig(name=table, capacity=CAPACITY, sampler=sampler, seed=3)
        client.create_table(config)
        ballast = small_disk / "ballast"
        ballast.write_bytes(os.urandom(BALLAST_BYTES))

        stored = fill_until_refused(client, proc, table, first_episode=1)
        assert proc.poll() is None, "the shard died on a full disk"
        assert len(stored) > 10
        info = client.info(table)
        assert info["size"] == len(stored) * SEGMENT_LEN
        assert info["bytes_on_disk"] < TMPFS_BYTES
        check_samples(client, table, stored)
        # On a disk without a free block, creating a table is refused the same way.
        filler = small_disk / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        with pytest.raises(ResourceExhaustedError, match="disk full"):
            client.create_table(TableConfig(name=f"{table}_2", capacity=CAPACITY))
        assert proc.poll() is None
        filler.unlink()
        assert client.info(table)["size"] == len(stored) * SEGMENT_LEN

        # Space freed: inserts resume, and everything stored so far is still there.
        ballast.unlink()
        more = fill_until_refused(client, proc, table, first_episode=stored[-1] + 1)
        assert more, "no insert succeeded after space was freed"
        assert proc.poll() is None
        assert client.info(table)["size"] == (len(stored) + len(more)) * SEGMENT_LEN
        check_samples(client, table, stored + more)
    finally:
        client.close(timeout_s=5)
    assert proc.poll() is None


def _fill(path: Path) -> None:
    """Take every free block of the filesystem of ``path`` (a file of that name)."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_refused_insert_changes_nothing_and_the_table_reopens_on_a_full_disk(small_disk, sampler):
    path = small_disk / "t"
    config = TableConfig(name="t", capacity=CAPACITY, sampler=sampler, seed=3)
    table = Table.create(path, config)
    ballast = small_disk / "ballast"
    ballast.write_bytes(os.urandom(BALLAST_BYTES))
    stored = []
    try:
        with pytest.raises(ResourceExhaustedError, match="disk full") as refused:
            for ep in range(1, CAPACITY):
                before = (table.info(), table.storage.cursor, table.storage._next_record)
                table.insert(*segment(ep), episode_id=ep)
                stored.append(ep)
        assert "table dir" in str(refused.value) and "bytes needed" in str(refused.value)
        after = (table.info(), table.storage.cursor, table.storage._next_record)
        assert after == before, "the refused insert changed the table"
        assert table.size == len(stored) * SEGMENT_LEN and stored
        with pytest.raises(ResourceExhaustedError, match="disk full"):  # and again
            table.insert(*segment(10**6), episode_id=10**6)
        _check_table(table, stored)
    finally:
        table.close()
    _fill(small_disk / "filler")
    table = Table.open(path)  # recovery writes nothing into holes
    try:
        assert table.storage.corrupted == []
        _check_table(table, stored)
        with pytest.raises(ResourceExhaustedError, match="disk full"):
            table.insert(*segment(10**6), episode_id=10**6)
    finally:
        (small_disk / "filler").unlink()  # closing rewrites meta.json
        table.close()
    ballast.unlink()
    table = Table.open(path)
    try:
        table.insert(*segment(10**6), episode_id=10**6)
        _check_table(table, [*stored, 10**6])
    finally:
        table.close()


def _check_table(table: Table, episodes: list[int]) -> None:
    slots = table.storage.published_step_slots()
    assert len(slots) == len(episodes) * SEGMENT_LEN
    now, nxt = table.storage.gather(slots)
    obs = now[("observation",)]
    head = obs[:, :16].contiguous().view(torch.int64)
    eps, steps = head[:, 0], head[:, 1]
    assert sorted(set(eps.tolist())) == sorted(episodes)
    assert torch.equal(obs, pattern(eps, steps, OBS_SHAPE))
    assert torch.equal(nxt[("observation",)], pattern(eps, steps + 1, OBS_SHAPE))
    assert table.storage.verify(slots).all()
