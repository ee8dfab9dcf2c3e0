"""``StepCounter``'s ``"step_count"`` in ``millpond.torchrl``'s buffers: stored as each step's
index in its episode and sampled (and dumped) back bit for bit against a local TorchRL buffer
fed the same collector data, from a reset or from the middle of an episode; counts that are
not exact are kept as they are, or refused by a table that rebuilds them."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.envs import GymEnv, StepCounter, TransformedEnv

from millpond import InvalidDataError, TableConfig
from millpond.service.export import export_ted, spooled_table
from millpond.torchrl import ReplayBuffer
from tests.test_torchrl_buffer import LANES, TIME, address, check_rows, local_rows
from tests.test_torchrl_one_hot import batches, fill, spec_of

__all__ = ["address"]  # the module's shard, shared with the buffer tests

MARKER = ("step_count-from-step-int64-1",)


def check_dump(rb, path, reference):
    """``rb.dumps(path)`` holds every stored row as TorchRL's buffer holds it."""
    rb.dumps(path)
    dumped = TensorDict.load_memmap(path)
    assert MARKER not in dumped.keys(True, True)
    assert dumped["step_count"].dtype == torch.int64 and dumped["step_count"].shape[1:] == (1,)
    trajs = (dumped["episode_id"] - rb.client.episode_base).tolist()
    for i, key in enumerate(zip(trajs, dumped["step"].tolist())):
        for leaf in ("step_count", ("next", "step_count"), "observation", "action"):
            assert torch.equal(dumped[leaf][i], reference[key][leaf]), (leaf, key)
    return dumped


def raw_export(rb, path):
    """The table's TED export as the service writes it (encoded keys as stored)."""
    with (
        rb.client.read_table(rb.table) as reader,
        spooled_table(rb.table, reader, reader.steps + reader.segments, path.parent) as t,
    ):
        return export_ted(t, path, order="episode")


def check_loaded(rb, dumped, path):
    """A table ``loads`` filled with ``dumped`` dumps it again row for row (the episode ids,
    the loader's, aside)."""
    again = TensorDict.load_memmap(rb.dumps(path) or path)
    assert len(again) == len(dumped)
    for key in dumped.keys(True, True):
        key = (key,) if isinstance(key, str) else key
        if key[0] not in ("episode_id", "collector"):
            assert torch.equal(again[key], dumped[key]), key


def test_step_count_is_rebuilt_from_the_step_bit_for_bit(address, tmp_path):
    rb = ReplayBuffer(address, TableConfig.uniform("count", capacity=2_000), batch_size=64)
    data = batches(0)
    local = fill(rb, data)
    kept = data[0].keys(True, True)  # the caller's data keeps its counts
    assert ("next", "step_count") in kept and ("collector", "step_count") not in kept
    fields = spec_of(rb)
    assert ("step_count",) not in fields and ("next", "step_count") not in fields
    assert fields[MARKER].shape == (0,)  # no bytes per step
    reference = local_rows(local)
    for _ in range(3):
        batch = rb.sample()
        assert batch["step_count"].dtype == torch.int64 and batch["step_count"].shape == (64, 1)
        assert MARKER not in batch.keys(True, True)
        check_rows(batch, rb, reference)  # step_count and ("next", "step_count") included
    dumped = check_dump(rb, tmp_path / "dump", reference)
    raw = raw_export(rb, tmp_path / "raw")  # `millpond export --format ted`: as stored
    assert MARKER in raw and "step_count" not in raw
    for path in ("dump", "raw"):
        rb.empty()
        rb.loads(tmp_path / path)
        assert MARKER in spec_of(rb)
        check_loaded(rb, dumped, tmp_path / f"again-{path}")
    rb.close()


