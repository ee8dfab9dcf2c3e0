"""``millpond.torchrl``'s buffers against TorchRL's own, fed the same data.

A real shard serves on loopback; a local ``TensorDictReplayBuffer(LazyTensorStorage)`` gets
the same collector batches. Every sampled row is found among the local buffer's rows by its
trajectory and step count, and must equal it bit for bit. TorchRL's prioritized sampler
needs its C++ extension, which does not load beside every torch build, so prioritized
sampling is checked against TorchRL's documented formula (``P(i) = p_i^a / sum p^a``,
``w_i = (N P(i))^-b / max w``) instead.
"""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import (
    Compose,
    GymEnv,
    RenameTransform,
    SerialEnv,
    StepCounter,
    Transform,
    TransformedEnv,
)

from millpond import InvalidConfigError, InvalidDataError, ReplayClient, TableConfig
from millpond.service.server import ServerConfig, create_server
from millpond.torchrl import PrioritizedReplayBuffer, ReplayBuffer, TorchRLUnsupportedError

warnings.filterwarnings("ignore", category=DeprecationWarning)
LANES, TIME = 3, 20
SKIP = {"index", "collector", "priority_weight"}
STOPS = {("next", "truncated"), ("next", "done")}


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    server, port = create_server(ServerConfig(dir=str(tmp_path_factory.mktemp("shard"))))
    yield f"127.0.0.1:{port}"
    server.stop(grace=0.5)


def make_env(seed=0, max_steps=15):
    env = TransformedEnv(
        SerialEnv(LANES, lambda: GymEnv("CartPole-v1", max_episode_steps=max_steps)),
        StepCounter(),
    )
    env.set_seed(seed)
    return env


def collect(buffer, seed, batches=2, **kwargs):
    """Run a collector with ``replay_buffer=buffer`` (it yields nothing then)."""
    torch.manual_seed(seed)
    collector = Collector(
        make_env(seed),
        policy=None,
        frames_per_batch=LANES * TIME,
        total_frames=LANES * TIME * batches,
        replay_buffer=buffer,
        **kwargs,
    )
    try:
        assert all(out is None for out in collector)
    finally:
        collector.shutdown()


def local_rows(local):
    """The local buffer's rows by (trajectory, step count)."""
    rows = local[:]
    traj = rows["collector", "traj_ids"].tolist()
    steps = rows["step_count"].reshape(-1).tolist()
    return {(t, s): rows[i] for i, (t, s) in enumerate(zip(traj, steps))}


def check_rows(batch, rb, reference):
    """Every sampled row equals the local buffer's row of the same step, key for key.

    Except ``("next", "truncated" | "done")``: a uniform table's transitions each stand
    alone, so each is marked as the end of its trajectory (the service's convention, for
    TorchRL's multi-step estimators); ``("next", "terminated")`` is the env's own.
    """
    keys = [k for k in reference[next(iter(reference))].keys(True, True) if _kept(k)]
    trajs = (batch["episode_id"] - rb.client.episode_base).tolist()
    for i, (t, s) in enumerate(zip(trajs, batch["step"].tolist())):
        ref = reference[(t, s)]
        for key in keys:
            assert torch.equal(batch[key][i], ref[key]), (key, t, s)
    assert batch["next", "done"].all()
    assert (batch["next", "truncated"] | batch["next", "terminated"]).all()


def _kept(key):
    key = (key,) if isinstance(key, str) else key
    return key[0] not in SKIP and key not in STOPS


