"""Experience processors: pass-through, per-episode annotation, hindsight, filters, chains.

Each test runs the real loop on a real env and checks what reached the sink against the
batches the loop collected (whose exactness ``test_collector`` establishes): the right
steps, cut into segments whose tails are the true next observations.
"""

from __future__ import annotations

import functools
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict, TensorDictBase

from millpond.actors import (
    HINDSIGHT_EPISODE_OFFSET,
    Collector,
    EpisodeAnnotator,
    EpisodeFilter,
    HindsightRelabeler,
    PassThrough,
    ProcessorChain,
    StepFilter,
    cut_batch,
    to_ted,
)
from millpond.actors.processor_specs import ProcessorSpec, build_processors, check_processors
from millpond.actors.processors import key_in, sparse_goal_reward
from millpond.config import TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError, RateLimiterTimeoutError
from millpond.segments import Segment
from millpond.service import TableSink
from millpond.testing import CountingDictEnv


class RecordingSink:
    """Keeps every segment written, in order."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.flushes = 0

    def write_segment(self, steps, tail, episode_id=None, first_step=None):
        self.segments.append(Segment(steps, tail, episode_id, first_step))

    def flush(self) -> None:
        self.flushes += 1

    def rows(self) -> dict[tuple[int, int], TensorDictBase]:
        """``{(episode, step): TED row}`` of everything written (next obs rebuilt)."""
        out = {}
        for seg in self.segments:
            ted = to_ted(seg)
            for i in range(ted.shape[0]):
                key = (seg.episode_id, seg.first_step + i)
                assert key not in out, f"step {key} written twice"
                out[key] = ted[i]
        return out


def batch_rows(batches) -> dict[tuple[int, int], TensorDictBase]:
    """``{(episode, step): TED row}`` of collected batches."""
    out = {}
    for batch in batches:
        flat = batch.reshape(-1)
        ids = flat["collector", "traj_ids"].tolist()
        steps = flat["collector", "step_count"].tolist()
        for i, key in enumerate(zip(ids, steps)):
            out[key] = flat[i]
    return out


def same_row(stored: TensorDictBase, collected: TensorDictBase, keys) -> bool:
    return all(torch.equal(stored[k], collected[k]) for k in keys)


def segment_shapes(segments) -> list[tuple[int, int, int]]:
    return [(s.episode_id, s.first_step, s.steps.shape[0]) for s in segments]


def cartpole(processors, sink, **kwargs) -> Collector:
    args = {
        "num_envs": 2,
        "chunk_len": 16,
        "env_kwargs": {"max_episode_steps": 20},
        "processors": processors,
        "seed": 3,
        **kwargs,
    }
    return Collector("CartPole-v1", sink, **args)


CARTPOLE_KEYS = ["observation", ("next", "observation"), "action", ("next", "reward")]


def test_pass_through_stores_every_segment_as_cut():
    sink = RecordingSink()
    with cartpole(PassThrough(), sink) as c:
        batches = [c.run_chunk() for _ in range(3)]
    cut = [s for b in batches for s in cut_batch(b)]
    assert segment_shapes(sink.segments) == segment_shapes(cut)
    assert sink.flushes == 1
    collected = batch_rows(batches)
    stored = sink.rows()
    assert stored.keys() == collected.keys()
    assert all(same_row(stored[k], collected[k], CARTPOLE_KEYS) for k in stored)


def test_episode_annotator_holds_episodes_until_they_end_and_recuts_them():
    def mark_success(ted):  # success: the pole stayed up until the time limit
        ted["success"] = ted["next", "truncated"][-1].expand(ted.shape[0]).clone()
        return ted

    sink = RecordingSink()
    annotator = EpisodeAnnotator(mark_success)
    c = cartpole(annotator, sink)
    batches = []
    for _ in range(4):
        batches.append(c.run_chunk())
        # Nothing of an unfinished episode is written.
        assert all(
            any(to_ted(s)["next", "done"][-1] for s in sink.segments if s.episode_id == ep)
            for ep in {s.episode_id for s in sink.segments}
        )
    held = annotator.held_steps
    c.close()  # incomplete episodes are dropped
    cut = [s for b in batches for s in cut_batch(b)]
    ended = {s.episode_id for s in cut if to_ted(s)["next", "done"][-1]}
    expected = [s for s in cut if s.episode_id in ended]
    # Stored in the segments they were cut into (episode by episode, as they ended).
    assert sorted(segment_shapes(sink.segments)) == sorted(segment_shapes(expected))
    assert sum(s.steps.shape[0] for s in cut) - held == sum(s.steps.shape[0] for s in sink.segments)
    assert held > 0
    collected, stored = batch_rows(batches), sink.rows()
    outcomes = {True: 0, False: 0}
    for (ep, step), row in stored.items():
        assert same_row(row, collected[ep, step], CARTPOLE_KEYS)
        last = max(s for (e, s) in collected if e == ep)
        success = bool(collected[ep, last]["next", "truncated"])
        assert bool(row["success"]) == success
        outcomes[success] += 1
    assert outcomes[True] and outcomes[False]


def test_an_annotation_may_drop_an_episode_or_must_keep_observations_consistent():
    sink = RecordingSink()
    with cartpole(EpisodeAnnotator(lambda ted: None), sink) as c:
        c.run(2)
    assert sink.segments == []

    def corrupt(ted):
        ted["observation"] = ted["observation"] + 1  # but not ("next", "observation")
        return ted

    with (
        cartpole(EpisodeAnnotator(corrupt), RecordingSink()) as c,
        pytest.raises(InvalidDataError, match="relabel an observation and its copy"),
    ):
        c.run(3)


def test_incomplete_episodes_can_be_processed_on_flush():
    sink = RecordingSink()
    with cartpole(
        EpisodeAnnotator(lambda ted: ted, incomplete="process"), sink, env_kwargs={}
    ) as c:
        batch = c.run_chunk()
    assert segment_shapes(sink.segments) == segment_shapes(cut_batch(batch))


# -- hindsight ------------------------------------------------------------------------------
GOAL_TOL = 0.05


def goal_reward(achieved, desired):
    return -(torch.as_tensor(abs(achieved - desired)).sum(-1) > GOAL_TOL).to(torch.float32)


class PointGoalEnv(gym.Env):
    """A 1-D point that must reach a goal: dict observations with achieved/desired goals."""

    def __init__(self, horizon: int = 9) -> None:
        box = functools.partial(gym.spaces.Box, -2.0, 2.0, dtype=np.float32)
        self.observation_space = gym.spaces.Dict(
            {"observation": box((2,)), "achieved_goal": box((1,)), "desired_goal": box((1,))}
        )
        self.action_space = gym.spaces.Discrete(3)  # left, stay, right
        self.horizon = horizon

    def _obs(self):
        return {
            "observation": np.array([self.pos, self.t / self.horizon], dtype=np.float32),
            "achieved_goal": np.array([self.pos], dtype=np.float32),
            "desired_goal": np.array([self.goal], dtype=np.float32),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = np.float32(self.np_random.uniform(-1, 1))
        self.goal = np.float32(self.np_random.uniform(-1, 1))
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.pos = np.float32(np.clip(self.pos + 0.1 * (int(action) - 1), -2, 2))
        self.t += 1
        reward = float(goal_reward(np.float32([self.pos]), np.float32([self.goal])))
        return self._obs(), reward, False, self.t >= self.horizon, {}


def test_hindsight_relabels_goals_rewards_and_tails():
    sink = RecordingSink()
    env = gym.vector.SyncVectorEnv([PointGoalEnv] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    with Collector(env, sink, chunk_len=7, processors=HindsightRelabeler(goal_reward), seed=1) as c:
        batches = [c.run_chunk() for _ in range(4)]
    env.close()
    cut = [s for b in batches for s in cut_batch(b)]
    complete = {s.episode_id for s in cut if to_ted(s)["next", "done"][-1]}
    originals = [s for s in sink.segments if s.episode_id < HINDSIGHT_EPISODE_OFFSET]
    relabelled = [s for s in sink.segments if s.episode_id >= HINDSIGHT_EPISODE_OFFSET]
    expected = [s for s in cut if s.episode_id in complete]
    assert len(complete) >= 4
    assert sorted(segment_shapes(originals)) == sorted(segment_shapes(expected))
    assert sorted(segment_shapes(relabelled)) == sorted(
        (e + HINDSIGHT_EPISODE_OFFSET, f, n) for e, f, n in segment_shapes(expected)
    )
    collected, stored = batch_rows(batches), sink.rows()
    obs_keys = ["observation", "achieved_goal", "desired_goal"]
    all_keys = [*obs_keys, *[("next", k) for k in obs_keys], "action", ("next", "reward")]
    original_rewards = []
    for ep in complete:
        steps = sorted(s for (e, s) in collected if e == ep)
        final = collected[ep, steps[-1]]["next", "achieved_goal"]
        for step in steps:
            row, new = collected[ep, step], stored[ep + HINDSIGHT_EPISODE_OFFSET, step]
            assert same_row(stored[ep, step], row, all_keys)  # the original, untouched
            # Desired goal (root, and next: tails included) is the finally achieved goal.
            assert torch.equal(new["desired_goal"], final)
            assert torch.equal(new["next", "desired_goal"], final)
            for key in ["observation", "achieved_goal", "action", ("next", "achieved_goal")]:
                assert torch.equal(new[key], row[key])
            reward = goal_reward(row["next", "achieved_goal"], final).reshape(1)
            assert torch.equal(new["next", "reward"], reward)
            original_rewards.append(float(row["next", "reward"]))
        # The relabelled episode succeeds at its end.
        assert float(stored[ep + HINDSIGHT_EPISODE_OFFSET, steps[-1]]["next", "reward"]) == 0.0
    assert min(original_rewards) == -1.0  # the originals mostly failed
    # Tails: the tail of each relabelled segment carries the relabelled desired goal.
    for seg in relabelled:
        final = stored[seg.episode_id, seg.first_step]["desired_goal"]
        assert torch.equal(seg.tail["desired_goal"], final)


def test_hindsight_can_replace_the_original():
    sink = RecordingSink()
    env = gym.vector.SyncVectorEnv([PointGoalEnv], autoreset_mode=AutoresetMode.SAME_STEP)
    relabel = HindsightRelabeler(goal_reward, keep_original=False)
    with Collector(env, sink, chunk_len=9, processors=relabel, seed=0) as c:
        c.run(2)
    env.close()
    assert len(sink.segments) == 2
    assert all(s.episode_id >= HINDSIGHT_EPISODE_OFFSET for s in sink.segments)


# -- filters --------------------------------------------------------------------------------
def test_step_filter_cuts_segments_and_keeps_true_next_observations():
    def keep(ted):
        return ted["action"] == 1

    sink = RecordingSink()
    with cartpole(StepFilter(keep), sink) as c:
        batches = [c.run_chunk() for _ in range(3)]
    collected, stored = batch_rows(batches), sink.rows()
    kept = {k for k, row in collected.items() if int(row["action"]) == 1}
    assert stored.keys() == kept
    assert 0 < len(kept) < len(collected)
    for key, row in stored.items():  # ("next", obs) is the true next observation
        assert same_row(row, collected[key], CARTPOLE_KEYS)
        assert torch.equal(row["next", "terminated"], collected[key]["next", "terminated"])
    # Segments are the maximal runs of kept steps within the original segments.
    expected = []
    for seg in (s for b in batches for s in cut_batch(b)):
        mask = [*(seg.steps["action"] == 1).tolist(), False]
        start = None
        for i, k in enumerate(mask):
            if k and start is None:
                start = i
            elif not k and start is not None:
                expected.append((seg.episode_id, seg.first_step + start, i - start))
                start = None
    assert segment_shapes(sink.segments) == expected
    assert any(n > 1 for _, _, n in expected)
    # A run that stops before a dropped step gets that step's observation as its tail.
    inner = [
        s for s in sink.segments if (s.episode_id, s.first_step + s.steps.shape[0]) in collected
    ]
    assert inner
    for s in inner:
        nxt = collected[s.episode_id, s.first_step + s.steps.shape[0]]
        assert torch.equal(s.tail["observation"], nxt["observation"])


def test_step_filter_checks_the_mask():
    with (
        cartpole(StepFilter(lambda ted: torch.ones(3)), RecordingSink()) as c,
        pytest.raises(InvalidDataError, match="bool tensor"),
    ):
        c.run_chunk()


def counting_env(num_envs: int = 2):
    return gym.vector.SyncVectorEnv(
        [
            functools.partial(CountingDictEnv, pixel_shape=(1, 2, 2), episode_offset=p * 1000)
            for p in range(num_envs)
        ],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )


def task_of(ted) -> int:
    """The 'task' of a CountingDictEnv episode: the parity of its episode number."""
    return int(ted["state"][0, 0]) % 2


def test_episode_filter_drops_whole_episodes_by_task():
    sink = RecordingSink()
    env = counting_env()
    with Collector(
        env, sink, chunk_len=15, processors=EpisodeFilter(lambda t: task_of(t) == 0), seed=2
    ) as c:
        batches = [c.run_chunk() for _ in range(4)]
    env.close()
    collected, stored = batch_rows(batches), sink.rows()
    kept = {k for k, row in collected.items() if int(row["state"][0]) % 2 == 0}
    assert stored.keys() == kept and 0 < len(kept) < len(collected)
    for key, row in stored.items():
        assert same_row(
            row, collected[key], ["state", ("next", "state"), "pixels", ("next", "pixels")]
        )


def test_a_chain_filters_then_relabels_and_flushes_in_order():
    sink = RecordingSink()
    env = gym.vector.SyncVectorEnv([PointGoalEnv] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    chain = ProcessorChain(
        EpisodeFilter(lambda ted: bool(ted["desired_goal"][0, 0] > 0)),  # the "task"
        HindsightRelabeler(goal_reward, incomplete="process"),
        StepFilter(lambda ted: ted["action"] != 1),  # drop the "stay" steps
    )
    with Collector(env, sink, chunk_len=6, processors=chain, seed=4) as c:
        batches = [c.run_chunk() for _ in range(3)]
    env.close()
    collected = batch_rows(batches)
    kept = {
        k for k, row in collected.items() if row["desired_goal"][0] > 0 and int(row["action"]) != 1
    }
    stored = sink.rows()
    originals = {k for k in stored if k[0] < HINDSIGHT_EPISODE_OFFSET}
    relabelled = {
        (e - HINDSIGHT_EPISODE_OFFSET, s) for e, s in stored if e >= HINDSIGHT_EPISODE_OFFSET
    }
    # Flushing processed the incomplete episodes too (and passed them on through the step
    # filter), so every kept step is there twice.
    assert originals == relabelled == kept
    assert len(kept) > 5
    for key in originals:
        assert same_row(stored[key], collected[key], ["observation", ("next", "observation")])


# -- the rate limiter counts what was stored --------------------------------------------------
def every_kth_step(k: int, state: dict):
    """A filter keeping one collected step in ``k`` (or none while ``state['off']``)."""

    def keep(ted):
        n = ted.shape[0]
        idx = torch.arange(state["seen"], state["seen"] + n)
        state["seen"] += n
        return (idx % k == 0) & (not state["off"])

    return keep


def drain(table) -> int:
    """How many single-step samples the rate limiter allows now."""
    n = 0
    while True:
        try:
            table.sample(1, timeout=0)
        except RateLimiterTimeoutError:
            return n
        n += 1


def test_filtered_steps_do_not_unblock_a_rate_limited_learner(make_table):
    # samples_per_insert 1, min_size 10, error buffer 10: a learner may sample while
    # inserts * 1 - samples >= min_diff = 10 - 10 = 0.
    config = TableConfig.uniform(
        "spi", capacity=1000, min_size=10, samples_per_insert=1.0, error_buffer=10
    )
    table = make_table(config)
    limiter = table.rate_limiter
    state = {"seen": 0, "off": False}
    collector = cartpole(
        StepFilter(every_kth_step(10, state)), TableSink(table, timeout=5), chunk_len=50
    )
    collector.run_chunk()  # 100 steps collected, 10 stored
    assert (collector.frames, collector.steps_written, limiter.inserts) == (100, 10, 10)
    allowed = drain(table)
    # The learner followed the 10 stored steps (plus the one sample the check lets through),
    # not the 100 collected: 10 - min_diff + 1.
    assert allowed == limiter.inserts - limiter.min_diff + 1 == 11

    state["off"] = True
    collector.run_chunk()  # 100 more steps collected, all filtered out
    assert collector.frames == 200 and limiter.inserts == 10
    assert drain(table) == 0  # still blocked

    state["off"] = False
    collector.run_chunk()  # 10 more stored
    assert limiter.inserts == collector.steps_written == 20
    assert drain(table) == 10
    collector.close()


# -- processors by import path ----------------------------------------------------------------
P = "millpond.actors.processors:"


def callable_spec(name: str, **kwargs) -> dict:
    return {"path": P + name, "kwargs": kwargs}


def test_processors_given_by_path_store_what_the_same_processors_store():
    specs = [
        ProcessorSpec(
            P + "HindsightRelabeler",
            {
                "compute_reward": callable_spec("sparse_goal_reward", threshold=GOAL_TOL),
                "incomplete": "process",
            },
        ),
        {  # a mapping works as well, and so does the dotted path
            "path": "millpond.actors.processors.StepFilter",
            "kwargs": {"keep": callable_spec("key_in", key="action", values=[1], negate=True)},
        },
    ]
    by_hand = ProcessorChain(
        HindsightRelabeler(goal_reward, incomplete="process"),
        StepFilter(lambda ted: ted["action"] != 1),
    )
    sinks = []
    for processors in (build_processors(pickle.loads(pickle.dumps(specs))), by_hand):
        sink = RecordingSink()
        env = gym.vector.SyncVectorEnv([PointGoalEnv] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
        with Collector(env, sink, chunk_len=6, processors=processors, seed=4) as c:
            c.run(3)
        env.close()
        sinks.append(sink)
    by_path, expected = sinks
    assert segment_shapes(by_path.segments) == segment_shapes(expected.segments)
    assert len(expected.segments) > 5
    assert any(s.episode_id >= HINDSIGHT_EPISODE_OFFSET for s in by_path.segments)
    for got, want in zip(by_path.segments, expected.segments, strict=True):
        assert (got.steps == want.steps).all() and (got.tail == want.tail).all()


def test_each_build_is_a_new_processor_with_its_own_state():
    spec = ProcessorSpec(P + "EpisodeAnnotator", {"annotate": {"path": P + "label_episode"}})
    first, second = build_processors([spec, spec])
    assert isinstance(first, EpisodeAnnotator) and first is not second
    assert first._held is not second._held


def test_label_episode_labels_every_step_with_the_last_steps_flag():
    spec = ProcessorSpec(
        P + "EpisodeAnnotator",
        {"annotate": callable_spec("label_episode", source="next.truncated", key="success")},
    )
    sink = RecordingSink()
    with cartpole(build_processors([spec]), sink) as c:
        batches = [c.run_chunk() for _ in range(4)]
    collected, stored = batch_rows(batches), sink.rows()
    outcomes = set()
    for (ep, _), row in stored.items():
        last = max(s for (e, s) in collected if e == ep)
        success = bool(collected[ep, last]["next", "truncated"])
        assert row["success"].shape == (1,) and bool(row["success"]) == success
        outcomes.add(success)
    assert outcomes == {True, False}


def test_key_in_compares_one_value_per_step():
    ted = TensorDict(
        {"task": torch.tensor([0, 3, 1, 3]), "observation": torch.arange(8.0).reshape(4, 2)},
        batch_size=[4],
    )
    assert key_in(ted, key="task", values=[3]).tolist() == [False, True, False, True]
    assert key_in(ted, key="task", values=[3], negate=True).tolist() == [True, False, True, False]
    assert key_in(ted, key="observation", index=-1, values=[1, 7]).tolist() == [1, 0, 0, 1]
    with pytest.raises(InvalidDataError, match="one value per step"):
        key_in(ted, key="observation", values=[1])
    with pytest.raises(InvalidDataError, match="no key"):
        key_in(ted, key="next.task", values=[1])


def test_sparse_goal_reward_is_zero_within_the_threshold():
    achieved = torch.tensor([[0.0, 0.0], [0.03, 0.04], [0.1, 0.0]])
    desired = torch.zeros(3, 2)
    assert sparse_goal_reward(achieved, desired, threshold=0.05).tolist() == [0.0, 0.0, -1.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"path": "no_such_module:Thing"}, r"processors\[0\]\.path: .*cannot import"),
        ({"path": P + "NoSuchThing"}, r"processors\[0\]\.path: .*has no 'NoSuchThing'"),
        ({"path": "NoDots"}, r"processors\[0\]\.path: .*must look like"),
        ({"path": "builtins:dict"}, r"processors\[0\]\.path: .*gave dict, not an Experience"),
        ({"path": P + "ExperienceProcessor"}, r"processors\[0\]\.path: .*abstract"),
        ({"path": P + "StepFilter"}, r"processors\[0\]\.kwargs: .*missing a required .*'keep'"),
        (
            {"path": P + "StepFilter", "kwargs": {"kep": 1}},
            r"processors\[0\]\.kwargs: StepFilter\(keep\) has no argument 'kep'",
        ),
        (
            {"path": P + "EpisodeAnnotator", "kwargs": {"annotate": 1, "incomplete": "maybe"}},
            r"processors\[0\]\.kwargs: EpisodeAnnotator\(...\) failed: .*'drop' or 'process'",
        ),
        (
            {"path": P + "StepFilter", "kwargs": {"keep": {"path": P + "nope"}}},
            r"processors\[0\]\.kwargs\.keep\.path: callable .*has no 'nope'",
        ),
        (
            {"path": P + "StepFilter", "kwargs": {"keep": callable_spec("key_in", valus=[1])}},
            r"processors\[0\]\.kwargs\.keep\.kwargs: key_in\(ted, \*, key, .* 'valus'",
        ),
        ({"path": P + "PassThrough", "colour": 1}, r"processors\[0\]\.colour: unknown key"),
        ({"kwargs": {}}, r"processors\[0\]\.path: missing"),
        ({"path": P + "PassThrough", "kwargs": [1]}, r"processors\[0\]\.kwargs: expected a map"),
        ("just a string", r"processors\[0\]: expected a ProcessorSpec or a mapping"),
    ],
)
def test_bad_specs_fail_naming_the_field(spec, message):
    with pytest.raises(InvalidConfigError, match=message) as info:
        check_processors([spec])
    assert "\n" not in str(info.value)


def test_a_processor_list_is_a_list():
    with pytest.raises(InvalidConfigError, match="processors: expected a list"):
        check_processors({"path": P + "PassThrough"})
    assert check_processors([{"path": P + "PassThrough", "kwargs": None}]) == (
        ProcessorSpec(P + "PassThrough"),
    )