def test_a_buffer_started_mid_episode_keeps_torchrls_counts(address, tmp_path):
    """The collector runs before the buffer exists: the first extend starts at step 37 of a
    Pendulum episode (200 steps long)."""
    torch.manual_seed(4)
    env = TransformedEnv(GymEnv("Pendulum-v1"), StepCounter())
    env.set_seed(4)
    collector = Collector(env, None, frames_per_batch=37, total_frames=-1)
    data = [b.clone() for _, b in zip(range(6), collector)][1:]  # the first: before the buffer
    collector.shutdown()
    assert int(data[0]["step_count"][0]) == 37
    rb = ReplayBuffer(address, TableConfig.uniform("mid-episode", capacity=2_000), batch_size=64)
    local = fill(rb, data)
    assert MARKER in spec_of(rb)
    reference = local_rows(local)
    for _ in range(3):
        check_rows(rb.sample(), rb, reference)
    dumped = check_dump(rb, tmp_path / "dump", reference)
    assert int(dumped["step"][0]) == 37  # the episode's first stored step
    again = ReplayBuffer(address, TableConfig.uniform("mid-episode-loaded", capacity=2_000))
    again.loads(tmp_path / "dump")
    assert MARKER in spec_of(again)
    check_loaded(again, dumped, tmp_path / "again")  # its first step too: 37
    rb.close()
    again.close()


def jump(batch, by=100):
    """``batch`` with the counts of a trajectory that ends in it raised by ``by`` from its
    third row on (rising by 1 along rows, but not from the trajectory's reset); returns
    the row's lane and time."""
    traj = batch["collector", "traj_ids"]
    done = batch["next", "done"].reshape(LANES, TIME)
    for lane in range(LANES):
        for t in range(2, TIME):
            rest = traj[lane] == traj[lane, t]
            ends = torch.nonzero(rest & done[lane]).reshape(-1)
            if traj[lane, t - 2] == traj[lane, t] and len(ends):
                rows = slice(t, int(ends[0]) + 1)
                for leaf in ("step_count", ("next", "step_count")):
                    batch[leaf][lane, rows] += by
                return lane, t
    raise AssertionError("no trajectory of 3 steps ends in the batch")


@pytest.mark.parametrize("edit", ["next-not-plus-one", "jump"])
def test_counts_not_exact_at_the_first_insert_are_stored_as_they_are(address, edit):
    data = batches(5)
    original = [b["step_count"].clone() for b in data]
    if edit == "jump":  # +1 along rows of each lane, but a jump inside a trajectory
        jump(data[0])
    else:
        data[0]["next", "step_count"][2, 3] += 5
    rb = ReplayBuffer(address, TableConfig.uniform(f"count-as-is-{edit}", capacity=2_000))
    local = fill(rb, data)
    fields = spec_of(rb)
    assert ("step_count",) in fields and MARKER not in fields
    # The table counts steps from each trajectory's reset: key the rows by the true counts.
    rows = local[:]
    truth = torch.cat([c.reshape(-1) for c in original]).tolist()
    reference = {
        (t, s): rows[i]
        for i, (t, s) in enumerate(zip(rows["collector", "traj_ids"].tolist(), truth))
    }
    for _ in range(3):
        check_rows(rb.sample(64), rb, reference)  # the edited counts came back as they were
    rb.close()


def test_a_table_that_rebuilds_counts_refuses_counts_not_exact(address):
    rb = ReplayBuffer(address, TableConfig.uniform("count-refuses", capacity=2_000))
    first, second, third = batches(6)
    rb.extend(first)
    jumped = second.clone()
    lane, t = jump(jumped)
    with pytest.raises(InvalidDataError, match=rf"'step_count'.*row {t} of lane {lane} is 1\d\d,"):
        rb.extend(jumped)
    second["next", "step_count"][2, 3] += 5
    with pytest.raises(InvalidDataError, match=r"'step_count'.*row 43 \(flattened\)"):
        rb.extend(second)
    with pytest.raises(InvalidDataError, match=r"'step_count'.*no 'step_count'"):
        rb.extend(third.exclude("step_count", ("next", "step_count")))
    assert len(rb) == first.numel()  # nothing of the refused batches was stored
    rb.extend(third)  # the trajectories' steps go on (the refusals changed nothing)
    with pytest.raises(InvalidDataError, match="rebuilds; rename it"):
        rb.extend(third.set("step_count-from-step-int64-1", torch.zeros(LANES, TIME)))
    rb.close()