def test_extend_sample_len_and_rows_match_a_local_buffer(address):
    rb = ReplayBuffer(address, TableConfig.uniform("same", capacity=2_000), batch_size=32)
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(2_000), batch_size=32)
    torch.manual_seed(0)
    collector = Collector(make_env(0), None, frames_per_batch=LANES * TIME, total_frames=240)
    for batch in collector:  # [3, 20]: extend takes it as it is; TorchRL's wants it flat
        assert rb.extend(batch) == batch.numel()
        local.extend(batch.reshape(-1))
    collector.shutdown()
    assert len(rb) == len(local) == rb.write_count == local.write_count == 240
    reference = local_rows(local)
    ours, info = rb.sample(return_info=True)
    theirs, their_info = local.sample(return_info=True)
    assert ours.batch_size == theirs.batch_size == torch.Size([32])
    assert rb.sample(7).batch_size == torch.Size([7])
    assert set(info) == set(their_info) == {"index"}
    assert torch.equal(info["index"]["slot"], ours["index", "slot"])
    for key in theirs.keys(True, True):
        if _kept(key):
            assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype
    seen = set()
    for _ in range(30):
        batch = rb.sample(64)
        check_rows(batch, rb, reference)
        seen.update(zip(batch["episode_id"].tolist(), batch["step"].tolist()))
    assert len(seen) > 200  # most of the 240 steps were drawn, each one exact
    rb.close()


def test_a_collector_fills_it_through_replay_buffer_extend_and_add(address):
    for name, kwargs in (("by-extend", {}), ("by-add", {"extend_buffer": False})):
        rb = ReplayBuffer(address, TableConfig.uniform(name, capacity=2_000), batch_size=16)
        local = TensorDictReplayBuffer(storage=LazyTensorStorage(2_000), batch_size=16)
        collect(rb, seed=3, **kwargs)
        collect(local, seed=3, **kwargs)
        # TorchRL's 1-D storage keeps a collector's [P, T] batch as P items of [T] (add: [P]
        # steps as items of [P]); a table keeps steps, and counts them.
        assert len(rb) == rb.write_count == local[:].numel() == 2 * LANES * TIME
        reference = _flat_rows(local)
        for _ in range(10):
            check_rows(rb.sample(64), rb, reference)
        rb.close()


def _flat_rows(local):
    """The local buffer's items flattened to steps, by (trajectory, step count)."""
    rows = local[:].reshape(-1)
    traj = rows["collector", "traj_ids"].tolist()
    steps = rows["step_count"].reshape(-1).tolist()
    return {(t, s): rows[i] for i, (t, s) in enumerate(zip(traj, steps))}


def test_a_multi_process_collector_writes_from_each_worker(address):
    rb = ReplayBuffer(address, TableConfig.uniform("multi", capacity=2_000), batch_size=16)
    collector = MultiSyncCollector(
        [lambda: GymEnv("CartPole-v1")] * 2,
        None,
        frames_per_batch=40,
        total_frames=160,
        replay_buffer=rb,
    )
    try:
        assert all(out is None for out in collector)
    finally:
        collector.shutdown()
    assert len(rb) == rb.write_count == 160
    # Each worker got a copy of the buffer, with a client of its own: a source each.
    sources = {int(e) >> 32 for _ in range(10) for e in rb.sample(64)["episode_id"]}
    assert len(sources) == 2 and rb.client.episode_base >> 32 not in sources
    rb.close()


def test_add_one_step_continues_its_episode(address):
    rb = ReplayBuffer(address, TableConfig.uniform("add", capacity=1_000), batch_size=8)
    torch.manual_seed(1)
    collector = Collector(make_env(1), None, frames_per_batch=LANES * TIME, total_frames=60)
    batch = next(iter(collector)).clone()
    collector.shutdown()
    for t in range(TIME):  # [P] steps, as a collector with extend_buffer=False adds them
        assert rb.add(batch[:, t]) == LANES
    single = TransformedEnv(GymEnv("CartPole-v1"), StepCounter()).rollout(1)[0]  # a [] step
    assert rb.add(single) == 1
    assert len(rb) == LANES * TIME + 1
    with pytest.raises(InvalidDataError, match="one step"):
        rb.add(batch)
    flat = batch.reshape(-1)
    reference = {
        (t, s): flat[i]
        for i, (t, s) in enumerate(
            zip(flat["collector", "traj_ids"].tolist(), flat["step_count"].reshape(-1).tolist())
        )
    }
    sample = rb.sample(64)
    ours = sample["episode_id"] >> 32 == rb.client.episode_base >> 32  # not the single step
    check_rows(sample[ours], rb, reference)
    rb.close()


