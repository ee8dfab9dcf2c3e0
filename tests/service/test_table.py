"""Table behaviour: spec enforcement, bad input, blocking, reset, shards."""

import threading
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond import Shard, Table, TableConfig
from millpond.errors import (
    InvalidConfigError,
    InvalidDataError,
    RateLimiterTimeoutError,
    StorageCorruptedError,
    TableExistsError,
    TableNotFoundError,
)
from millpond.spec import FieldSpec, TableSpec


def segment(n=5, ep=0, obs_dim=3, end="terminated", obs_dtype=torch.float32, first=0):
    obs = (torch.arange(n + 1, dtype=torch.float64)[:, None] + first + 1000 * ep).expand(
        n + 1, obs_dim
    )
    flags = torch.zeros(n, 1, dtype=torch.bool)
    term, trunc = flags.clone(), flags.clone()
    if end == "terminated":
        term[-1] = True
    elif end == "truncated":
        trunc[-1] = True
    steps = TensorDict(
        {
            "observation": obs[:-1].to(obs_dtype),
            "action": torch.arange(n, dtype=torch.int64),
            "next": {"reward": torch.ones(n, 1), "terminated": term, "truncated": trunc},
        },
        [n],
    )
    return steps, TensorDict({"observation": obs[-1].to(obs_dtype)}, [])


