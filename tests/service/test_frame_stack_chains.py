"""Frame-stacked segments that continue their predecessor: stored without older frames of
their own, their stacks rebuilt exactly.

A writer's lanes send short segments of their episodes (1, 2, 3 or 16 steps), interleaved,
episodes ending and starting, some padded by repeating the first frame and some by zeros.
Every frame encodes ``(episode, step)``, so each sampled stack is compared, bit for bit,
with the stack a plain loop builds from the episode; the chain layout on disk is checked
on its own (:func:`_check_chains`): a continuation is published only while every segment
its stacks read is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond.colocated import ColocatedReader
from millpond.config import TableConfig
from millpond.segments import Segment
from millpond.service.table import Table
from millpond.storage_format import (
    CHAINS_FILE,
    ChainField,
    RecordField,
    ensure_token,
    storage_identity,
)
from millpond.testing import stored_segments

K = 4
FRAME = (2, 3)


def _frames(episode: int, steps: torch.Tensor) -> torch.Tensor:
    """Frame ``t`` of ``episode`` (``[len(steps), *FRAME]``); before step 0 the env's
    padding: the first frame again (even episodes) or zeros (odd ones)."""
    t = steps.to(torch.float32)
    if episode % 2 == 0:
        t = t.clamp(min=0)
    f = torch.stack([torch.full_like(t, float(episode)), t], 1)[:, :, None].expand(-1, -1, 3)
    f = f * torch.tensor([1.0, 1.0, 0.5])
    if episode % 2:
        f = f * (steps >= 0).to(torch.float32)[:, None, None]
    return f.contiguous()


def _stacks(episode: int, steps: torch.Tensor) -> torch.Tensor:
    """The observations at ``steps``: the last ``K`` frames each, oldest first."""
    return torch.stack([_frames(episode, steps - (K - 1 - j)) for j in range(K)], 1)


def _segment(episode: int, first: int, length: int, ends: bool, sequence: int) -> Segment:
    steps = torch.arange(first, first + length)
    last = torch.zeros(length, 1, dtype=torch.bool)
    last[-1] = ends
    td = TensorDict(
        {
            "observation": _stacks(episode, steps),
            "action": torch.stack([torch.full_like(steps, episode), steps], 1),
            "next": {"terminated": last, "truncated": torch.zeros(length, 1, dtype=torch.bool)},
        },
        [length],
    )
    tail = TensorDict({"observation": _stacks(episode, steps[-1:] + 1)[0]}, [])
    return Segment(td, tail, episode, first, sequence)


def _lanes(lanes: int, steps: int, chunk: int, seed: int, base: int = 0, vary: bool = False):
    """Inserts as an actor with ``lanes`` lanes sends them: each lane's next ``chunk``
    steps (cut at its episode's end; ``vary``: 1 to ``chunk`` steps) per insert, episodes
    of random lengths."""
    rng = np.random.default_rng(seed)
    state = [[base + 1000 * lane, 0, int(rng.integers(5, 60))] for lane in range(lanes)]
    seq = 0
    for _ in range(0, steps, chunk):
        batch = []
        for s in state:
            ep, t, end = s
            n = min(int(rng.integers(1, chunk + 1)) if vary else chunk, end - t)
            seq += 1
            batch.append(_segment(ep, t, n, t + n == end, seq))
            if t + n == end:
                s[:] = [ep + 1, 0, int(rng.integers(5, 60))]
            else:
                s[1] = t + n
        yield batch


def _check_rows(td) -> None:
    ep, st = td["episode_id"], td["step"]
    for i in range(len(ep)):
        e, t = int(ep[i]), int(st[i])
        ref = _stacks(e, torch.tensor([t, t + 1]))
        assert torch.equal(td["observation"][i], ref[0]), (e, t)
        assert torch.equal(td["next", "observation"][i], ref[1]), (e, t)
        assert td["action"][i].tolist() == [e, t]


def _check_chains(table: Table) -> tuple[int, int]:
    """Every published continuation follows a published predecessor of its chain, back to
    a first segment that holds the chain's prefix row; returns (segments, chains)."""
    storage = table.storage
    chains, records = storage.chains, storage.records
    assert chains is not None
    live = np.flatnonzero(records[:, RecordField.GENERATION] > 0)
    roots = 0
    for r in live.tolist():
        start, cs = int(records[r, RecordField.START]), int(chains[r, ChainField.START])
        if cs == start:
            roots += 1
            continue
        assert cs < start
        for slot in range(cs, start):  # every slot it may read, back to its chain's start
            p = int(storage.slot_records[slot])
            assert p and records[p, RecordField.GENERATION] > 0, (r, slot)
            assert (chains[p] == chains[r]).all()
    return len(live), roots


def _sample_all(table: Table) -> None:
    for _ in range(4):
        _check_rows(table.sample(256))


@pytest.mark.parametrize("chunk", [1, 2, 3, 16])
def test_continuations_store_no_prefix_and_rebuild_exactly(tmp_path, chunk):
    # 1/64 of the ring over 5 lanes: regions of 204 slots, room for chunks of 16.
    config = TableConfig.uniform("t", 1 << 16, frame_stacks={"observation": K}, seed=chunk)
    table = Table.create(tmp_path / "t", config)
    for batch in _lanes(lanes=5, steps=600, chunk=chunk, seed=chunk):
        table.insert_many(batch, writer_id="actor-0")
    segments, chains = _check_chains(table)
    # A prefix row per chain, not per segment, and about a slot a step.
    assert chains < segments / 2
    assert table.storage._next_prefix - 1 == chains
    assert int(np.count_nonzero(table.storage.slot_records)) <= table.size * 1.1
    _sample_all(table)
    before = stored_segments(table)
    slots = np.sort(table.storage.published_step_slots())
    now, nxt = table.storage.gather(slots)
    table.close()
    table = Table.open(tmp_path / "t")
    assert table.storage.corrupted == []
    assert stored_segments(table) == before
    again, nxt_again = table.storage.gather(slots)
    assert torch.equal(again[("observation",)], now[("observation",)])
    assert torch.equal(nxt_again[("observation",)], nxt[("observation",)])
    _sample_all(table)
    table.close()


@pytest.mark.parametrize(("chunk", "vary"), [(1, False), (3, True), (5, False), (7, True)])
def test_eviction_takes_a_chain_s_later_segments_along(tmp_path, chunk, vary):
    """The ring wraps over regions of chains, again and again: no stack is ever rebuilt from
    overwritten frames, and the later segments of a chain whose start went go too."""
    config = TableConfig.uniform("t", 2048, frame_stacks={"observation": K}, seed=chunk)
    table = Table.create(tmp_path / "t", config)
    for i, batch in enumerate(_lanes(lanes=6, steps=2000, chunk=chunk, seed=chunk, vary=vary)):
        table.insert_many(batch, writer_id="actor-0")
        if i % 50 == 49:
            _check_chains(table)
            _check_rows(table.sample(128))
    assert table.metrics()["evicted"] > 2 * 2048
    _check_chains(table)
    _sample_all(table)
    table.close()


def _fill_and_close(path, chunk: int = 2) -> tuple[dict, Table]:
    config = TableConfig.uniform("t", 4096, frame_stacks={"observation": K}, seed=3)
    table = Table.create(path, config)
    for batch in _lanes(lanes=4, steps=300, chunk=chunk, seed=7):
        table.insert_many(batch, writer_id="actor-0")
    before = stored_segments(table)
    return before, table


def _a_chain(table: Table) -> tuple[int, list[int]]:
    """The record of a chain's first segment and those of its continuations."""
    storage = table.storage
    live = np.flatnonzero(storage.records[:, RecordField.GENERATION] > 0)
    starts = storage.records[live, RecordField.START]
    cs = storage.chains[live, ChainField.START]
    roots = live[cs == starts]
    for r in roots.tolist():
        follow = live[(cs == storage.records[r, RecordField.START]) & (cs != starts)]
        if len(follow) >= 3:
            return r, follow.tolist()
    raise AssertionError("no chain of four segments")


@pytest.mark.parametrize("verify", ["open", "reads"])
def test_a_damaged_chain_start_drops_its_continuations(tmp_path, verify):
    before, table = _fill_and_close(tmp_path / "t")
    root, follow = _a_chain(table)
    prefix_row = int(table.storage.chains[root, ChainField.PREFIX])
    table.close()
    prefix = next((tmp_path / "t" / "data" / "prefixes").iterdir())
    raw = bytearray(prefix.read_bytes())
    row_bytes = len(raw) // (4096 // 2 + 1)
    raw[prefix_row * row_bytes] ^= 0x40
    prefix.write_bytes(bytes(raw))
    table = Table.open(tmp_path / "t", verify=verify)
    for _ in range(8):
        _check_rows(table.sample(256))
    table.verify_all()
    assert len(table.storage.corrupted) >= 1
    gens = table.storage.records[[root, *follow], RecordField.GENERATION]
    assert (gens == 0).all()
    _check_chains(table)
    assert len(stored_segments(table)) == len(before) - 1 - len(follow)
    table.close()


def test_an_interrupted_eviction_leaves_no_orphan(tmp_path):
    """A kill between clearing a chain's first segment and its continuations (the order a
    crash may leave): recovery drops those continuations, and all else stays exact."""
    before, table = _fill_and_close(tmp_path / "t")
    root, follow = _a_chain(table)
    table.close()
    records = np.memmap(tmp_path / "t" / "data" / "segments.bin", dtype=np.int64, mode="r+")
    records = records.reshape(-1, len(RecordField))
    records[root, RecordField.GENERATION] = 0
    records.flush()
    del records
    table = Table.open(tmp_path / "t")
    assert (table.storage.records[follow, RecordField.GENERATION] == 0).all()
    assert len(stored_segments(table)) == len(before) - 1 - len(follow)
    _check_chains(table)
    _sample_all(table)
    table.close()


def test_a_table_with_stacks_made_before_chains_opens_as_it_was(tmp_path):
    """No ``chains.bin`` and a record per two slots: prefixes by record, no regions."""
    config = TableConfig.uniform("t", 1024, frame_stacks={"observation": K}, seed=4)
    table = Table.create(tmp_path / "t", config)
    table.close()
    data = tmp_path / "t" / "data"
    (data / CHAINS_FILE).unlink()
    with open(data / "segments.bin", "r+b") as f:
        f.truncate((1024 // 2 + 1) * 64)
    with open(data / "checksums.bin", "r+b") as f:
        f.truncate((1024 // 2 + 1) * 8)
    table = Table.open(tmp_path / "t")
    assert table.storage.chains is None and not table.storage.continuations
    for batch in _lanes(lanes=3, steps=200, chunk=2, seed=1):
        table.insert_many(batch, writer_id="actor-0")
    _sample_all(table)
    before = stored_segments(table)
    table.close()
    table = Table.open(tmp_path / "t")
    assert stored_segments(table) == before and table.storage.chains is None
    _sample_all(table)
    table.close()


def test_a_missing_chains_file_refuses_the_table(tmp_path):
    _, table = _fill_and_close(tmp_path / "t")
    table.close()
    (tmp_path / "t" / "data" / CHAINS_FILE).unlink()
    with pytest.raises(Exception, match="chains.bin is missing"):
        Table.open(tmp_path / "t")


def test_the_colocated_reader_rebuilds_continuations_alike(tmp_path):
    _, table = _fill_and_close(tmp_path / "t", chunk=1)
    directory = table.storage.path.resolve()
    assert ensure_token(directory)
    config = table.config
    reader = ColocatedReader(
        directory, storage_identity(directory), config.capacity, config.spec, config.frame_stacks
    )
    for _ in range(4):
        sampled = table.sample_colocated(128)
        obs, nxt, stale = reader.read(
            sampled.slots, sampled.generations, sampled.rows, sampled.next_rows
        )
        assert not stale.any()
        batch = sampled.ted
        batch.set("observation", obs[("observation",)])
        batch.set(("next", "observation"), nxt[("observation",)])
        _check_rows(batch)
    table.close()


def test_a_chain_dropped_while_its_writer_goes_on(tmp_path):
    """A segment found damaged while its lane is still sending (``verify_reads``): it goes
    with the rest of its chain, and the lane's next segments start a new one."""
    config = TableConfig.uniform(
        "t", 4096, frame_stacks={"observation": K}, seed=5, verify_reads=True
    )
    table = Table.create(tmp_path / "t", config)
    inserts = _lanes(lanes=1, steps=400, chunk=2, seed=11)
    for _ in range(10):
        table.insert_many(next(inserts), writer_id="actor-0")
    storage = table.storage
    live = np.flatnonzero(storage.records[:, RecordField.GENERATION] > 0)
    last = int(live[np.argmax(storage.records[live, RecordField.START])])
    assert storage.chains[last, ChainField.START] < storage.records[last, RecordField.START]
    slot = int(storage.chains[last, ChainField.START])  # its chain's first step
    storage.columns[("observation",)][slot] += 1  # the file changed under the table
    for _ in range(20):
        table.sample(64)  # drops the damaged segment, and its chain's later ones
        if storage.records[last, RecordField.GENERATION] == 0:
            break
    assert storage.records[last, RecordField.GENERATION] == 0
    assert len(storage.corrupted) >= 1
    for batch in inserts:
        table.insert_many(batch, writer_id="actor-0")
    _check_chains(table)
    _sample_all(table)
    table.close()