def filled_pair(address, name, seed, transform):
    """A millpond buffer and TorchRL's, each with ``transform()``, fed one collector batch."""
    rb = ReplayBuffer(
        address, TableConfig.uniform(name, capacity=1_000), batch_size=16, transform=transform()
    )
    local = TensorDictReplayBuffer(
        storage=LazyTensorStorage(1_000), batch_size=16, transform=transform()
    )
    collect(rb, seed=seed, batches=1)
    collect(local, seed=seed, batches=1)
    return rb, local


def test_transform_applies_at_sample_time_as_torchrl(address):
    def transform():
        return Compose(RenameTransform(["observation"], ["obs"], create_copy=True))

    rb, local = filled_pair(address, "tf", 4, transform)
    ours, theirs = rb.sample(), local.sample()
    assert "obs" in ours and "obs" in theirs
    assert torch.equal(ours["obs"], ours["observation"])
    assert "index" in ours  # set after the transform, as TorchRL does
    scaled = ReplayBuffer(
        address, "tf", batch_size=4, transform=lambda td: td.set("double", 2 * td["observation"])
    )
    batch = scaled.sample()
    assert torch.equal(batch["double"], 2 * batch["observation"])
    rb.close()
    scaled.close()


class ScaleReward(Transform):
    """A write-time transform: its ``inv`` (what extend runs) doubles the reward."""

    def _inv_call(self, td):
        return td.set(("next", "reward"), 2 * td["next", "reward"])


def test_a_transforms_inverse_applies_at_extend_as_torchrl(address):
    rb, local = filled_pair(address, "inv", 7, ScaleReward)
    reference = _flat_rows(local)
    assert all(float(row["next", "reward"]) == 2.0 for row in reference.values())
    for _ in range(5):
        check_rows(rb.sample(32), rb, reference)  # doubled rewards, the rest as collected
    rb.close()


def test_iteration_and_prefetch(address):
    rb = ReplayBuffer(address, TableConfig.uniform("it", capacity=1_000), batch_size=8)
    collect(rb, seed=5, batches=1)
    shapes = [b.batch_size for b in itertools.islice(rb, 3)]
    assert shapes == [torch.Size([8])] * 3
    assert rb.next().batch_size == torch.Size([8])
    fetched = ReplayBuffer(address, "it", batch_size=8, prefetch=3)
    assert [b.batch_size for b in itertools.islice(fetched, 5)] == [torch.Size([8])] * 5
    assert fetched.sample(5).batch_size == torch.Size([5])  # another size: asked at once
    fetched.close()
    unsized = ReplayBuffer(address, "it")
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(RuntimeError, match="atch_size"):
        next(iter(local))
    with pytest.raises(InvalidConfigError, match="batch_size"):
        next(iter(unsized))
    with pytest.raises(InvalidConfigError, match="batch_size"):
        unsized.sample()
    rb.close()
    unsized.close()


def _rollout_buffer(address, name, capacity, alpha, beta, steps=40):
    rb = PrioritizedReplayBuffer(
        address, TableConfig.prioritized(name, capacity, alpha=alpha, beta=beta), batch_size=64
    )
    env = GymEnv("Pendulum-v1")  # one episode: no step ends it before 200
    env.set_seed(0)
    torch.manual_seed(0)
    data = env.rollout(steps)
    data["collector", "traj_ids"] = torch.zeros(len(data), dtype=torch.int64)
    return rb, data


