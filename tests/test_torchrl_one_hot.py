"""One-hot actions in ``millpond.torchrl``'s buffers: stored as their index, sampled back bit
for bit against a local TorchRL buffer fed the same collector batches; actions that are not
exactly one-hot are kept as they are, or refused by a table that stores the index."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from millpond import InvalidDataError, TableConfig
from millpond.torchrl import ReplayBuffer
from tests.test_torchrl_buffer import LANES, TIME, address, check_rows, local_rows, make_env

__all__ = ["address"]  # the module's shard, shared with the buffer tests


def batches(seed, n=3):
    """``n`` CartPole collector batches ``[3, 20]`` (random policy: one-hot int64[2] actions)."""
    torch.manual_seed(seed)
    collector = Collector(make_env(seed), None, frames_per_batch=LANES * TIME, total_frames=-1)
    out = [b.clone() for _, b in zip(range(n), collector)]
    collector.shutdown()
    return out


def fill(rb, data):
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(2_000), batch_size=64)
    for batch in data:
        rb.extend(batch)
        local.extend(batch.reshape(-1))
    return local


def spec_of(rb):
    return rb.client.info(rb.table)["config"].spec.fields


def test_one_hot_action_is_stored_as_its_index_and_sampled_back_bit_for_bit(address, tmp_path):
    rb = ReplayBuffer(address, TableConfig.uniform("one-hot", capacity=2_000), batch_size=64)
    data = batches(0)
    local = fill(rb, data)
    fields = spec_of(rb)
    assert ("action",) not in fields
    assert fields[("action-one-hot-int64-2",)].dtype == torch.uint8
    assert fields[("action-one-hot-int64-2",)].shape == ()
    reference = local_rows(local)
    for _ in range(3):
        batch = rb.sample()
        assert batch["action"].dtype == torch.int64 and batch["action"].shape == (64, 2)
        assert ("action-one-hot-int64-2",) not in batch.keys(True, True)
        check_rows(batch, rb, reference)
    assert data[0]["action"].shape == (LANES, TIME, 2)  # the caller's data keeps its action

    rb.dumps(tmp_path / "dump")  # the export holds the action as the collector wrote it
    dumped = TensorDict.load_memmap(tmp_path / "dump")
    trajs = (dumped["episode_id"] - rb.client.episode_base).tolist()
    for i, key in enumerate(zip(trajs, dumped["step"].tolist())):
        assert torch.equal(dumped["action"][i], reference[key]["action"])
    rb.empty()
    rb.loads(tmp_path / "dump")
    assert len(rb) == len(dumped) and ("action-one-hot-int64-2",) in spec_of(rb)
    rb.close()


@pytest.mark.parametrize("form", ["two-hot", "negative-zero"])
def test_an_action_not_exactly_one_hot_is_stored_as_it_is(address, form, tmp_path):
    data = batches(1)
    for batch in data:
        if form == "two-hot":  # int64[2] but not one-hot in one row: no row is converted
            batch["action"][1, 5] = torch.tensor([1, 1])
        else:  # float one-hot whose zeros are -0.0 in one row: equal, but not the same bits
            batch["action"] = batch["action"].float()
            row = batch["action"][0, 3]
            batch["action"][0, 3] = torch.where(row == 0, torch.tensor(-0.0), row)
    rb = ReplayBuffer(address, TableConfig.uniform(f"as-is-{form}", capacity=2_000), batch_size=64)
    local = fill(rb, data)
    assert ("action",) in spec_of(rb)
    reference = local_rows(local)
    for _ in range(3):
        check_rows(rb.sample(), rb, reference)
    rb.dumps(tmp_path / "dump")
    rows = TensorDict.load_memmap(tmp_path / "dump")  # every stored row
    assert len(rows) == 3 * LANES * TIME
    bits = rows["action"].view(torch.int32) if form == "negative-zero" else rows["action"]
    assert (bits.sum(-1) != bits.max(-1).values).any()  # the odd row came back as it was
    rb.close()


def test_a_table_that_stores_the_index_refuses_an_action_not_one_hot(address):
    rb = ReplayBuffer(address, TableConfig.uniform("one-hot-refuses", capacity=2_000))
    first, second = batches(2, n=2)
    rb.extend(first)
    second["action"][2, 7] = torch.tensor([0, 0])
    with pytest.raises(InvalidDataError, match=r"'action'.*row 47 is not exactly one-hot"):
        rb.extend(second)
    assert len(rb) == first.numel()  # nothing of the refused batch was stored
    with pytest.raises(InvalidDataError, match="one-hot actions; rename it"):
        rb.extend(first.set("action-one-hot-int64-2", torch.zeros(LANES, TIME)))
    rb.close()


@pytest.mark.parametrize("padding", ["same", "constant"])
@pytest.mark.parametrize(
    ("per_batch", "batches", "capacity", "frames_a_step"),
    # 4-step batches: each continues the last on its tail slot and stores no older frames
    # of its own (a prefix per chain): under 2 frames a step with the slots and prefix rows
    # reserved ahead of use, where 4-step segments on their own take 8.
    [(40, 3, 400, 1.5), (4, 30, 4096, 2.0)],
)
def test_catframes_stacks_are_stored_as_frames_and_sampled_back_bit_for_bit(
    address, padding, per_batch, batches, capacity, frames_a_step
):
    """TorchRL's own Atari form (gray frames, ``CatFrames(N=4)`` in the env, episodes of 50
    steps): each frame is stored once, and every sampled stack, the padded ones at episode
    starts too, equals the collector's."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    torch.manual_seed(0)
    env = pong(padding)
    collector = Collector(env, None, frames_per_batch=per_batch, total_frames=-1)
    data = [b.clone() for _, b in zip(range(batches), collector)]
    collector.shutdown()
    config = TableConfig.uniform(
        f"pong-{padding}-{per_batch}", capacity=capacity, seed=0, frame_stacks={"pixels": 4}
    )
    rb = ReplayBuffer(address, config, batch_size=64)
    local = fill(rb, data)
    fields = spec_of(rb)
    assert fields[("pixels",)].shape == (4, 84, 84)  # a stack per step, stored as frames
    frame = 84 * 84 * 4  # float32; TorchRL's TED row holds 8 of them (obs and next obs)
    assert rb.client.info(rb.table)["bytes_on_disk"] < frames_a_step * frame * len(rb)
    reference = local_rows(local)
    firsts = 0
    for _ in range(4):
        batch = rb.sample()
        check_rows(batch, rb, reference)
        firsts += int((batch["step"] == 0).sum())
    assert firsts >= 2  # stacks that CatFrames padded came back as it padded them
    rb.close()


