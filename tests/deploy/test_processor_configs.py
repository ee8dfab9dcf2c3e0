"""Experience processors in `millpond launch` configs (``actors.processors``).

Every YAML example of docs/collect.md's "Processors in configs" section loads, one per
ALF mode; bad entries fail at load time naming their key; and a processor given by path
reaches an env actor through the launch's ActorConfig and runs there (the actor driven
without Ray, writing into a recording writer).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tensordict import TensorDict

from millpond.actors import (
    EpisodeAnnotator,
    ExperienceProcessor,
    HindsightRelabeler,
    PassThrough,
    StepFilter,
    ends_episode,
    to_ted,
)
from millpond.actors.processor_specs import ProcessorSpec
from millpond.actors.processors import sparse_goal_reward
from millpond.actors.ray_actor import ActorConfig, EnvActor
from millpond.deploy.config_mapping import to_mapping
from millpond.deploy.launch import Launch
from millpond.deploy.launch_config import LaunchConfig, load_config
from millpond.errors import InvalidConfigError
from millpond.segments import Segment

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "collect.md"
SECTION = "## Processors in configs: the five modes"
MODES = {"per-step immediate", "whole-episode delayed", "relabel", "filter", "synced training"}
P = "millpond.actors.processors:"


def doc_examples() -> list[str]:
    text = DOC.read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, re.S)


def mode_of(block: str) -> str | None:
    match = re.match(r"# mode: (.+)\n", block)
    return match.group(1).strip() if match else None


def example(mode: str) -> str:
    (block,) = [b for b in doc_examples() if mode_of(b) == mode]
    return block


def write(tmp_path, text, name="job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_doc_shows_each_mode_once():
    modes = [mode_of(b) for b in doc_examples()]
    assert sorted(m for m in modes if m) == sorted(MODES)


@pytest.mark.parametrize("block", doc_examples(), ids=lambda b: mode_of(b) or "shape")
def test_every_doc_example_loads_and_makes_an_actor_config(tmp_path, block):
    config = load_config(write(tmp_path, block))
    specs = config.actors.processors
    assert specs and all(isinstance(s, ProcessorSpec) for s in specs)
    actor_config = ActorConfig(env=config.env.id, table="t", processors=specs)
    processors = actor_config.make_processors()
    assert processors is None or isinstance(processors, ExperienceProcessor | list)
    # What a run writes to config.yaml loads back the same.
    again = load_config(write(tmp_path, yaml.safe_dump(to_mapping(config)), "again.yaml"))
    assert again == config


def test_the_doc_examples_build_the_processors_they_describe(tmp_path):
    def built(mode):
        (spec,) = load_config(write(tmp_path, example(mode))).actors.processors
        return spec.build()

    assert type(built("per-step immediate")) is PassThrough
    assert isinstance(built("whole-episode delayed"), EpisodeAnnotator)
    relabel = built("relabel")
    assert isinstance(relabel, HindsightRelabeler) and relabel.keep_original
    assert relabel.compute_reward.func is sparse_goal_reward
    assert relabel.compute_reward.keywords == {"threshold": 0.05}
    step_filter = built("filter")
    assert isinstance(step_filter, StepFilter)
    ted = {"observation": torch.tensor([[0.5, 3.0], [0.5, 1.0]])}
    assert step_filter.keep(TensorDict(ted, batch_size=[2])).tolist() == [
        False,
        True,
    ]  # task 3 dropped
    synced = load_config(write(tmp_path, example("synced training")))
    assert synced.learner.algorithm == "dqn"
    assert synced.replay.table_config().samples_per_insert == 8.0
    assert isinstance(synced.actors.processors[0].build(), StepFilter)


def test_no_processors_by_default(tmp_path):
    config = load_config(write(tmp_path, ""))
    assert config.actors.processors == [] == LaunchConfig().actors.processors
    launch = Launch(config, run_dir=tmp_path / "run")
    launch.table = "rollouts"
    assert launch._actor_config().processors is None  # the loop's default


def test_set_overrides_processors(tmp_path):
    entry = f"[{{path: {P}StepFilter, kwargs: {{keep: {{path: {P}key_in, kwargs: {{key: action, values: [1]}}}}}}}}]"
    config = load_config(write(tmp_path, ""), [f"actors.processors={entry}"])
    assert config.actors.processors == [
        ProcessorSpec(
            P + "StepFilter",
            {"keep": {"path": P + "key_in", "kwargs": {"key": "action", "values": [1]}}},
        )
    ]
    path = write(tmp_path, example("whole-episode delayed"))
    assert load_config(path, ["actors.processors=[]"]).actors.processors == []


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{path: no_such_module:Thing}", r"actors.processors\[0\].path: processor .*cannot import"),
        (f"{{path: {P}Nope}}", r"actors.processors\[0\].path: .*has no 'Nope'"),
        ("{path: builtins:dict}", r"actors.processors\[0\].path: .*not an ExperienceProcessor"),
        (f"{{path: {P}StepFilter}}", r"actors.processors\[0\].kwargs: .*'keep'"),
        (
            f"{{path: {P}StepFilter, kwargs: {{keep: 1, extra: 2}}}}",
            r"actors.processors\[0\].kwargs: StepFilter\(keep\) has no argument 'extra'",
        ),
        (
            f"{{path: {P}EpisodeAnnotator, kwargs: {{annotate: 1, incomplete: later}}}}",
            r"actors.processors\[0\].kwargs: EpisodeAnnotator\(...\) failed",
        ),
        (
            f"{{path: {P}StepFilter, kwargs: {{keep: {{path: {P}key_in, kwargs: {{k: 1}}}}}}}}",
            r"actors.processors\[0\].kwargs.keep.kwargs: key_in\(.*\) has no argument 'k'",
        ),
        (
            f"{{path: {P}StepFilter, kwargs: {{keep: {{path: nowhere:fn}}}}}}",
            r"actors.processors\[0\].kwargs.keep.path: callable 'nowhere:fn': cannot import",
        ),
        ("{pth: x}", r"actors.processors\[0\].pth: unknown key \(known: path, kwargs\)"),
        ("{kwargs: {}}", r"actors.processors\[0\].path: missing"),
        ("{path: 3}", r"actors.processors\[0\].path: expected a string"),
        ("7", r"actors.processors\[0\]: expected a mapping"),
        (f"{{path: {P}PassThrough, kwargs: [1]}}", r"actors.processors\[0\].kwargs: expected a"),
    ],
)
def test_bad_processor_entries_name_the_key(tmp_path, entry, message):
    text = f"actors:\n  processors:\n    - path: {P}PassThrough\n    - {entry}\n"
    message = message.replace(r"\[0\]", r"\[1\]")  # the second entry is at fault
    with pytest.raises(InvalidConfigError, match=message) as info:
        load_config(write(tmp_path, text))
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidConfigError, match=message.replace(r"\[1\]", r"\[0\]")):
        load_config(write(tmp_path, ""), [f"actors.processors=[{entry}]"])


def test_a_bad_entry_stops_the_cli_before_ray_starts(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "millpond.cli",
            "launch",
            str(write(tmp_path, "")),
            "--set",
            "actors.processors=[{path: millpond.actors.processors:Nope}]",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("millpond: error: actors.processors[0].path: processor")
    )
    assert not (tmp_path / "run").exists()  # nothing started


# -- a processor given by path runs in an env actor --------------------------------------------
class RecordingWriter:
    """The part of millpond.Writer an EnvActor uses; keeps what is written."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.packed: list = []
        self.acked = self.pending = 0

    def write_segment(self, steps, tail, episode_id=None, first_step=None):
        self.segments.append(Segment(steps, tail, episode_id, first_step))

    def write_packed(self, packed) -> None:
        self.packed.append(packed)

    def flush(self, timeout_s=None) -> None:
        pass

    def close(self, timeout_s=None) -> None:
        pass


