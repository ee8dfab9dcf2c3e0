"""TED import (compact_ted via Table.extend) and export (memmap, HDF5): lossless round trips."""

import sys
from collections import defaultdict

import gymnasium
import pytest
import torch
from tensordict import TensorDict

from millpond import Table, TableConfig
from millpond.errors import InvalidDataError
from millpond.service.export import export_hdf5, export_ted, load_hdf5
from millpond.ted import FRESH_EPISODE_ID_BASE, StepCountError, compact_ted
from millpond.testing import TED_ROW_KEYS, rollout, sample_in_parts, stored_segments


# -- helpers --------------------------------------------------------------------------------
def cartpole_ted(lanes, steps, seed=0, max_episode_steps=None):
    """A [P, T] TED rollout of CartPole, with the true final observations and root flags."""
    td = torch.stack(
        [
            rollout(
                gymnasium.make("CartPole-v1", max_episode_steps=max_episode_steps),
                steps,
                seed=seed * 100 + p,
                episode_offset=p * steps,
            )
            for p in range(lanes)
        ]
    )
    for flag in ("done", "terminated", "truncated"):  # dropped on import
        td[flag] = torch.zeros(lanes, steps, 1, dtype=torch.bool)
    return td


#: The row keys but the episode-end flags, which a sampled batch sets where it stops.
UNFLAGGED_KEYS = [
    k for k in TED_ROW_KEYS if k not in (("next", "terminated"), ("next", "truncated"))
]


def row_bytes(td, keys=TED_ROW_KEYS):
    """One bytes tuple per row of a TED TensorDict (any batch shape), for bitwise comparison."""
    td = td.reshape(-1)
    cols = [td[k].reshape(td.shape[0], -1).contiguous().view(torch.uint8).numpy() for k in keys]
    return [tuple(c[i].tobytes() for c in cols) for i in range(td.shape[0])]


def rows_by_step(td, keys=TED_ROW_KEYS):
    """{(trajectory id, step within the trajectory): row bytes} for time-ordered TED data."""
    td = td if td.batch_dims == 2 else td.unsqueeze(0)
    out, counter = {}, defaultdict(int)
    for lane in td.unbind(0):
        ids = lane["collector", "traj_ids"].reshape(-1).tolist()
        for tid, row in zip(ids, row_bytes(lane, keys), strict=True):
            out[(tid, counter[tid])] = row
            counter[tid] += 1
    return out


def exported_by_step(exported, keys=TED_ROW_KEYS):
    ids, steps = exported["episode_id"].tolist(), exported["step"].tolist()
    return dict(zip(zip(ids, steps, strict=True), row_bytes(exported, keys), strict=True))


def num_segments(table):
    return len(stored_segments(table))  # checks the slot metadata of each segment too


@pytest.fixture
def make_table(tmp_path):
    tables = []

    def make(config):
        t = Table.create(tmp_path / config.name, config)
        tables.append(t)
        return t

    yield make
    for t in tables:
        t.close()


# -- import/export round trips ----------------------------------------------------------------
@pytest.mark.parametrize("max_episode_steps", [None, 16])
def test_cartpole_round_trip_is_bitwise(make_table, tmp_path, max_episode_steps):
    td = cartpole_ted(3, 50, seed=1, max_episode_steps=max_episode_steps)
    if max_episode_steps is not None:
        assert td["next", "truncated"].any()
    assert td["next", "terminated"].any()
    table = make_table(TableConfig.uniform("t", 400))
    table.extend(td)
    assert table.size == 150
    ended = int(td["next", "done"].sum())
    open_lanes = int((~td["next", "done"][:, -1]).sum())
    assert num_segments(table) == ended + open_lanes

    out = export_ted(table, tmp_path / "export")
    assert out.batch_size == (150,)
    assert sorted(row_bytes(out)) == sorted(row_bytes(td))
    assert exported_by_step(out) == rows_by_step(td)
    assert torch.equal(out["collector", "traj_ids"], out["episode_id"])
    assert not out["done"].any() and out["next", "done"].shape == (150, 1)
    assert torch.equal(out["next", "done"], out["next", "terminated"] | out["next", "truncated"])
    loaded = TensorDict.load_memmap(tmp_path / "export")
    assert sorted(row_bytes(loaded)) == sorted(row_bytes(td))


