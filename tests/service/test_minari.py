"""``millpond export --format minari`` / ``millpond import --format minari`` checked with
Minari's own API: tables of real gymnasium episodes written as Minari datasets, every
episode compared exactly with the rollout that made it, imported back and exported again
unchanged; the episode rules (joined segments, open episodes, evicted beginnings); and
refusals in one line."""

import gc
import re
import shlex
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

from millpond import Shard, TableConfig
from millpond.cli import main
from millpond.service.export import export_ted
from millpond.testing import CountingDictEnv, rollout

minari = pytest.importorskip("minari")

DOC = Path(__file__).resolve().parents[2] / "docs" / "datasets.md"


# -- the independent record -------------------------------------------------------------------
def recorded_episodes(*lanes):
    """{trajectory id: Minari-shaped episode} from rollouts, as the export rules say: N + 1
    observations, flat rewards, an unfinished episode truncated at its last step."""
    rows = defaultdict(list)
    for lane in lanes:
        for i, tid in enumerate(lane["collector", "traj_ids"].tolist()):
            rows[tid].append(lane[i])
    out = {}
    for tid, steps in rows.items():
        td = torch.stack(steps)
        term = td["next", "terminated"].reshape(-1).numpy()
        trunc = td["next", "truncated"].reshape(-1).numpy().copy()
        if not (term[-1] or trunc[-1]):
            trunc[-1] = True
        obs = td["observation"]
        nxt = td["next", "observation"]
        out[tid] = {
            "observations": _obs(torch.cat([obs, nxt[-1:]])),
            "actions": td["action"].numpy(),
            "rewards": td["next", "reward"].reshape(-1).numpy(),
            "terminations": term,
            "truncations": trunc,
        }
    return out


def _obs(t):
    if isinstance(t, torch.Tensor):
        return t.numpy()
    return {k: _obs(v) for k, v in t.items()}


def minari_episode(ep):
    return {
        "observations": ep.observations,
        "actions": ep.actions,
        "rewards": ep.rewards,
        "terminations": ep.terminations,
        "truncations": ep.truncations,
    }


def assert_same(a, b, where=""):
    """Same structure, dtypes, shapes and values (bitwise)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), where
    assert a.tobytes() == b.tobytes(), where


def episodes_of(dataset_id, root, monkeypatch):
    """Every episode of the dataset as ``minari.load_dataset`` gives it."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    dataset = minari.load_dataset(dataset_id)
    episodes = [minari_episode(ep) for ep in dataset.iterate_episodes()]
    for ep in dataset.iterate_episodes():
        assert ep.infos == {}
    assert dataset.total_episodes == len(episodes)
    assert dataset.total_steps == sum(len(e["rewards"]) for e in episodes)
    return dataset, episodes


def run(*args):
    return main([str(a) for a in args])


CARTPOLE = rollout(gymnasium.make("CartPole-v1"), 150, seed=3)
LANES = [
    rollout(gymnasium.make("CartPole-v1"), 70, seed=10 + p, episode_offset=100 * p) for p in (0, 1)
]


@pytest.fixture
def shard(tmp_path):
    """Table ``cart``: one lane extended in three calls (episodes span segments, the last
    is unfinished); table ``lanes``: two lanes interleaved, each ending unfinished."""
    path = tmp_path / "shard"
    with Shard(path) as s:
        cart = s.create_table(TableConfig.uniform("cart", 400))
        for a, b in ((0, 40), (40, 41), (41, 150)):
            cart.extend(CARTPOLE[a:b])
        s.create_table(TableConfig.uniform("lanes", 400)).extend(torch.stack(LANES))
    return path


# -- round trips ------------------------------------------------------------------------------
def test_cartpole_table_to_minari_and_back_exactly(shard, tmp_path, monkeypatch, capsys):
    root = tmp_path / "datasets"
    assert run("export", shard, "--table", "cart", "--format", "minari", "--minari-root", root,
               "millpond/cartpole-v0") == 0  # fmt: skip
    out, err = capsys.readouterr()
    record = recorded_episodes(CARTPOLE)
    assert out.strip() == (
        f"millpond: exported {len(record)} episodes (150 steps) of table 'cart' to Minari "
        f"dataset 'millpond/cartpole-v0' at {root / 'millpond/cartpole-v0'}"
    )
    assert "1 open episode(s) written as truncated at their last step" in err
    assert "step keys with no place in a Minari episode: 'step_count'" in err
    assert not (Path.home() / ".minari" / "datasets" / "millpond" / "cartpole-v0").exists()

    dataset, episodes = episodes_of("millpond/cartpole-v0", root, monkeypatch)
    assert len(episodes) == len(record) >= 5
    for got, want in zip(episodes, record.values(), strict=True):  # first-stored order
        assert_same(got, want)
    assert sum(int(e["truncations"][-1]) for e in episodes) >= 1
    assert isinstance(dataset.observation_space, gymnasium.spaces.Box)
    assert dataset.observation_space.shape == (4,)

    # import into a new table, export again: the same episodes
    assert run("import", "millpond/cartpole-v0", "--format", "minari", "--minari-root", root,
               tmp_path / "new", "--table", "offline") == 0  # fmt: skip
    assert capsys.readouterr().out.startswith(
        f"millpond: imported 150 rows into table 'offline' of {tmp_path / 'new'} ("
    )
    assert run("export", tmp_path / "new", "--table", "offline", "--format", "minari",
               "--minari-root", root, "millpond/cartpole-v1") == 0  # fmt: skip
    assert "note" not in capsys.readouterr().err  # nothing open, nothing left out now
    _, again = episodes_of("millpond/cartpole-v1", root, monkeypatch)
    assert len(again) == len(episodes)
    for a, b in zip(again, episodes, strict=True):
        assert_same(a, b)


