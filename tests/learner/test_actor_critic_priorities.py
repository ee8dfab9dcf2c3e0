"""SAC and TD3 on a prioritized table: the importance-weighted critic loss and the priorities
against TorchRL's ``SACLoss`` / ``TD3Loss`` given the same weights (their
``priority_weight``), and the priorities a step sends through a real server: ``max_i |td_i|
+ eps`` for each sampled transition, raised by the table to its ``alpha``, and dropped for
a slot overwritten since it was sampled."""

from __future__ import annotations

import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector
from millpond.errors import InvalidDataError
from millpond.learner.box_networks import TwinQ, mlp_sac_actor, mlp_td3_actor
from millpond.learner.sac import SACConfig, SACLearner
from millpond.learner.td3 import TD3Config, TD3Learner
from tests.learner import test_sac, test_td3
from tests.learner._helpers import write_chunk
from tests.learner.test_sac import ACT, OBS, fixed_batch

pytestmark = pytest.mark.usefixtures("one_thread")

ALGORITHMS = {
    "sac": (SACConfig, SACLearner, mlp_sac_actor, test_sac.torchrl_loss),
    "td3": (TD3Config, TD3Learner, mlp_td3_actor, test_td3.torchrl_loss),
}


def make_learner(client, algo: str, table: str, obs=OBS, act=ACT, **config):
    config_type, learner_type, policy, _ = ALGORITHMS[algo]
    torch.manual_seed(0)
    return learner_type(
        client,
        table,
        config_type(prioritized=True, **config),
        policy(obs, act, (32, 32)),
        TwinQ(obs, act, (32, 32)),
        act,
        version=-1,
    )


@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_weighted_critic_loss_and_priorities_match_torchrl(client, algo):
    """With importance weights on the batch, the critic loss ``mean_b(w_b l_b)`` (PER's, and
    DQN's here: the table's weights are already divided by their largest) equals TorchRL's
    weighted ``loss_qvalue``, which divides by ``sum_b w_b`` instead of the batch size
    (and, for SAC, is twice the paper's 1/2 E[...]); the priorities equal TorchRL's
    ``td_error`` (SAC: ``max_i |td_i|``; TD3: ``max_i td_i^2``, hence its square root)."""
    learner = make_learner(client, algo, "replay", batch_size=64, gamma=0.97, priority_eps=0.0)
    with torch.no_grad():
        for p in learner.target_critic.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = fixed_batch()
    weight = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.05
    ours_batch = batch.clone()
    ours_batch["weight"] = weight
    theirs_batch = batch.clone()
    theirs_batch["action"] = learner.box.to_unit(batch["action"])
    theirs_batch["priority_weight"] = weight
    theirs = ALGORITHMS[algo][3](learner)

    torch.manual_seed(7)
    ours = learner.losses(ours_batch)
    torch.manual_seed(7)
    out = theirs(theirs_batch)

    scale = (2.0 if algo == "sac" else 1.0) * 64 / weight.sum()
    torch.testing.assert_close(scale * ours["loss_critic"], out["loss_qvalue"])
    td = theirs_batch["td_error"] if algo == "sac" else theirs_batch["td_error"].sqrt()
    torch.testing.assert_close(learner.priorities(ours["td_error"]), td)
    # the weights matter: the unweighted loss differs
    plain = ours["td_error"].pow(2).mean(-1).sum() / (2.0 if algo == "sac" else 1.0)
    assert not torch.allclose(ours["loss_critic"], plain)


class Spy:
    """The client, recording the batches a learner samples and the priorities it sends;
    ``before_update`` runs before each priority update is forwarded."""

    def __init__(self, client: ReplayClient, before_update=None) -> None:
        self.client = client
        self.batches: list = []
        self.priorities: list = []
        self.applied: list[int] = []
        self.before_update = before_update

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def sample(self, table, batch_size, timeout_s=None):
        batch = self.client.sample(table, batch_size, timeout_s)
        self.batches.append(batch.clone())
        return batch

    def update_priorities(self, table, index, priorities) -> int:
        if self.before_update is not None:
            self.before_update()
        self.priorities.append((index, torch.as_tensor(priorities)))
        self.applied.append(self.client.update_priorities(table, index, priorities))
        return self.applied[-1]