def test_without_traj_ids_gets_fresh_episode_ids(make_table, tmp_path):
    td = cartpole_ted(2, 40, seed=2).exclude("collector")
    table = make_table(TableConfig.uniform("t", 200))
    table.extend(td)
    table.extend(td[:, :10])  # nothing continues across calls without trajectory ids
    out = export_ted(table, tmp_path / "export")
    assert sorted(row_bytes(out)) == sorted(row_bytes(td) + row_bytes(td[:, :10]))
    ids = out["episode_id"]
    assert (ids >= FRESH_EPISODE_ID_BASE).all()
    done = td["next", "done"].squeeze(-1)
    # Each episode end, plus the episode each lane leaves open, in each of the two calls.
    n_episodes = int(done.sum() + (~done[:, -1]).sum() + done[:, :10].sum() + (~done[:, 9]).sum())
    assert len(set(ids.tolist())) == n_episodes
    for ep in set(ids.tolist()):
        steps = out["step"][ids == ep]
        assert steps.tolist() == list(range(len(steps)))
    assert table._extend_state == {}


def test_trajectory_continued_across_calls(make_table, tmp_path):
    td = cartpole_ted(1, 80, seed=3)[0]
    traj = td["collector", "traj_ids"]
    lengths = torch.bincount(traj)
    long_traj = int(torch.nonzero(lengths >= 8)[0])
    first = int(torch.nonzero(traj == long_traj)[0])
    split = first + int(lengths[long_traj]) // 2
    table = make_table(TableConfig.slices("s", 400, slice_len=4, seed=0))
    table.extend(td[:split])
    assert table._extend_state[long_traj][0] == split - first  # (next step, digest)
    table.extend(td[split:])
    last = int(traj[-1])
    open_now = {} if td["next", "done"][-1] else {last: int(lengths[last])}
    assert {ep: next_step for ep, (next_step, _) in table._extend_state.items()} == open_now

    out = export_ted(table, tmp_path / "export")
    assert exported_by_step(out) == rows_by_step(td)
    steps = out["step"][out["episode_id"] == long_traj]
    assert steps.tolist() == list(range(int(lengths[long_traj])))

    sample = sample_in_parts(table, 256)  # batches of at most 400 / 4 slices
    assert sample.batch_size == (256, 4)
    expected_unflagged = rows_by_step(td, UNFLAGGED_KEYS)
    flags = rows_by_step(td, [("next", "terminated"), ("next", "truncated")])
    expected_flags = {
        k: {"terminated": t != b"\x00", "truncated": u != b"\x00"} for k, (t, u) in flags.items()
    }
    crossing = 0
    for s in sample.unbind(0):
        ep = s["episode_id"]
        assert (ep == ep[0]).all()
        assert s["step"].tolist() == list(range(int(s["step"][0]), int(s["step"][0]) + 4))
        assert torch.equal(s["next", "observation"][:-1], s["observation"][1:])
        for key, row in exported_by_step(s, UNFLAGGED_KEYS).items():
            assert expected_unflagged[key] == row
        # A slice stops at its last step: there, a step that did not terminate is truncated.
        want = expected_flags[(int(ep[0]), int(s["step"][-1]))]
        assert bool(s["next", "truncated"][-1]) == (want["truncated"] or not want["terminated"])
        assert not s["next", "truncated"][:-1].any() and not s["next", "done"][:-1].any()
        boundary = split - first  # the trajectory's first step in the second call
        if int(ep[0]) == long_traj and int(s["step"][0]) < boundary <= int(s["step"][-1]):
            crossing += 1
    assert crossing > 0