def test_priorities_draw_higher_priorities_more_often(address):
    alpha, beta = 0.8, 0.6
    rb, data = _rollout_buffer(address, "prio", 1_000, alpha, beta)
    rb.extend(data)
    n = len(rb)
    high, low = 4.0, 1.0
    updated = set()
    for _ in range(100):  # every step gets its priority: 4 on even steps, 1 on odd
        if len(updated) == n:
            break
        batch = rb.sample()
        batch["td_error"] = torch.where(batch["step"] % 2 == 0, high, low)
        assert rb.update_tensordict_priority(batch) == 64
        updated.update(batch["step"].tolist())
    assert len(updated) == n == 40
    draws = torch.cat([rb.sample()["step"] for _ in range(150)])
    n_even = (n + 1) // 2
    mass_even = n_even * high**alpha
    expected = mass_even / (mass_even + (n - n_even) * low**alpha)
    assert abs(float((draws % 2 == 0).double().mean()) - expected) < 0.03
    batch, info = rb.sample(return_info=True)
    assert set(info) == {"index", "priority_weight"}
    assert torch.equal(batch["priority_weight"], info["priority_weight"])
    even = batch["step"] % 2 == 0
    w = batch["priority_weight"]
    # TorchRL's weights: (N P(i))^-beta over the largest; the low-priority steps weigh 1.
    assert torch.allclose(w[~even], torch.ones_like(w[~even]))
    assert torch.allclose(w[even], torch.full_like(w[even], (high / low) ** (-alpha * beta)))
    rb.close()


def test_a_priority_for_an_overwritten_slot_is_dropped(address):
    rb, data = _rollout_buffer(address, "overwrite", 60, alpha=1.0, beta=1.0)
    rb.extend(data)  # 40 steps, 41 slots of 60
    stale = rb.sample(16)
    fresh = data.clone()
    fresh["collector", "traj_ids"] += 1
    rb.extend(fresh)  # overwrites the first episode's slots
    stale["td_error"] = torch.full((16,), 100.0)
    assert rb.update_tensordict_priority(stale) == 0
    weights = rb.sample(32)["priority_weight"]
    assert torch.allclose(weights, torch.ones_like(weights))  # all still the same priority
    current = rb.sample(16)
    current["td_error"] = torch.full((16,), 100.0)
    assert rb.update_tensordict_priority(current) == 16
    rb.close()


def test_state_dict_and_dumps_loads_round_trip(address, tmp_path):
    transform = Compose(RenameTransform(["observation"], ["obs"], create_copy=True))
    rb = ReplayBuffer(
        address, TableConfig.uniform("state", capacity=1_000), batch_size=16, transform=transform
    )
    collect(rb, seed=6)
    state = rb.state_dict()
    other = ReplayBuffer(address, "state", transform=Compose(RenameTransform(["a"], ["b"])))
    other.load_state_dict(state)
    assert other.batch_size == 16 and len(other) == len(rb)
    with pytest.raises(InvalidConfigError, match="table"):
        ReplayBuffer(address, TableConfig.uniform("state2", capacity=10)).load_state_dict(state)

    rb.dumps(tmp_path / "dump")
    exported = TensorDict.load_memmap(tmp_path / "dump")
    assert len(exported) == len(rb)
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(1_000))
    local.extend(exported)  # TorchRL takes the dump as it is
    assert len(local) == len(rb)
    restored = ReplayBuffer(address, TableConfig.uniform("restored", capacity=1_000))
    restored.loads(tmp_path / "dump")
    assert len(restored) == len(rb)
    restored.dumps(tmp_path / "again")
    again = TensorDict.load_memmap(tmp_path / "again")
    assert _row_set(again) == _row_set(exported)  # the same steps, episode ids aside
    with pytest.raises(InvalidDataError, match="empty"):
        restored.loads(tmp_path / "dump")
    restored.empty()
    assert len(restored) == 0
    for buffer in (rb, other, restored):
        buffer.close()


def _row_set(td):
    keys = ["observation", ("next", "observation"), "action", ("next", "reward")]
    return sorted(
        tuple(torch.cat([td[k][i].reshape(-1).double() for k in keys]).tolist())
        for i in range(len(td))
    )