@pytest.fixture
def table(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", 100, seed=0))
    yield t
    t.close()


def test_spec_taken_from_first_insert_then_enforced(table):
    table.insert(*segment(), episode_id=0)
    assert table.spec.fields[("observation",)] == FieldSpec(torch.float32, (3,), "observation")
    assert table.spec.fields[("next", "terminated")].dtype == torch.bool
    with pytest.raises(InvalidDataError, match=r"'observation'.*float32\[3\].*float64\[3\]"):
        table.insert(*segment(obs_dtype=torch.float64), episode_id=1)
    with pytest.raises(InvalidDataError, match=r"'observation'.*float32\[3\].*float32\[4\]"):
        table.insert(*segment(obs_dim=4), episode_id=1)
    assert table.size == 5  # nothing of the bad inserts was stored


def test_declared_spec(tmp_path):
    spec = TableSpec(
        {
            ("observation",): FieldSpec(torch.float32, (3,), "observation"),
            ("action",): FieldSpec(torch.int64, ()),
            ("next", "reward"): FieldSpec(torch.float32, (1,)),
            ("next", "terminated"): FieldSpec(torch.bool, ()),
            ("next", "truncated"): FieldSpec(torch.bool, ()),
        }
    )
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", 50, spec=spec))
    steps, tail = segment()
    t.insert(steps, tail, episode_id=0)
    steps["extra"] = torch.zeros(5)
    with pytest.raises(InvalidDataError, match="unexpected key.*'extra'"):
        t.insert(steps, tail, episode_id=1)
    del steps["action"]
    with pytest.raises(InvalidDataError, match="missing key.*'action'"):
        t.insert(steps, tail, episode_id=1)
    t.close()


def test_bad_segments_store_nothing(table):
    table.insert(*segment(), episode_id=0)
    before = table.info()
    steps, tail = segment()
    bad = steps.clone()
    bad["next", "observation"] = steps["observation"]
    with pytest.raises(InvalidDataError, match="send each observation once"):
        table.insert(bad, tail, episode_id=1)
    bad = steps.clone()
    bad["next", "terminated"][1] = True
    with pytest.raises(InvalidDataError, match="episode ends at step 1"):
        table.insert(bad, tail, episode_id=1)
    bad = steps.clone()
    bad["index"] = torch.zeros(5)
    with pytest.raises(InvalidDataError, match="reserved"):
        table.insert(bad, tail, episode_id=1)
    bad = steps.clone()
    bad["index", "slot"] = torch.zeros(5, dtype=torch.int64)  # would hide under the output's
    with pytest.raises(InvalidDataError, match=r"\('index', 'slot'\) is reserved"):
        table.insert(bad, tail, episode_id=1)
    bad = steps.clone()
    del bad["next", "terminated"]
    del bad["next", "truncated"]
    with pytest.raises(InvalidDataError, match="terminated"):
        table.insert(bad, tail, episode_id=1)
    with pytest.raises(InvalidDataError, match="lack observation key.*.other."):
        table.insert(steps, TensorDict({"other": torch.zeros(3)}, []), episode_id=1)
    with pytest.raises(InvalidDataError, match="capacity"):
        table.insert(*segment(n=100), episode_id=1)
    with pytest.raises(InvalidDataError, match=">= 0"):
        table.insert(steps, tail, episode_id=-1)
    after = table.info()
    assert (after["size"], after["inserts"]) == (before["size"], before["inserts"])
    s = table.sample(50)
    assert torch.equal(s["next", "observation"], s["observation"] + 1)


def test_done_only_flags_mean_terminated(table):
    steps, tail = segment(end="terminated")
    done = steps["next", "terminated"].clone()
    del steps["next", "terminated"]
    del steps["next", "truncated"]
    steps["next", "done"] = done
    table.insert(steps, tail, episode_id=0)
    s = table.sample(64)
    last = (s["step"] == 4).unsqueeze(-1)
    assert torch.equal(s["next", "terminated"], last)
    # A sampled transition stands alone: a step that did not terminate is truncated there.
    assert torch.equal(s["next", "truncated"], ~last)
    assert s["next", "done"].all()


def test_sample_output_layout(table):
    table.insert(*segment(end="truncated", ep=7, first=10), episode_id=7, first_step=10)
    s = table.sample(32)
    assert s.batch_size == torch.Size([32])
    assert s["observation"].shape == (32, 3) and s["next", "observation"].shape == (32, 3)
    for k in ("done", "terminated", "truncated"):
        assert s[k].shape == (32, 1) and not s[k].any()
        assert s["next", k].shape == (32, 1)
    assert (s["episode_id"] == 7).all()
    assert set(s["step"].tolist()) <= set(range(10, 15))
    assert torch.equal(s["action"], s["step"] - 10)
    assert not s["next", "terminated"].any()
    # Every sampled transition stands alone (its trajectory stops there): truncated.
    assert s["next", "truncated"].all() and s["next", "done"].all()
    assert torch.equal(s["observation"][:, 0], (7000 + s["step"]).float())
    assert set(s["index"].keys()) == {"slot", "generation"}


def test_bad_batch_size(table):
    table.insert(*segment(), episode_id=0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InvalidDataError, match="batch_size"):
            table.sample(bad)


def test_sample_blocks_until_min_size_then_times_out(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", 100, min_size=8))
    t.insert(*segment(n=5), episode_id=0)
    with pytest.raises(RateLimiterTimeoutError, match="5 steps stored.*min_size 8"):
        t.sample(4, timeout=0.05)
    got = []
    th = threading.Thread(target=lambda: got.append(t.sample(4, timeout=10)))
    th.start()
    time.sleep(0.1)
    assert not got
    t.insert(*segment(n=5, ep=1), episode_id=1)
    th.join(5)
    assert got and got[0].batch_size == torch.Size([4])
    t.close()


def test_samples_per_insert_blocks_inserts_until_learner_samples(tmp_path):
    cfg = TableConfig.uniform("t", 1000, min_size=5, samples_per_insert=1.0, error_buffer=5.0)
    t = Table.create(tmp_path / "t", cfg)
    t.insert(*segment(n=5), episode_id=0)  # below min size: free
    t.insert(*segment(n=5), episode_id=1)  # diff 5 <= max_diff 10
    t.insert(*segment(n=5), episode_id=2)  # diff 10 <= 10
    with pytest.raises(RateLimiterTimeoutError, match="rate limiter"):
        t.insert(*segment(n=5), episode_id=3, timeout=0.05)
    assert t.size == 15
    t.sample(8)
    t.insert(*segment(n=5), episode_id=3, timeout=1)
    assert t.info()["rate_limiter"]["diff"] == 12
    t.close()


def test_queue_blocks_writers_instead_of_dropping_unread_steps(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.queue("t", 12))
    t.insert(*segment(n=5), episode_id=0)
    t.insert(*segment(n=5), episode_id=1)
    with pytest.raises(RateLimiterTimeoutError, match="queue is full"):
        t.insert(*segment(n=5), episode_id=2, timeout=0.05)
    first = t.sample(5)
    assert (first["episode_id"] == 0).all()
    t.insert(*segment(n=5), episode_id=2, timeout=1)
    assert t.sample(5)["episode_id"].unique().tolist() == [1]
    assert t.sample(5)["episode_id"].unique().tolist() == [2]
    with pytest.raises(RateLimiterTimeoutError):
        t.sample(1, timeout=0.05)
    with pytest.raises(InvalidDataError, match="exceeds the capacity of table"):
        t.sample(13)
    t.close()


def test_reset_keeps_old_indexes_stale(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.prioritized("t", 100, seed=0))
    t.insert(*segment(), episode_id=0)
    old = t.sample(4)
    t.reset()
    assert t.size == 0 and t.info()["inserts"] == 0
    t.insert(*segment(), episode_id=1)
    assert t.update_priorities(old["index", "slot"], old["index", "generation"], np.ones(4)) == 0
    new = t.sample(4)
    assert (new["episode_id"] == 1).all()
    assert t.update_priorities(new["index", "slot"], new["index", "generation"], np.ones(4)) == 4
    t.close()


def test_update_priorities_rejects_bad_input(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.prioritized("t", 100, seed=0))
    t.insert(*segment(), episode_id=0)
    s = t.sample(4)
    slot, gen = s["index", "slot"], s["index", "generation"]
    with pytest.raises(InvalidDataError, match="equal in number"):
        t.update_priorities(slot, gen, np.ones(3))
    with pytest.raises(InvalidDataError, match="finite"):
        t.update_priorities(slot, gen, np.array([1.0, np.nan, 1.0, 1.0]))
    with pytest.raises(InvalidDataError, match="finite"):
        t.update_priorities(slot, gen, -np.ones(4))
    with pytest.raises(InvalidDataError, match="out of range"):
        t.update_priorities(slot + 1000, gen, np.ones(4))
    t.close()
    u = Table.create(tmp_path / "u", TableConfig.uniform("u", 100))
    u.insert(*segment(), episode_id=0)
    with pytest.raises(InvalidDataError, match="only for prioritized"):
        u.update_priorities(slot, gen, np.ones(4))
    u.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: TableConfig.uniform("", 10),
        lambda: TableConfig.uniform("a/b", 10),
        lambda: TableConfig.uniform("t", 1),
        lambda: TableConfig.uniform("t", 10, min_size=-1),
        lambda: TableConfig.uniform("t", 10, samples_per_insert=-1.0),
        lambda: TableConfig.uniform("t", 10, error_buffer=1.0),
        lambda: TableConfig.slices("t", 10, slice_len=0),
        lambda: TableConfig.slices("t", 10, slice_len=10),
        lambda: TableConfig.queue("t", 10, samples_per_insert=1.0),
        lambda: TableConfig.uniform("t", 10, compression="lz4"),
        lambda: TableConfig("t", 10, sampler="lifo"),
        lambda: TableConfig.prioritized("t", 10, alpha=-1.0),
    ],
)
def test_bad_config_raises(make):
    with pytest.raises(InvalidConfigError):
        make()