def test_failed_extend_and_reopen_keep_step_counts(tmp_path):
    td = cartpole_ted(1, 60, seed=5)[0]
    traj = td["collector", "traj_ids"]
    table = Table.create(tmp_path / "t", TableConfig.uniform("t", 400))
    table.extend(td[:10])
    bad = td[10:20].clone()
    bad["action"] = bad["action"].float()
    with pytest.raises(InvalidDataError, match="'action'"):
        table.extend(bad)  # a failed extend must not advance the step counts
    table.close()
    table = Table.open(tmp_path / "t")  # nor does reopening forget them
    table.extend(td[10:])
    out = export_ted(table, tmp_path / "export")
    assert exported_by_step(out) == rows_by_step(td)
    for ep in traj.unique().tolist():
        steps = sorted(out["step"][out["episode_id"] == ep].tolist())
        assert steps == list(range(int((traj == ep).sum())))
    table.close()


def test_mismatched_next_observation_is_stored_losslessly(make_table, tmp_path):
    td = cartpole_ted(2, 30, seed=4)
    table = make_table(TableConfig.uniform("plain", 200))
    table.extend(td)
    base_segments = num_segments(table)

    tampered = td.clone()
    done = tampered["next", "done"].squeeze(-1)
    p, t = next((p, t) for p in range(2) for t in range(5, 29) if not done[p, t])
    tampered["observation"][p, t + 1] += 1.0  # ("next", obs)[t] != obs[t + 1]
    p2, t2 = next((p, t) for p in range(2) for t in range(15, 29) if not done[p, t])
    tampered["next", "observation"][p2, t2, 0] = float("nan")  # same bits at both: no cut
    tampered["observation"][p2, t2 + 1, 0] = float("nan")
    p3, t3 = next((p, t) for p in range(2) for t in range(10, 14) if not done[p, t])
    tampered["next", "observation"][p3, t3, 1] = -0.0  # 0.0 == -0.0, but not bitwise: a cut
    tampered["observation"][p3, t3 + 1, 1] = 0.0

    table2 = make_table(TableConfig.uniform("tampered", 200))
    table2.extend(tampered)
    assert num_segments(table2) == base_segments + 2
    out = export_ted(table2, tmp_path / "export")
    assert exported_by_step(out) == rows_by_step(tampered)
    steps = out["step"][out["episode_id"] == int(td["collector", "traj_ids"][p, t])]
    assert steps.tolist() == list(range(len(steps)))  # the episode keeps counting


def test_nested_observations_and_extra_keys(make_table, tmp_path):
    lanes, steps = 2, 12
    pixels = torch.randint(0, 255, (lanes, steps + 1, 3, 4, 4), dtype=torch.uint8)
    state = torch.randn(lanes, steps + 1, 2, dtype=torch.float64)
    flags = torch.zeros(lanes, steps, 1, dtype=torch.bool)
    term = flags.clone()
    term[0, 5] = True
    td = TensorDict(
        {
            "observation": {"pixels": pixels[:, :-1], "state": state[:, :-1]},
            "action": torch.randn(lanes, steps, 2),
            "sample_log_prob": torch.randn(lanes, steps),
            "next": {
                "observation": {"pixels": pixels[:, 1:], "state": state[:, 1:]},
                "reward": torch.randn(lanes, steps, 1),
                "info": {"x": torch.arange(lanes * steps).reshape(lanes, steps)},
                "done": term.clone(),
                "terminated": term,
                "truncated": flags,
            },
        },
        [lanes, steps],
    )
    table = make_table(TableConfig.uniform("t", 100))
    table.extend(td)
    spec = table.spec
    assert set(spec.observation_keys) == {("observation", "pixels"), ("observation", "state")}
    assert ("next", "info", "x") in spec.step_keys
    assert ("next", "done") not in spec.fields
    assert num_segments(table) == 3
    keys = [
        ("observation", "pixels"),
        ("observation", "state"),
        ("action",),
        ("sample_log_prob",),
        ("next", "observation", "pixels"),
        ("next", "observation", "state"),
        ("next", "reward"),
        ("next", "info", "x"),
        ("next", "terminated"),
    ]
    out = export_ted(table, tmp_path / "export")
    assert sorted(row_bytes(out, keys)) == sorted(row_bytes(td, keys))


