"""The policy contract: random actions, modules, TensorDict modules, factories, exploration."""

from __future__ import annotations

import functools

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict
from tensordict.nn import (
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
)

from millpond.actors import Collector, EpsilonGreedy, ModulePolicy, load_factory
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.testing import CountingDictEnv


def cartpole(**kwargs) -> Collector:
    args = {"num_envs": 3, "chunk_len": 40, "seed": 0, **kwargs}
    return Collector("CartPole-v1", None, **args)


class ConstantLogits(torch.nn.Module):
    def __init__(self, logits) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(obs.shape[0], -1)


def test_the_default_policy_samples_the_action_space():
    with cartpole() as c:
        batch = c.collect()
    assert batch["action"].dtype == torch.int64 and batch["action"].shape == (3, 40)
    assert set(batch["action"].unique().tolist()) == {0, 1}
    assert "sample_log_prob" not in batch
    assert (batch["policy_version"] == -1).all()


def test_the_random_policy_is_seeded():
    with cartpole() as a, cartpole() as b:
        assert torch.equal(a.collect()["action"], b.collect()["action"])


def test_logits_are_sampled_or_their_mode_taken():
    with cartpole(policy=ConstantLogits([0.0, 0.0])) as c:
        batch = c.collect()
    assert set(batch["action"].unique().tolist()) == {0, 1}
    assert torch.allclose(batch["sample_log_prob"], torch.full((3, 40), -0.6931472))
    with cartpole(policy=ConstantLogits([0.0, 1.0]), deterministic=True) as c:
        batch = c.collect()
    assert (batch["action"] == 1).all()
    expected = torch.log_softmax(torch.tensor([0.0, 1.0]), -1)[1]
    assert torch.allclose(batch["sample_log_prob"], expected.expand(3, 40))


class DictObsActorCritic(torch.nn.Module):
    """Dict observations in (a TensorDict), a mapping with action, log-prob and value out."""

    def forward(self, obs):
        state = obs["state"]
        return {
            "action": torch.tanh(state[:, 2:4]),
            "sample_log_prob": -state[:, 1],
            "state_value": state[:, :1] * 2,
        }