def test_what_it_cannot_honour_is_refused_with_what_to_use(address):
    rb = ReplayBuffer(address, TableConfig.uniform("refuse", capacity=100))
    with pytest.raises(TorchRLUnsupportedError, match="storage=.*TableConfig"):
        ReplayBuffer(address, "refuse", storage=LazyTensorStorage(10))
    with pytest.raises(InvalidConfigError, match="no argument 'colour'"):
        ReplayBuffer(address, "refuse", colour=1)
    with pytest.raises(TorchRLUnsupportedError, match="read_table"):
        rb.storage  # noqa: B018
    storage = rb._storage  # what TorchRL's collectors probe: initialised, on no device
    assert storage.initialized and storage.device is None
    assert getattr(storage, "_storage", None) is None
    with pytest.raises(TorchRLUnsupportedError, match="read_table"):
        storage.get(0)
    with pytest.raises(TorchRLUnsupportedError, match="sampling"):
        rb[0]
    with pytest.raises(TorchRLUnsupportedError, match="write_count"):
        rb.empty(empty_write_count=False)
    with pytest.raises(InvalidConfigError, match="PrioritizedReplayBuffer: prioritized"):
        PrioritizedReplayBuffer(address, "refuse")
    prio, data = _rollout_buffer(address, "refuse-p", 100, 0.6, 0.4)
    data["td_error"] = torch.ones(len(data))
    with pytest.raises(TorchRLUnsupportedError, match="initial priorities"):
        prio.extend(data)
    prio.extend(data.exclude("td_error"))
    with pytest.raises(InvalidDataError, match="storage positions"):
        prio.update_priority(torch.arange(4), torch.ones(4))
    with pytest.raises(InvalidDataError, match="td_error"):
        prio.update_tensordict_priority(prio.sample(4))
    with pytest.raises(TorchRLUnsupportedError, match="checkpoint"):
        prio.dumps("anywhere")
    rb.close()
    prio.close()


def test_two_processes_write_and_sample_one_table(address, tmp_path):
    rb = ReplayBuffer(address, TableConfig.uniform("shared", capacity=5_000), batch_size=32)
    script = textwrap.dedent(
        f"""
        import warnings, torch
        warnings.filterwarnings("ignore")
        from torchrl.envs import GymEnv
        from millpond.torchrl import ReplayBuffer
        rb = ReplayBuffer({address!r}, "shared", batch_size=32)
        env = GymEnv("Pendulum-v1")  # episodes of 200 steps, none ends early
        env.set_seed(1)
        data = env.rollout(200)
        data["collector", "traj_ids"] = torch.zeros(200, dtype=torch.int64)
        rb.extend(data)
        print(rb.client.episode_base, rb.sample()["observation"].shape[0], flush=True)
        rb.close()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    from torchrl.envs import GymEnv

    env = GymEnv("Pendulum-v1")
    env.set_seed(2)
    data = env.rollout(200)
    data["collector", "traj_ids"] = torch.zeros(200, dtype=torch.int64)
    rb.extend(data)
    out, err = child.communicate(timeout=240)
    assert child.returncode == 0, err
    their_base, drawn = map(int, out.split())
    assert drawn == 32 and their_base != rb.client.episode_base
    assert len(rb) == rb.write_count == 400
    sources = set()
    for _ in range(10):
        sources.update((rb.sample()["episode_id"]).tolist())
    assert sources == {their_base, rb.client.episode_base}  # each process's steps, apart
    rb.close()


def test_import_millpond_does_not_import_torchrl():
    code = "import sys, millpond; millpond.ReplayClient; assert 'torchrl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    root = Path(__file__).resolve().parents[1]
    importers = [
        str(path.relative_to(root))
        for folder in ("millpond", "service", "learner", "actors", "protos", "deploy")
        for path in (root / folder).rglob("*.py")
        if any(
            line.lstrip().startswith(("import torchrl", "from torchrl"))
            for line in path.read_text().splitlines()
        )
    ]
    assert importers == ["millpond/torchrl.py"]


def test_a_given_client_is_kept_open_and_a_copy_is_a_source_of_its_own(address):
    client = ReplayClient(address, timeout_s=20)
    rb = ReplayBuffer(client, TableConfig.uniform("owned", capacity=100), batch_size=4)
    twin = pickle.loads(pickle.dumps(rb))  # what a collector's worker process would get
    assert twin.table == rb.table and twin.batch_size == 4
    assert twin.client is not client and twin.client.timeout_s == 20
    assert twin.client.episode_base != client.episode_base
    twin.close()
    rb.close()
    assert client.info("owned")["size"] == 0  # the caller's client still works
    client.close()