class RecordingClient:
    """The part of millpond.ReplayClient an EnvActor uses: writers, and no weights yet."""

    num_shards = 1

    def __init__(self) -> None:
        self.writers: dict[str, RecordingWriter] = {}

    def writer(self, table, *, writer_id, max_in_flight, shard, timeout_s=None):
        self.writers[writer_id] = RecordingWriter()
        return self.writers[writer_id]

    def get_weights(self, min_version=0, timeout_s=0, *, actor="", acting=True):
        return None, -1


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # EnvActor sets one thread


def launch_actor_config(tmp_path, text: str, overrides=()) -> ActorConfig:
    """The ActorConfig that `millpond launch` gives its env actors for this config text."""
    config = load_config(write(tmp_path, text), ["actors.num_envs=2", *overrides])
    launch = Launch(config, run_dir=tmp_path / "run")
    launch.table = config.replay.table_config().name
    return launch._actor_config()


def test_the_delayed_doc_example_runs_in_each_env_actor(tmp_path, restore_threads):
    config = launch_actor_config(
        tmp_path,
        example("whole-episode delayed"),
        ["actors.chunk_len=16", "env.kwargs.max_episode_steps=20"],
    )
    client = RecordingClient()
    actors = [EnvActor(i, client, config, incarnation=0) for i in range(2)]
    first, second = (a.collector.processor for a in actors)
    assert isinstance(first, EpisodeAnnotator) and first is not second  # one per actor
    actor = actors[0]
    actor.run(6)
    actor.close()
    writer = client.writers["actor-0"]
    assert writer.packed == [] and writer.segments
    episodes: dict[int, list[Segment]] = {}
    for seg in writer.segments:
        episodes.setdefault(seg.episode_id, []).append(seg)
    outcomes = set()
    for segs in episodes.values():
        assert ends_episode(segs[-1])  # only whole episodes were released
        starts = [0] + [s.first_step + s.steps.shape[0] for s in segs[:-1]]
        assert [s.first_step for s in segs] == starts  # the episode whole, in order
        success = bool(to_ted(segs[-1])["next", "truncated"][-1])
        for seg in segs:
            assert seg.steps["success"].reshape(-1).tolist() == [success] * seg.steps.shape[0]
        outcomes.add(success)
    assert outcomes == {True, False}
    assert actor.status()["steps_written"] < actor.status()["frames"]  # the rest was held