def pong(padding):
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import ResizeObservation
    from torchrl import envs

    gym.register_envs(ale_py)
    game = gym.make("ALE/Pong-v5", max_episode_steps=50)
    base = envs.GymWrapper(ResizeObservation(game, (84, 84)))
    stack = envs.CatFrames(N=4, dim=-3, in_keys=["pixels"], padding=padding)
    pre = envs.Compose(envs.ToTensorImage(), envs.GrayScale(), stack, envs.StepCounter())
    env = envs.TransformedEnv(base, pre)
    env.set_seed(0)
    return env


def test_split_trajs_padding_and_nested_actions_are_stored_as_their_index(address):
    """``split_trajs`` pads with zeros (not one-hot, never stored); a nested ``"action"``
    (``("agents", "action")``) is an action too."""
    torch.manual_seed(3)
    collector = Collector(
        make_env(3), None, frames_per_batch=LANES * TIME, total_frames=-1, split_trajs=True
    )
    data = [b.clone() for _, b in zip(range(2), collector)]
    collector.shutdown()
    mask = data[0]["collector", "mask"]
    assert not mask.all() and (data[0]["action"][~mask] == 0).all()  # the padding: zeros
    for batch in data:
        batch["agents", "action"] = batch["action"].flip(-1)
    rb = ReplayBuffer(address, TableConfig.uniform("one-hot-split", capacity=2_000), batch_size=64)
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(2_000), batch_size=64)
    for batch in data:
        rb.extend(batch)
        local.extend(batch[batch["collector", "mask"]])
    fields = spec_of(rb)
    assert ("action-one-hot-int64-2",) in fields
    assert ("agents", "action-one-hot-int64-2") in fields and ("agents", "action") not in fields
    reference = local_rows(local)
    for _ in range(3):
        check_rows(rb.sample(), rb, reference)
    rb.close()