def test_hdf5_matches_memmap_export(make_table, tmp_path):
    pytest.importorskip("h5py")
    td = cartpole_ted(2, 30, seed=5, max_episode_steps=10)
    td["extra"] = torch.randn(2, 30, 3).to(torch.bfloat16)
    table = make_table(TableConfig.prioritized("t", 200))
    table.extend(td)
    ted = export_ted(table, tmp_path / "export")
    export_hdf5(table, tmp_path / "export.h5")
    h5 = load_hdf5(tmp_path / "export.h5")
    assert h5.batch_size == ted.batch_size
    flat_ted = dict(ted.items(include_nested=True, leaves_only=True))
    flat_h5 = dict(h5.items(include_nested=True, leaves_only=True))
    assert set(flat_h5) == set(flat_ted)
    for key, value in flat_ted.items():
        assert flat_h5[key].dtype == value.dtype, key
        assert torch.equal(flat_h5[key].view(torch.uint8), value.contiguous().view(torch.uint8))


def test_hdf5_without_h5py_says_how_to_install(make_table, tmp_path, monkeypatch):
    table = make_table(TableConfig.uniform("t", 100))
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(ImportError, match=r"pip install 'millpond\[hdf5\]'"):
        export_hdf5(table, tmp_path / "x.h5")


def test_export_of_an_empty_table(make_table, tmp_path):
    table = make_table(TableConfig.uniform("t", 100))
    assert export_ted(table, tmp_path / "e0").batch_size == (0,)
    table.extend(cartpole_ted(1, 5)[0])
    table.reset()
    out = export_ted(table, tmp_path / "e1")
    assert out.batch_size == (0,) and ("next", "observation") in out.keys(True)


def test_exported_data_extends_back_unchanged(make_table, tmp_path):
    td = cartpole_ted(2, 25, seed=6, max_episode_steps=9)
    table = make_table(TableConfig.uniform("a", 200))
    table.extend(td)
    out = export_ted(table, tmp_path / "a")
    again = make_table(TableConfig.uniform("b", 200))
    again.extend(out)  # episode_id and step are regenerated, traj_ids give the episodes
    out2 = export_ted(again, tmp_path / "b")
    keys = [*TED_ROW_KEYS, ("episode_id",), ("step",)]
    assert sorted(row_bytes(out2, keys)) == sorted(row_bytes(out, keys))
    assert num_segments(again) == num_segments(table)
    sampled = table.sample(8)  # index and weight are dropped, rows cut where they do not chain
    third = make_table(TableConfig.uniform("c", 100))
    third.extend(sampled)
    out3 = export_ted(third, tmp_path / "c")
    assert sorted(row_bytes(out3)) == sorted(row_bytes(sampled))


# -- bad input --------------------------------------------------------------------------------
def test_four_batch_dims_are_rejected(make_table):
    td = cartpole_ted(2, 6).unsqueeze(0).unsqueeze(0)
    table = make_table(TableConfig.uniform("t", 100))
    with pytest.raises(InvalidDataError, match=r"\[T\], \[P, T\].*\[B, P, T\].*\[1, 1, 2, 6\]"):
        table.extend(td)
    assert table.size == 0


def test_data_without_next_observation_is_rejected(make_table):
    td = cartpole_ted(1, 6)[0]
    del td["next", "observation"]
    table = make_table(TableConfig.uniform("t", 100))
    with pytest.raises(InvalidDataError, match=r"no observation keys.*'next'"):
        table.extend(td)


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda td: td.set(("next", "done"), ~td["next", "done"]), "disagrees"),
        (lambda td: td.set(("collector", "traj_ids"), -td["collector", "traj_ids"] - 1), ">= 0"),
        (lambda td: td.set(("next", "observation"), td["next", "observation"].double()), "float64"),
        (lambda td: td.exclude(("next", "done"), ("next", "terminated")), "terminated"),
    ],
)
def test_bad_ted_leaves_the_state_untouched(tamper, message):
    td = cartpole_ted(1, 30, seed=7)[0]
    state = {}
    compact_ted(td[:10], state)
    before = dict(state)
    assert before
    bad = tamper(td[10:].clone())
    with pytest.raises(InvalidDataError, match=message):
        compact_ted(bad, state)
    assert state == before
    with pytest.raises(InvalidDataError, match="no steps"):
        compact_ted(td[:0], state)