def pendulum_chunk(seed: int, lanes: int = 2, steps: int = 64):
    with Collector("Pendulum-v1", num_envs=lanes, chunk_len=steps, seed=seed) as collector:
        return collector.collect()


@pytest.fixture
def pendulum_spaces():
    import gymnasium as gym

    env = gym.make("Pendulum-v1")
    yield env.observation_space, env.action_space
    env.close()


@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_a_step_sends_max_td_error_priorities_the_table_raises_to_alpha(
    client, algo, pendulum_spaces
):
    table = TableConfig.prioritized("replay", capacity=4096, alpha=0.7, seed=1)
    client.create_table(table)
    n = write_chunk(client, "replay", pendulum_chunk(0))
    assert client.info("replay")["mass"] == pytest.approx(n)  # every new step: priority 1

    spy = Spy(client)
    eps = 1e-3
    learner = make_learner(spy, algo, "replay", *pendulum_spaces, batch_size=64, priority_eps=eps)
    # the same networks (the same seed), kept as they are before the step
    before = make_learner(client, algo, "replay", *pendulum_spaces, batch_size=64)
    torch.manual_seed(5)
    metrics = learner.step()
    assert metrics["priorities_applied"] == 64
    (batch,), ((index, priorities),) = spy.batches, spy.priorities
    assert torch.equal(index["slot"], batch["index", "slot"])
    torch.manual_seed(5)  # the same draws of the target's noise
    with torch.no_grad():
        td_error = before.losses(batch)["td_error"]
    assert td_error.shape == (2, 64)
    torch.testing.assert_close(priorities.float(), td_error.abs().max(0).values + eps)

    # The table's mass is sum_i p_i^alpha: each sampled slot holds its new priority (a
    # slot drawn twice keeps the last), every other step still 1.
    last = dict(zip(index["slot"].tolist(), priorities.tolist(), strict=True))
    expected = n - len(last) + sum(p**table.alpha for p in last.values())
    assert client.info("replay")["mass"] == pytest.approx(expected, rel=1e-6)
    assert client.sample("replay", 256)["weight"].unique().numel() > 1  # no longer uniform


@pytest.mark.parametrize("algo", ["sac", "td3"])
def test_priorities_of_overwritten_slots_are_dropped(client, algo, pendulum_spaces):
    """The ring is written over three times between the sample and the priority update:
    no slot still holds a step that was sampled, and the server applies none."""
    client.create_table(TableConfig.prioritized("replay", capacity=512, seed=1))
    write_chunk(client, "replay", pendulum_chunk(0))

    def overwrite() -> None:
        for seed in (1, 2, 3):
            write_chunk(client, "replay", pendulum_chunk(seed, lanes=4, steps=128))

    spy = Spy(client, before_update=overwrite)
    learner = make_learner(spy, algo, "replay", *pendulum_spaces, batch_size=32)
    metrics = learner.step()
    assert spy.applied == [0] and metrics["priorities_applied"] == 0


def test_prioritized_needs_weights_and_uniform_refuses_them(client):
    learner = make_learner(client, "sac", "replay")
    with pytest.raises(InvalidDataError, match="needs a prioritized table"):
        learner.losses(fixed_batch())
    batch = fixed_batch()
    batch["weight"] = torch.ones(64)
    uniform = SACLearner(
        client, "replay", SACConfig(), mlp_sac_actor(OBS, ACT), TwinQ(OBS, ACT), ACT, version=-1
    )
    with pytest.raises(InvalidDataError, match="prioritized=False"):
        uniform.losses(batch)