def test_a_module_returning_a_mapping_on_dict_observations():
    env = gym.vector.SyncVectorEnv(
        [functools.partial(CountingDictEnv, pixel_shape=(1, 2, 2)) for _ in range(2)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    with Collector(env, None, chunk_len=10, policy=DictObsActorCritic(), seed=0) as c:
        batch = c.collect()
    state = batch["state"]
    assert torch.equal(batch["action"], torch.tanh(state[..., 2:4]))
    assert batch["action"].dtype == torch.float32
    assert torch.equal(batch["sample_log_prob"], -state[..., 1])
    assert torch.equal(batch["state_value"], state[..., :1] * 2)
    env.close()


def probabilistic_actor_critic() -> TensorDictSequential:
    logits = TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    actor = ProbabilisticTensorDictSequential(
        logits,
        ProbabilisticTensorDictModule(
            in_keys=["logits"],
            out_keys=["action"],
            distribution_class=torch.distributions.Categorical,
            return_log_prob=True,
        ),
    )
    value = TensorDictModule(
        torch.nn.Linear(4, 1), in_keys=["observation"], out_keys=["state_value"]
    )
    return TensorDictSequential(actor, value)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_probabilistic_tensordict_module(deterministic):
    torch.manual_seed(0)
    module = probabilistic_actor_critic()
    with cartpole(policy=module, deterministic=deterministic) as c:
        batch = c.collect()
    td = module(TensorDict({"observation": batch["observation"]}, batch_size=[3, 40]))
    logp = torch.log_softmax(td["logits"], -1)
    assert torch.allclose(batch["state_value"], td["state_value"])
    taken = logp.gather(-1, batch["action"].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(batch["sample_log_prob"], taken, atol=1e-6)
    if deterministic:
        assert torch.equal(batch["action"], td["logits"].argmax(-1))
    else:
        assert not torch.equal(batch["action"], td["logits"].argmax(-1))


def test_factories_by_name_and_by_callable():
    with cartpole(
        policy="torch.nn:Linear", policy_kwargs={"in_features": 4, "out_features": 2}
    ) as c:
        assert isinstance(c.policy.module, torch.nn.Linear)
        assert c.collect()["sample_log_prob"].shape == (3, 40)
    seen = {}

    def factory(observation_space, action_space, hidden=3):
        seen.update(obs=observation_space, act=action_space, hidden=hidden)
        return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))

    with cartpole(policy=factory, policy_kwargs={"hidden": 5}) as c:
        c.collect()
    assert seen["obs"].shape == (4,) and seen["act"].n == 2 and seen["hidden"] == 5


@pytest.mark.parametrize(
    ("policy", "kwargs", "match"),
    [
        ("torch.nn.Linear", {}, "package.module:function"),
        ("no_such_module_xyz:f", {}, "cannot import"),
        ("torch.nn:NoSuchThing", {}, "has no"),
        (lambda: "not a module", {}, "expected a torch nn.Module"),
        (None, {"epsilon": EpsilonGreedy()}, "needs a policy"),
    ],
)
def test_bad_policies_are_reported(policy, kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        cartpole(policy=policy, **kwargs)


def test_a_module_returning_neither_action_nor_logits():
    module = TensorDictModule(torch.nn.Linear(4, 1), in_keys=["observation"], out_keys=["value"])
    with cartpole(policy=module) as c, pytest.raises(InvalidDataError, match="neither"):
        c.collect()


def test_epsilon_schedule():
    eps = EpsilonGreedy(eps_start=1.0, eps_end=0.1, decay_frames=100)
    assert eps.epsilon(0) == 1.0
    assert eps.epsilon(50) == pytest.approx(0.55)
    assert eps.epsilon(100) == eps.epsilon(10**9) == pytest.approx(0.1)
    for bad in [{"eps_start": 1.5}, {"eps_end": -0.1}, {"decay_frames": -1}]:
        with pytest.raises(InvalidConfigError):
            EpsilonGreedy(**bad)


def test_epsilon_greedy_explores_then_exploits():
    greedy = ConstantLogits([0.0, 3.0])  # greedy action: 1
    eps = EpsilonGreedy(eps_start=1.0, eps_end=0.0, decay_frames=120)
    with cartpole(policy=greedy, deterministic=True, epsilon=eps, chunk_len=40) as c:
        early, _, late = c.collect(), c.collect(), c.collect()  # frames 0-119, ..., 240-359
    assert (early["action"] == 0).sum() > 20  # about half of the early actions are random
    assert (late["action"] == 1).all()
    # The recorded log-probability is the behaviour policy's: eps / 2 (+ 1 - eps if greedy).
    frames = torch.arange(40).unsqueeze(0) * 3  # all three lanes act at each env step
    eps_t = (1 - frames / 120).clamp(min=0).expand(3, 40)
    expected = torch.where(early["action"] == 1, 1 - eps_t / 2, eps_t / 2)
    assert torch.allclose(early["sample_log_prob"].exp(), expected, atol=1e-5)


def test_epsilon_greedy_needs_discrete_actions():
    env = gym.vector.SyncVectorEnv([functools.partial(CountingDictEnv, pixel_shape=(1, 2, 2))])
    with pytest.raises(InvalidConfigError, match="Discrete"):
        Collector(env, None, chunk_len=4, policy=DictObsActorCritic(), epsilon=EpsilonGreedy())
    env.close()


def test_load_factory_resolves_dotted_attributes():
    assert load_factory("torch.nn:Linear") is torch.nn.Linear
    assert load_factory("torch:nn.Linear") is torch.nn.Linear


def test_module_policy_casts_actions_to_the_space():
    space = gym.spaces.Box(-1, 1, (2,), dtype="float32")

    class Double(torch.nn.Module):
        def forward(self, obs):
            return {"action": obs[:, :2].double()}

    policy = ModulePolicy(Double(), gym.spaces.Box(-5, 5, (4,)), space, seed=0)
    out = policy(TensorDict({"observation": torch.ones(3, 4)}, batch_size=[3]), frames=0)
    assert out["action"].dtype == torch.float32 and out["action"].shape == (3, 2)