def test_config_json_round_trip():
    spec = TableSpec({("obs",): FieldSpec(torch.bfloat16, (2, 3), "observation")})
    cfg = TableConfig.slices("t", 64, 4, samples_per_insert=2.0, seed=3, spec=spec)
    back = TableConfig.from_json(cfg.to_json())
    assert back == cfg and back.spec == spec
    with pytest.raises(InvalidConfigError, match="unknown table config key"):
        TableConfig.from_json({**cfg.to_json(), "colour": "blue"})


def test_shard_resumes_every_table(tmp_path):
    with Shard(tmp_path / "shard") as shard:
        a = shard.create_table(TableConfig.uniform("a", 100))
        b = shard.create_table(TableConfig.queue("b", 100))
        a.insert(*segment(), episode_id=0)
        b.insert(*segment(), episode_id=1)
        assert shard.create_table(TableConfig.uniform("a", 100)) is a
        with pytest.raises(TableExistsError, match="different config"):
            shard.create_table(TableConfig.uniform("a", 200))
        with pytest.raises(TableNotFoundError, match="no table 'c'.*a, b"):
            shard.table("c")
    with Shard(tmp_path / "shard") as shard:
        assert sorted(shard.tables) == ["a", "b"]
        assert shard["a"].size == 5 and shard["b"].size == 5
        shard.drop_table("a")
        assert list(shard.tables) == ["b"]


