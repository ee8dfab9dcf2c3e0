"""The weight store's disk writes: a fetch never waits for a publication's fsync, a
publication is flushed to disk only with ``fsync`` (the shard's ``--fsync``), and a
publication that fails or is refused leaves no file behind."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from millpond.errors import InvalidDataError
from millpond.service.weights import WeightStore


def test_a_fetch_does_not_wait_for_a_publications_disk_write(tmp_path, monkeypatch):
    store = WeightStore(tmp_path, fsync=True)
    store.publish(0, b"old")
    in_sync, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_disk(fd: int) -> None:  # the first sync (the blob's) holds until released
        if not in_sync.is_set():
            in_sync.set()
            release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_disk)
    publishing = threading.Thread(target=store.publish, args=(1, b"new"), daemon=True)
    publishing.start()
    assert in_sync.wait(5)
    fetched: list = []
    fetch = threading.Thread(target=lambda: fetched.append(store.get(0, 0, "a", acting=True)))
    fetch.start()
    fetch.join(5)
    try:
        assert not fetch.is_alive(), "a fetch waited for the publication's fsync"
        assert fetched == [(0, b"old")]  # the old version, until the new one is on disk
    finally:
        release.set()
        publishing.join(5)
        fetch.join(5)
    assert store.get(1) == (1, b"new")
    assert WeightStore(tmp_path).get(1) == (1, b"new")  # what a restarted shard serves


def test_a_full_disk_or_a_refusal_leaves_no_file_and_the_old_weights(tmp_path, monkeypatch):
    store = WeightStore(tmp_path, fsync=True)
    store.publish(3, b"three")
    before = sorted(p.name for p in tmp_path.iterdir())

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(OSError, match="No space left"):
            store.publish(4, b"four")
    with pytest.raises(InvalidDataError, match="not newer"):
        store.publish(2, b"two")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert store.get(0) == (3, b"three")
    assert WeightStore(tmp_path).get(0) == (3, b"three")


def test_a_publication_a_crash_cut_short_is_cleared_on_open(tmp_path):
    WeightStore(tmp_path).publish(0, b"w")
    (tmp_path / "weights-1.1234.tmp").write_bytes(b"half")
    (tmp_path / "weights-1.tmp").write_bytes(b"half")
    store = WeightStore(tmp_path)
    assert store.get(0) == (0, b"w")
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("fsync", [False, True])
def test_a_publication_is_flushed_to_disk_only_with_fsync(tmp_path, monkeypatch, fsync):
    """Without ``fsync`` nothing waits for the disk; either way the publication is complete
    on disk once acknowledged, as a restarted shard (after kill -9: the page cache) reads it."""
    synced: list[int] = []
    real_fsync = os.fsync

    def counted(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    store = WeightStore(tmp_path, fsync=fsync)
    store.publish(0, b"zero")
    monkeypatch.setattr(os, "fsync", counted)
    store.publish(1, b"one")
    # the blob, the index (weights.json) and the directory
    assert len(synced) == (3 if fsync else 0)
    assert WeightStore(tmp_path).get(0) == (1, b"one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-1.bin", "weights.json"]
