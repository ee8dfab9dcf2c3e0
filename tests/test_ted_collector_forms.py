"""Every TorchRL collector output form ends exact in a table, or refused with its name.

The reference is each collector batch itself: its real rows (the ones its mask marks, for
``split_trajs``), compared bit for bit with what the table exports. Trajectory ids belong to
their source: two sources that number their trajectories alike are never joined, and two
producers sharing one source are refused rather than stitched.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDictBase

from millpond import Table, TableConfig
from millpond.errors import InvalidDataError
from millpond.service.export import export_ted
from millpond.testing import TED_ROW_KEYS, sample_in_parts

pytest.importorskip("torchrl")
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv


def lanes_env(lanes: int = 2, max_steps: int = 15) -> TransformedEnv:
    make = functools.partial(GymEnv, "CartPole-v1", max_episode_steps=max_steps)
    return TransformedEnv(SerialEnv(lanes, make), StepCounter())


def batches(seed: int, frames: int, n: int, **kwargs) -> list[TensorDictBase]:
    env = lanes_env()
    env.set_seed(seed)
    collector = Collector(
        env, policy=None, frames_per_batch=frames, total_frames=frames * n, **kwargs
    )
    try:
        return [td.clone() for td in collector]
    finally:
        collector.shutdown()


def row_bytes(td: TensorDictBase) -> list[bytes]:
    flat = td.reshape(-1)
    cols = [flat[k].reshape(len(flat), -1).contiguous().view(torch.uint8) for k in TED_ROW_KEYS]
    return [b"".join(c[i].numpy().tobytes() for c in cols) for i in range(len(flat))]


def stored_rows(table: Table, path) -> list[bytes]:
    return sorted(row_bytes(export_ted(table, path)))


def test_split_trajs_padding_is_never_stored(make_table, tmp_path) -> None:
    data = batches(seed=1, frames=40, n=3, split_trajs=True)
    mask = torch.cat([td["collector", "mask"].reshape(-1) for td in data])
    assert not mask.all(), "the batches hold no padding to test with"
    table = make_table(TableConfig.slices("t", 1_000, slice_len=3, seed=0))
    for td in data:
        table.extend(td)
    real = sorted(b for td in data for b in row_bytes(td[td["collector", "mask"]]))
    assert table.size == int(mask.sum()) == len(real)
    assert stored_rows(table, tmp_path / "export") == real
    # Trajectories continue from one batch into the next: slices cross there, one episode.
    sample = table.sample(256)
    assert torch.equal(sample["next", "observation"][:, :-1], sample["observation"][:, 1:])


def test_padding_before_a_real_step_is_refused(make_table) -> None:
    td = batches(seed=1, frames=40, n=1, split_trajs=True)[0]
    bad = td.clone()
    bad["collector", "mask"][0, 0] = False
    table = make_table(TableConfig.uniform("t", 1_000))
    with pytest.raises(InvalidDataError, match="real step after padding"):
        table.extend(bad)
    assert table.size == 0


def _stacked_env() -> TransformedEnv:
    return lanes_env()


def test_a_stacking_multi_collector_batch_is_stored_exactly(make_table, tmp_path) -> None:
    collector = MultiSyncCollector(
        [_stacked_env, _stacked_env],
        policy=None,
        frames_per_batch=80,
        total_frames=160,
        cat_results="stack",
    )
    try:
        data = [td.clone() for td in collector]
    finally:
        collector.shutdown()
    assert data[0].batch_size == (2, 2, 20)
    table = make_table(TableConfig.slices("t", 1_000, slice_len=4, seed=0))
    for td in data:
        table.extend(td)
    assert stored_rows(table, tmp_path / "export") == sorted(
        b for td in data for b in row_bytes(td)
    )
    sample = sample_in_parts(table, 256)  # batches of at most 1,000 / 4 slices
    assert torch.equal(sample["next", "observation"][:, :-1], sample["observation"][:, 1:])


def test_compact_obs_output_is_refused_by_name(make_table) -> None:
    td = batches(seed=2, frames=40, n=1, compact_obs=True)[0]
    assert ("next", "observation") not in td.keys(include_nested=True)
    table = make_table(TableConfig.uniform("t", 1_000))
    with pytest.raises(InvalidDataError, match="compact_obs=True"):
        table.extend(td)
    assert table.size == 0


def test_sources_with_the_same_trajectory_ids_are_never_joined(make_table) -> None:
    a, b = batches(seed=3, frames=40, n=3), batches(seed=4, frames=40, n=3)
    assert set(a[0]["collector", "traj_ids"].unique().tolist()) & set(
        b[0]["collector", "traj_ids"].unique().tolist()
    )
    table = make_table(TableConfig.slices("t", 2_000, slice_len=4, seed=0))
    for x, y in zip(a, b):  # interleaved, as two collectors would write
        table.extend(x, source="collector-a")
        table.extend(y, source="collector-b")
    assert table.size == 2 * 3 * 40
    for _ in range(8):
        sample = sample_in_parts(table, 512)  # batches of at most 2,000 / 4 slices
        # Within a slice, every next observation is the following step's observation:
        # a slice that ran from one source's trajectory into the other's would break it.
        assert torch.equal(sample["next", "observation"][:, :-1], sample["observation"][:, 1:])


def test_two_producers_sharing_one_source_are_refused_not_stitched(make_table) -> None:
    a, b = batches(seed=3, frames=40, n=2), batches(seed=4, frames=40, n=2)
    open_ids = set(a[0]["collector", "traj_ids"][:, -1].tolist())
    assert open_ids & set(b[0]["collector", "traj_ids"].reshape(-1).tolist())
    table = make_table(TableConfig.slices("t", 2_000, slice_len=4, seed=0))
    table.extend(a[0])
    size = table.size
    # b numbers its trajectories as a does: its trajectory that a left open does not start
    # where a's stopped, so the default source refuses it instead of joining the two.
    with pytest.raises(InvalidDataError, match="two producers share trajectory ids"):
        table.extend(b[0])
    assert table.size == size
    table.extend(a[1])  # a's own continuation is still taken (the refusal changed nothing)
    table.extend(b[0], source="b")  # and b is welcome under a source of its own
    assert table.size == size + 80


@pytest.mark.filterwarnings("ignore:.*already returned terminated = True")
@pytest.mark.parametrize("replace", [True, False], ids=["next-obs-filled", "next-obs-is-reset"])
def test_auto_resetting_env_batches_are_stored_exactly(make_table, tmp_path, replace) -> None:
    """TorchRL's second autoreset mode: the env resets itself (``auto_reset=True``), and at a
    done step ``("next", obs)`` is a fill value (NaN) or, unreplaced, the next episode's
    first observation. Either way the record is stored as the collector wrote it, and no
    slice runs across the reset."""
    make = functools.partial(
        GymEnv, "CartPole-v1", max_episode_steps=15, auto_reset=True, auto_reset_replace=replace
    )
    env = TransformedEnv(SerialEnv(2, make), StepCounter())
    env.set_seed(5)
    collector = Collector(env, policy=None, frames_per_batch=40, total_frames=120)
    try:
        data = [td.clone() for td in collector]
    finally:
        collector.shutdown()
    done = torch.cat([td["next", "done"].reshape(-1) for td in data])
    assert done.sum() >= 4, "the batches hold too few episode ends to test with"
    table = make_table(TableConfig.slices("t", 1_000, slice_len=3, seed=0))
    for td in data:
        table.extend(td)
    assert table.size == 120
    assert stored_rows(table, tmp_path / "export") == sorted(
        b for td in data for b in row_bytes(td)
    )
    for _ in range(4):
        sample = table.sample(256)
        inner = ~sample["next", "done"][:, :-1].squeeze(-1)
        # Within a slice, the next observation of every step but an episode's last is the
        # following step's observation: a slice across a reset would break it.
        assert torch.equal(
            sample["next", "observation"][:, :-1][inner], sample["observation"][:, 1:][inner]
        )
        assert not sample["next", "done"][:, :-1].any()