def counted(td, start):
    """``td`` ([T], from resets) with ``("collector", "step_count")``: each row's index in its
    trajectory, the first trajectory's starting at ``start`` (a collector already running)."""
    traj = td["collector", "traj_ids"].tolist()
    counts = [start]
    for i in range(1, len(traj)):
        counts.append(counts[-1] + 1 if traj[i] == traj[i - 1] else 0)
    return td.clone().set(("collector", "step_count"), torch.tensor(counts))


def packed_steps(packed):
    """Each stored step's index in its episode, in the packed order."""
    return [f + i for f, n in zip(packed.first_steps, packed.lengths) for i in range(n)]


@pytest.mark.parametrize("with_traj_ids", [True, False])
def test_collector_step_count_gives_the_steps_indices(with_traj_ids):
    td = counted(cartpole_ted(1, 60, seed=8)[0], start=40)
    if not with_traj_ids:
        td = td.exclude(("collector", "traj_ids"))
    state = {}
    first, rest = compact_ted(td[:10], state), compact_ted(td[10:], state)
    assert packed_steps(first) + packed_steps(rest) == td["collector", "step_count"].tolist()
    assert first.first_steps[0] == 40


@pytest.mark.parametrize("at", ["inside", "continued"])
def test_collector_step_count_that_is_not_the_step_index_is_refused(at):
    td = counted(cartpole_ted(1, 60, seed=8)[0], start=40)
    traj = td["collector", "traj_ids"]
    assert int((traj == traj[0]).sum()) > 12  # the first trajectory runs past row 10
    state = {}
    compact_ted(td[:10], state)
    before = dict(state)
    bad = td[10:].clone()
    row = 2 if at == "inside" else 0
    bad["collector", "step_count"][row:] += 3
    with pytest.raises(
        StepCountError,
        match=rf"count of row {row} of lane 0 is {53 + row}, but that step is step {50 + row}",
    ):
        compact_ted(bad, state)
    assert state == before
    bad["collector", "step_count"][:] = -1
    with pytest.raises(StepCountError, match=">= 0"):
        compact_ted(bad, state)


# -- TorchRL ----------------------------------------------------------------------------------
def _collect(env, frames_per_batch, batches):
    from torchrl.collectors import Collector

    env.set_seed(0)
    torch.manual_seed(0)
    collector = Collector(
        env, policy=None, frames_per_batch=frames_per_batch, total_frames=frames_per_batch * batches
    )
    try:
        return [b.clone() for b in collector]
    finally:
        collector.shutdown()


@pytest.mark.parametrize("lanes", [1, 2])
def test_torchrl_collector_round_trip(make_table, tmp_path, lanes):
    pytest.importorskip("torchrl")
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    from torchrl.envs import GymEnv, SerialEnv

    env = GymEnv("CartPole-v1") if lanes == 1 else SerialEnv(lanes, lambda: GymEnv("CartPole-v1"))
    batches = _collect(env, 40 * lanes, 2)
    assert batches[0].batch_size == ((40,) if lanes == 1 else (lanes, 40))
    table = make_table(TableConfig.uniform("t", 400))
    for b in batches:
        table.extend(b)
    data = torch.cat(batches, dim=-1)  # trajectories continue from one batch to the next
    out = export_ted(table, tmp_path / "export")
    assert exported_by_step(out) == rows_by_step(data)
    assert sorted(row_bytes(out)) == sorted(row_bytes(data))

    loaded = TensorDict.load_memmap(tmp_path / "export")
    rb = ReplayBuffer(storage=LazyMemmapStorage(len(loaded)), batch_size=16)
    rb.extend(loaded)
    assert len(rb) == 80 * lanes
    sample = rb.sample()
    assert sample.batch_size == (16,)
    assert sample["next", "observation"].shape == (16, 4)
    assert sample["collector", "traj_ids"].shape == (16,)