def test_a_step_filter_given_by_path_runs_in_an_env_actor(tmp_path, restore_threads):
    keep = f"{{path: {P}key_in, kwargs: {{key: action, values: [1]}}}}"
    config = launch_actor_config(
        tmp_path, "", [f"actors.processors=[{{path: {P}StepFilter, kwargs: {{keep: {keep}}}}}]"]
    )
    client = RecordingClient()
    actor = EnvActor(0, client, config, incarnation=0)
    actor.run(3)
    actor.close()
    segments = client.writers["actor-0"].segments
    actions = torch.cat([s.steps["action"].reshape(-1) for s in segments])
    assert actions.numel() and bool((actions == 1).all())
    status = actor.status()
    assert 0 < status["steps_written"] < status["frames"]


def test_an_explicit_pass_through_keeps_the_packed_path(tmp_path, restore_threads):
    config = launch_actor_config(tmp_path, example("per-step immediate"))
    assert config.chunk_len == 4 and config.processors == (ProcessorSpec(P + "PassThrough"),)
    client = RecordingClient()
    actor = EnvActor(0, client, config, incarnation=0)
    assert type(actor.collector.processor) is PassThrough
    actor.run(2)
    actor.close()
    writer = client.writers["actor-0"]
    assert len(writer.packed) == 2 and writer.segments == []
