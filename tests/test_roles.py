"""The page of roles (:mod:`millpond.roles`) matches the code that plays them.

Every implementer has every member its role names, methods with signatures the role's
callers can use (the role's parameters, in order, with the same kinds and defaults; any
extra ones optional), and real objects pass ``isinstance`` against their role.
"""

from __future__ import annotations

import inspect

import gymnasium as gym
import pytest
import torch
from torch import nn

from millpond import roles
from millpond.actors import processors
from millpond.actors.policies import ActorPolicy, ModulePolicy, RandomPolicy, make_policy
from millpond.config import TableConfig
from millpond.learner.box_networks import TwinQ, mlp_sac_actor, mlp_td3_actor
from millpond.learner.client import ReplayClient, Writer
from millpond.learner.dqn import DQNConfig, DQNLearner
from millpond.learner.ppo import PPOConfig, PPOLearner
from millpond.learner.sac import SACConfig, SACLearner
from millpond.learner.td3 import TD3Config, TD3Learner
from millpond.service.prioritized_slices import PrioritizedSliceSampler
from millpond.service.samplers import PrioritizedSampler, QueueSampler, Sampler, UniformSampler
from millpond.service.sink import TableSink
from millpond.service.slice_sampler import SliceSampler

IMPLEMENTERS: dict[type, list[type]] = {
    roles.SegmentSink: [Writer, TableSink],
    roles.Processor: [
        processors.ExperienceProcessor,
        processors.PassThrough,
        processors.ProcessorChain,
        processors.StepFilter,
        processors.EpisodeFilter,
        processors.EpisodeProcessor,
        processors.EpisodeAnnotator,
        processors.HindsightRelabeler,
    ],
    roles.Policy: [ActorPolicy, RandomPolicy, ModulePolicy],
    roles.SlotSampler: [
        Sampler,
        UniformSampler,
        PrioritizedSampler,
        QueueSampler,
        SliceSampler,
        PrioritizedSliceSampler,
    ],
    roles.Learner: [PPOLearner, DQNLearner, SACLearner, TD3Learner],
    roles.WeightSource: [ReplayClient],
}

CASES = [(role, cls) for role, classes in IMPLEMENTERS.items() for cls in classes]


def members(role: type) -> tuple[dict[str, object], set[str]]:
    """A role's methods and properties by name, and the names of its data attributes."""
    routines = {
        name: value
        for name, value in vars(role).items()
        if callable(value) or isinstance(value, property)
        if not name.startswith("_") or name == "__call__"
    }
    return routines, set(vars(role).get("__annotations__", {}))


def check_signature(role_fn: object, impl_fn: object, where: str) -> None:
    expected = list(inspect.signature(role_fn).parameters.values())
    actual = inspect.signature(impl_fn).parameters
    positional = [p.name for p in expected if p.kind is not p.KEYWORD_ONLY]
    assert [n for n in actual if n in positional] == positional, f"{where}: parameter order"
    for p in expected:
        assert p.name in actual, f"{where} has no parameter {p.name!r}"
        q = actual[p.name]
        assert q.kind == p.kind, f"{where}: {p.name!r} is {q.kind}, the role says {p.kind}"
        assert q.default == p.default, f"{where}: {p.name!r} defaults to {q.default!r}"
    for name, q in actual.items():
        if name not in positional and name not in {p.name for p in expected}:
            assert q.default is not q.empty or q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD), (
                f"{where}: {name!r} is required, the role's callers never pass it"
            )


def test_every_role_has_its_implementers_listed():
    assert set(IMPLEMENTERS) == {getattr(roles, name) for name in roles.__all__}
    for role in IMPLEMENTERS:
        routines, _ = members(role)
        assert routines, role


def check_plays(role: type, cls: type) -> None:
    routines, _ = members(role)
    for name, expected in routines.items():
        where = f"{cls.__name__}.{name}"
        assert hasattr(cls, name), f"{cls.__name__} lacks {name!r}, which {role.__name__} names"
        actual = inspect.getattr_static(cls, name)
        if isinstance(expected, property):
            assert isinstance(actual, property), f"{where} is not a property"
        else:
            assert callable(actual), f"{where} is not a method"
            check_signature(expected, getattr(cls, name), where)


@pytest.mark.parametrize(
    ("role", "cls"), CASES, ids=[f"{r.__name__}-{c.__name__}" for r, c in CASES]
)
def test_implementer_has_every_member_of_its_role(role: type, cls: type) -> None:
    check_plays(role, cls)


def test_a_role_naming_what_an_implementer_lacks_is_caught():
    class Wider(roles.WeightSource):
        def get_weights(self, min_version: int = 0, timeout_s: float = 0, *, strict: bool): ...

    class Longer(roles.WeightSource):
        def watch_weights(self) -> None: ...

    for role in (Wider, Longer):
        with pytest.raises(AssertionError):
            check_plays(role, ReplayClient)


def test_real_objects_play_their_roles(make_table) -> None:
    box, discrete = gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2)
    made = [
        processors.PassThrough(),
        processors.ProcessorChain(processors.PassThrough()),
        processors.StepFilter(lambda ted: torch.ones(ted.batch_size[0], dtype=torch.bool)),
        processors.EpisodeFilter(lambda ted: True),
        processors.EpisodeAnnotator(processors.label_episode),
        processors.HindsightRelabeler(processors.sparse_goal_reward),
    ]
    assert all(isinstance(p, roles.Processor) for p in made)

    policies = [
        RandomPolicy(discrete, 2, seed=0),
        ModulePolicy(nn.Linear(4, 2), box, discrete),
        make_policy(None, box, discrete, 2),
    ]
    assert all(isinstance(p, roles.Policy) for p in policies)

    configs = [
        TableConfig.uniform("uniform", capacity=64),
        TableConfig.prioritized("prioritized", capacity=64),
        TableConfig.queue("queue", capacity=64),
        TableConfig.slices("slices", capacity=64, slice_len=4),
        TableConfig.prioritized_slices("prioritized_slices", capacity=64, slice_len=4),
    ]
    tables = [make_table(c) for c in configs]
    for table in tables:
        assert isinstance(table.sampler, roles.SlotSampler), table.config.sampler
    assert isinstance(TableSink(tables[0]), roles.SegmentSink)
    assert not isinstance(tables[0], roles.SegmentSink)

    client = ReplayClient("127.0.0.1:1")  # never dialled: channels open on first use
    try:
        assert isinstance(client, roles.WeightSource)
        obs, act = gym.spaces.Box(-1, 1, (4,)), gym.spaces.Box(-2, 2, (1,))
        learners = [
            PPOLearner(client, "queue", PPOConfig(), nn.Linear(4, 2), nn.Linear(4, 1), version=0),
            DQNLearner(client, "uniform", DQNConfig(), nn.Linear(4, 2), version=0),
            *(
                learner(
                    client, "uniform", config(), actor(obs, act), TwinQ(obs, act), act, version=0
                )
                for learner, config, actor in (
                    (SACLearner, SACConfig, mlp_sac_actor),
                    (TD3Learner, TD3Config, mlp_td3_actor),
                )
            ),
        ]
        assert all(isinstance(learner, roles.Learner) for learner in learners)
    finally:
        client.close(timeout_s=0)