def test_interleaved_lanes_are_joined_per_episode_never_stitched(shard, tmp_path, monkeypatch):
    root = tmp_path / "datasets"
    assert run("export", shard, "--table", "lanes", "--format", "minari", "--minari-root", root,
               "lanes-v0") == 0  # fmt: skip
    _, episodes = episodes_of("lanes-v0", root, monkeypatch)
    record = recorded_episodes(*LANES)
    assert len(episodes) == len(record)
    # episodes in the order their first segment was stored: lane 0's, then lane 1's, ...
    by_content = {e["observations"].tobytes(): e for e in episodes}
    for tid, want in record.items():
        assert_same(by_content[want["observations"].tobytes()], want, str(tid))
    assert sum(int(e["truncations"][-1]) and not e["terminations"][-1] for e in episodes) >= 2


def test_episodes_whose_beginning_was_evicted_are_left_out(tmp_path, monkeypatch, capsys):
    with Shard(tmp_path / "ring") as s:
        table = s.create_table(TableConfig.uniform("ring", 70))
        for a in range(0, 150, 10):  # the ring keeps about the newest 60 steps
            table.extend(CARTPOLE[a : a + 10])
        stored = set(zip(*_stored(table), strict=True))
    del s, table
    gc.collect()  # the closed table's memory maps: the CLI refuses a table mapped writable
    record = recorded_episodes(CARTPOLE)
    tids = CARTPOLE["collector", "traj_ids"].tolist()
    # which stored episodes still hold their step 0
    firsts = {e for e, st in stored if st == 0}
    partial = {e for e, _ in stored} - firsts
    assert len(partial) == 1, "the ring must have evicted its oldest episode's beginning"
    root = tmp_path / "datasets"
    assert run("export", tmp_path / "ring", "--table", "ring", "--format", "minari",
               "--minari-root", root, "ring-v0") == 0  # fmt: skip
    err = capsys.readouterr().err
    dropped = sum(1 for e, _ in stored if e in partial)
    note = f"1 episode(s) ({dropped} steps) left out: not stored whole from step 0"
    assert f"{note} (beginning evicted)" in err
    _, episodes = episodes_of("ring-v0", root, monkeypatch)
    complete = [t for t in dict.fromkeys(tids) if t in firsts]
    assert len(episodes) == len(complete)
    for got, tid in zip(episodes, complete, strict=True):
        assert_same(got, record[tid], str(tid))


def _stored(table):
    with tempfile.TemporaryDirectory() as d:
        td = export_ted(table, Path(d) / "x")
        return td["episode_id"].tolist(), td["step"].tolist()


@pytest.mark.filterwarnings("ignore::UserWarning")  # Minari asks for an author, a code link...
def test_dict_observations_images_and_float64_rewards_round_trip(tmp_path, monkeypatch):
    """A dataset Minari writes itself (dict observations with 32x32 RGB images, float64
    rewards) comes back from a table unchanged: no JPEG, no dtype change."""
    rng = np.random.default_rng(0)

    def episode(i, n, end):
        return minari.data_collector.EpisodeBuffer(
            id=i,
            observations={
                "pixels": rng.integers(0, 256, (n + 1, 32, 32, 3), dtype=np.uint8),
                "state": rng.standard_normal((n + 1, 5)).astype(np.float32),
            },
            actions=rng.uniform(-1, 1, (n, 2)).astype(np.float32),
            rewards=rng.standard_normal(n),
            terminations=np.r_[np.zeros(n - 1, bool), end == "term"],
            truncations=np.r_[np.zeros(n - 1, bool), end == "trunc"],
            infos={},
        )

    env = CountingDictEnv(pixel_shape=(32, 32, 3), state_dim=5)
    root = tmp_path / "datasets"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    buffers = [
        episode(i, n, e) for i, (n, e) in enumerate([(7, "term"), (1, "trunc"), (12, "term")])
    ]
    minari.create_dataset_from_buffers(
        "made/by-minari-v0",
        buffers,
        observation_space=env.observation_space,
        action_space=env.action_space,
        jpeg_encoding=False,
    )
    _, source = episodes_of("made/by-minari-v0", root, monkeypatch)
    assert run("import", "made/by-minari-v0", "--format", "minari", tmp_path / "s",
               "--table", "t") == 0  # fmt: skip
    assert run("export", tmp_path / "s", "--table", "t", "--format", "minari",
               "back-v0") == 0  # fmt: skip
    _, back = episodes_of("back-v0", root, monkeypatch)
    assert len(back) == 3
    for a, b in zip(back, source, strict=True):
        assert_same(a, b)
    assert back[1]["truncations"].tolist() == [True]