def test_open_missing_or_damaged_directory(tmp_path):
    with pytest.raises(StorageCorruptedError, match="missing meta.json"):
        Table.open(tmp_path / "nothing")
    t = Table.create(tmp_path / "t", TableConfig.uniform("t", 100))
    t.insert(*segment(), episode_id=0)
    t.close()
    (tmp_path / "t" / "data" / "slots.bin").write_bytes(b"\0" * 10)
    with pytest.raises(StorageCorruptedError, match="slots.bin"):
        Table.open(tmp_path / "t")
    (tmp_path / "t" / "meta.json").write_text("{not json")
    with pytest.raises(StorageCorruptedError, match="unreadable"):
        Table.open(tmp_path / "t")


def test_resent_segments_are_stored_once(tmp_path):
    from millpond import Segment

    t = Table.create(tmp_path / "t", TableConfig.queue("t", 100))
    segs = [Segment(*segment(n=3, ep=e), episode_id=e, sequence=e + 1) for e in range(4)]
    gens = t.insert_many(segs[:3], writer_id="actor-0")
    assert (gens > 0).all()
    # The acknowledgement of 2 and 3 was lost: the writer re-sends them with the next one.
    again = t.insert_many(segs[1:], writer_id="actor-0")
    assert again[:2].tolist() == [0, 0] and again[2] > 0
    assert t.writer_sequence("actor-0") == 4
    # Another writer's numbers are its own.
    t.insert_many([Segment(*segment(n=3, ep=9), episode_id=9, sequence=1)], writer_id="actor-1")
    t.close()
    t = Table.open(tmp_path / "t")
    assert t.writer_sequence("actor-0") == 4
    assert t.insert_many(segs[3:], writer_id="actor-0").tolist() == [0]
    got = t.sample(15, timeout=5)
    assert sorted(got["episode_id"].unique().tolist()) == [0, 1, 2, 3, 9]
    assert len(got) == 15
    with pytest.raises(InvalidDataError, match="increasing"):
        t.insert_many([segs[1], segs[0]], writer_id="actor-2")
    t.close()


def test_full_queue_delivers_what_it_holds_instead_of_deadlocking(tmp_path):
    # 64 slots hold two segments of 30 steps (62 slots): fewer steps than a batch of 64.
    t = Table.create(tmp_path / "t", TableConfig.queue("t", 64))
    t.insert(*segment(n=30, ep=0), episode_id=0)
    t.insert(*segment(n=30, ep=1), episode_id=1)
    with pytest.raises(RateLimiterTimeoutError, match="queue is full"):
        t.insert(*segment(n=30, ep=2), episode_id=2, timeout=0.05)
    with pytest.raises(RateLimiterTimeoutError):
        t.sample(64, timeout=0.05)  # no writer is waiting: wait for a full batch
    writer = threading.Thread(
        target=lambda: t.insert(*segment(n=30, ep=2), episode_id=2, timeout=10)
    )
    writer.start()
    first = t.sample(64, timeout=10)  # the writer waits on the full queue: deliver what is there
    assert first["episode_id"].tolist() == [0] * 30 + [1] * 30
    writer.join(10)
    assert not writer.is_alive()
    assert t.sample(30, timeout=1)["episode_id"].unique().tolist() == [2]
    t.close()


def test_requeued_queue_batch_is_delivered_again_first(tmp_path):
    t = Table.create(tmp_path / "t", TableConfig.queue("t", 100))
    for ep in range(3):
        t.insert(*segment(n=5, ep=ep), episode_id=ep)
    taken = t.sample(10)
    assert taken["episode_id"].unique().tolist() == [0, 1]
    assert t.give_back(taken) == 10
    again = t.sample(15)
    assert again["episode_id"].tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert torch.equal(again[:10]["observation"], taken["observation"])
    assert t.info()["samples"] == 15
    t.close()
