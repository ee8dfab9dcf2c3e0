"""Frame-stacked observations over the wire: real servers, real ALE frames, bit for bit.

A table declares ``observation`` frame-stacked (``uint8[4, 84, 84]`` from Pong through
``AtariPreprocessing`` and ``FrameStackObservation``, 40-step episodes so that starts and
truncations come often). Writers send frames, shards store one per slot, and what the
client samples equals the raw env loop's own stacks (:func:`millpond.testing.rollout`),
``("next", obs)``, episode starts and truncations included.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ale_py", reason="needs the atari extra: pip install 'millpond[atari]'")
pytest.importorskip("cv2", reason="AtariPreprocessing needs opencv (the atari extra)")

from millpond import ReplayClient, TableConfig
from millpond.actors.envs import WrapperSpec, make_env
from millpond.errors import InvalidDataError
from millpond.segmenting import from_ted
from millpond.ted import TRAJ_ID_LIMIT
from millpond.testing import rollout

K = 4
SHAPE = (K, 84, 84)
STEPS = 120


@pytest.fixture(scope="module")
def ted():
    env = make_env(
        "ALE/Pong-v5",
        {"frameskip": 1, "max_episode_steps": 160},
        [
            WrapperSpec("gymnasium.wrappers:AtariPreprocessing", {"frame_skip": 4}),
            WrapperSpec("gymnasium.wrappers:FrameStackObservation", {"stack_size": K}),
        ],
    )
    try:
        ted = rollout(env, STEPS, seed=11)
    finally:
        env.close()
    assert ted["next", "truncated"].sum() >= 2
    return ted


def _segments(ted, chunk: int = 16):
    segments, t, n = [], 0, ted.shape[0]
    while t < n:
        end = t
        while end + 1 < n and end + 1 - t < chunk and not bool(ted["next", "done"][end]):
            end += 1
        piece = ted[t : end + 1].exclude("collector", "step_count", ("next", "done"))
        ep, first = int(ted["collector", "traj_ids"][t]), int(ted["step_count"][t])
        segments += from_ted(piece, [end + 1 - t], [ep], [first])
        t = end + 1
    return segments


def _check(batch, ted) -> set:
    where = {
        (int(e), int(s)): i
        for i, (e, s) in enumerate(
            zip(ted["collector", "traj_ids"].tolist(), ted["step_count"].tolist())
        )
    }
    seen = set()
    for row, (e, s) in enumerate(zip(batch["episode_id"].tolist(), batch["step"].tolist())):
        i = where[(e % TRAJ_ID_LIMIT, s)]
        assert torch.equal(batch["observation"][row], ted["observation"][i]), (e, s)
        assert torch.equal(batch["next", "observation"][row], ted["next", "observation"][i])
        seen.add(i)
    return seen


def _config(name: str, **kwargs) -> TableConfig:
    return TableConfig.uniform(name, 2048, frame_stacks={"observation": K}, **kwargs)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_writers_round_trip(client, server, table_name, ted, covering_writer_ids, compression):
    client.create_table(_config(table_name, compression=compression))
    segments = _segments(ted)
    wids = covering_writer_ids(table_name, server.shards)
    for i, wid in enumerate(wids):  # each writer its own episodes' segments, in order
        mine = [s for s in segments if s.episode_id % len(wids) == i]
        if mine:
            with client.writer(table_name, wid) as writer:
                writer.write_segments(mine)
    assert client.info(table_name)["size"] == STEPS
    seen: set = set()
    for _ in range(20):
        seen |= _check(client.sample(table_name, 64), ted)
        if len(seen) == STEPS:
            break
    assert len(seen) == STEPS
    starts = [i for i in seen if int(ted["step_count"][i]) == 0]
    truncated = [i for i in seen if bool(ted["next", "truncated"][i])]
    assert starts and truncated


def test_extend_round_trip(client, table_name, ted):
    client.create_table(_config(table_name))
    for a in range(0, STEPS, 50):  # continued across calls
        client.extend(table_name, ted[a : a + 50].exclude("step_count"))
    seen: set = set()
    for _ in range(20):
        seen |= _check(client.sample(table_name, 64), ted)
        if len(seen) == STEPS:
            break
    assert len(seen) == STEPS


def test_stacks_that_do_not_overlap_are_refused(client, table_name, ted):
    client.create_table(_config(table_name))
    seg = _segments(ted)[2]
    obs = seg.steps["observation"].clone()
    obs[4, 2] = 255 - obs[4, 2]
    seg.steps["observation"] = obs
    with client.writer(table_name) as writer, pytest.raises(InvalidDataError) as info:
        writer.write_segments([seg])
    assert f"step {seg.first_step + 4} of episode {seg.episode_id}" in str(info.value)
    assert "'observation'" in str(info.value)
    assert client.info(table_name)["size"] == 0


def test_a_shard_takes_whole_stacks_from_a_writer_that_does_not_know(client, table_name, ted):
    # A writer created before the table was known sends whole stacks: the shard checks
    # and cuts them itself, and refuses stacks that do not overlap.
    client.create_table(_config(table_name))
    with client.writer(table_name) as writer:
        writer._table_config = lambda: None
        writer.write_segments(_segments(ted)[:3])
    assert client.info(table_name)["size"] == sum(s.steps.shape[0] for s in _segments(ted)[:3])
    _check(client.sample(table_name, 32), ted)


def test_a_sigkilled_shard_comes_back_with_exact_stacks(server_process, ted):
    server = server_process()
    client = ReplayClient(server.address, timeout_s=30)
    try:
        client.create_table(_config("fs"))
        with client.writer("fs") as writer:
            writer.write_segments(_segments(ted))
        server.kill()  # no checkpoint: the shard recovers from its files alone
        server.restart()
        info = client.info("fs")
        assert info["size"] == STEPS and info["dropped_segments"] == 0
        assert info["config"].frame_stacks == {("observation",): K}
        seen: set = set()
        for _ in range(20):
            seen |= _check(client.sample("fs", 64), ted)
            if len(seen) == STEPS:
                break
        assert len(seen) == STEPS
    finally:
        client.close()