def test_env_gives_the_spaces_and_recovers_the_environment(shard, tmp_path, monkeypatch):
    root = tmp_path / "datasets"
    assert run("export", shard, "--table", "cart", "--format", "minari", "--minari-root", root,
               "--env", "CartPole-v1", "cart-v0") == 0  # fmt: skip
    dataset, _ = episodes_of("cart-v0", root, monkeypatch)
    assert dataset.action_space == gymnasium.spaces.Discrete(2)
    env = dataset.recover_environment()
    assert env.spec.id == "CartPole-v1"


# -- refusals ---------------------------------------------------------------------------------
def test_refusals_are_one_line(shard, tmp_path, monkeypatch, capsys):
    root = tmp_path / "datasets"

    def error(*args):
        assert run(*args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("millpond: error: "), lines
        return lines[0].removeprefix("millpond: error: ")

    export = ["export", shard, "--format", "minari", "--minari-root", root]
    assert error(*export, "--table", "nope", "x-v0") == (
        f"no table 'nope' in {shard} (tables: cart, lanes)"
    )
    assert "bad Minari dataset id 'no version'" in error(*export, "--table", "cart", "no version")
    assert "--order is for ted and hdf5" in error(*export, "--table", "cart", "--order",
                                                  "episode", "x-v0")  # fmt: skip
    assert run(*export, "--table", "cart", "x-v0") == 0
    capsys.readouterr()
    assert error(*export, "--table", "cart", "x-v0").startswith("Minari dataset 'x-v0' exists at ")
    assert error(*export, "--table", "cart", "--env", "MountainCar-v0", "m-v0").startswith(
        "--env MountainCar-v0: its observation space Box("
    )
    assert error(*export, "--table", "cart", "--env", "NoSuchEnv-v9", "m-v0").startswith(
        "cannot make gymnasium env 'NoSuchEnv-v9': "
    )
    assert not (root / "m-v0").exists()
    assert error("export", shard, "--table", "cart", "--format", "ted", "--minari-root", root,
                 tmp_path / "o") == "--minari-root is for --format minari"  # fmt: skip
    assert error("import", "absent-v0", "--format", "minari", "--minari-root", root,
                 tmp_path / "d", "--table", "t") == f"no Minari dataset 'absent-v0' in {root}"  # fmt: skip
    assert not (tmp_path / "d").exists()
    assert "more than table 'small' holds (capacity 20): pass --capacity" in error(
        "import", "x-v0", "--format", "minari", "--minari-root", root, tmp_path / "d",
        "--table", "small", "--capacity", "20",
    )  # fmt: skip
    # without minari installed (simulated: the import fails), the extra to install is named
    monkeypatch.setitem(sys.modules, "minari", None)
    assert error(*export, "--table", "cart", "y-v0") == (
        "Minari datasets need minari (with h5py): pip install 'millpond[datasets]'"
    )
    assert not (root / "y-v0").exists()


# -- docs/datasets.md, as written --------------------------------------------------------------
def test_the_datasets_doc_runs_as_written(tmp_path, monkeypatch, capsys):
    """Every ``millpond`` command of docs/datasets.md's sh blocks, in order, then its Python
    blocks, in a directory holding the shard the doc starts from."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    with Shard(tmp_path / "shard") as s:
        s.create_table(TableConfig.uniform("replay", 400)).extend(CARTPOLE)
    del s
    gc.collect()  # the closed table's memory maps: the CLI refuses a table mapped writable
    text = DOC.read_text()
    commands = []  # (command, the output lines the doc shows under it)
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("millpond "):
                commands.append((line, []))
            elif line.startswith("#   millpond: ") and commands:
                commands[-1][1].append(line.removeprefix("#   "))
    assert len(commands) >= 6
    for line, shown in commands:
        assert main(shlex.split(line)[1:]) == 0, (line, capsys.readouterr().err)
        out = capsys.readouterr()
        printed = (out.out + out.err).splitlines()
        for want in shown:  # "..." stands for a machine-dependent path
            pattern = ".*".join(map(re.escape, want.split("...")))
            assert any(re.fullmatch(pattern, p) for p in printed), (want, printed)
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        exec(compile(block, str(DOC), "exec"), {})
