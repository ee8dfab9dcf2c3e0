"""PPOLearner against a real in-process server, on fixed CartPole experience.

The experience comes from the real :class:`millpond.actors.Collector` running the policy
factory ``"millpond.learner.networks:mlp_policy"`` with weights pulled from the server, so
``sample_log_prob`` and ``policy_version`` are what actors record. The same chunk is written
again (through ``client.writer``) before every learner step, so the losses are measured on
fixed data.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from millpond import ReplayClient, TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner.estimators import gae_from_batch
from millpond.learner.networks import mlp_critic, mlp_policy
from millpond.learner.ppo import PPOConfig, PPOLearner
from tests.learner._helpers import (
    CHUNK,
    LANES,
    assert_published,
    cartpole_spaces,
    collect_chunk,
    write_chunk,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FACTORY = "millpond.learner.networks:mlp_policy"
QUEUE = "rollouts"


@pytest.fixture
def client(client: ReplayClient) -> ReplayClient:
    """The shared in-process server's client, with the queue table created."""
    client.create_table(TableConfig.queue(QUEUE, capacity=4096))
    return client


def make_learner(client: ReplayClient, config: PPOConfig, seed: int = 0) -> PPOLearner:
    torch.manual_seed(seed)
    obs_space, act_space = cartpole_spaces()
    return PPOLearner(
        client, QUEUE, config, mlp_policy(obs_space, act_space), mlp_critic(obs_space)
    )


def collect(client: ReplayClient, seed: int = 0) -> TensorDict:
    """One chunk ``[P, T]`` acted by the policy factory with the server's latest weights."""
    return collect_chunk(client, FACTORY, seed)


def write(client: ReplayClient, chunk: TensorDict) -> int:
    """Write a chunk's segments to the queue (as an actor's writer would); returns steps."""
    return write_chunk(client, QUEUE, chunk)


def test_actors_record_the_learners_log_probs(client):
    """The factory builds the learner's architecture: published weights load into the actors,
    and what they record as ``sample_log_prob`` is the learner's policy's log-probability."""
    learner = make_learner(client, PPOConfig())
    assert learner.version == -1  # nothing published yet
    assert learner.publish() == 0
    chunk = collect(client)
    assert (chunk["policy_version"] == 0).all()
    with torch.no_grad():
        logits = learner.policy(chunk["observation"])
    log_prob = torch.log_softmax(logits, -1).gather(-1, chunk["action"].unsqueeze(-1))
    torch.testing.assert_close(chunk["sample_log_prob"], log_prob.squeeze(-1))


def test_steps_lower_the_losses_on_fixed_data_and_publish_weights(client):
    config = PPOConfig(
        batch_size=LANES * CHUNK, minibatch_size=64, epochs=4, lr=1e-3, max_policy_lag=None
    )
    learner = make_learner(client, config)
    learner.publish()
    chunk = collect(client)
    n = write(client, chunk)

    # The fixed evaluation batch: the queue's own sample, with GAE of the initial critic
    # and the advantages normalised as the learner does.
    fixed = client.sample(QUEUE, n)
    assert fixed.shape == (n,) and client.info(QUEUE)["size"] == 0
    advantage, _ = gae_from_batch(
        fixed, learner.critic, config.gamma, config.lmbda, obs_key="observation"
    )
    fixed["advantage"] = (advantage - advantage.mean()) / advantage.std()
    with torch.no_grad():
        before = learner.loss(fixed)
    assert float(before["loss_policy"]) == pytest.approx(0.0, abs=1e-5)  # ratio 1, E[A] = 0
    assert float(before["approx_kl"]) == pytest.approx(0.0, abs=1e-6)

    history = []
    for i in range(6):
        write(client, chunk)
        steps_before = learner.updates
        metrics = learner.step()
        history.append(metrics)
        # one gradient step per minibatch; the chunk's version 0 was published at step 0
        assert learner.updates - steps_before == config.epochs * -(-n // config.minibatch_size)
        assert metrics["policy_lag_steps_max"] == steps_before
        assert metrics["sampled"] == metrics["steps"] == n and metrics["dropped"] == 0
        assert metrics["policy_lag_max"] == i  # the chunk was acted by version 0
        assert metrics["version"] == i + 1
        assert_published(client, learner, i + 1, learner.policy)
        assert client.info(QUEUE)["size"] == 0  # each step consumed once
        for key in ("loss_policy", "loss_value", "entropy", "approx_kl", "clip_fraction"):
            assert torch.isfinite(torch.tensor(metrics[key])), key

    with torch.no_grad():
        after = learner.loss(fixed)
    assert float(after["loss_policy"]) < float(before["loss_policy"]) - 0.005
    assert float(after["loss_value"]) < 0.9 * float(before["loss_value"])
    assert history[-1]["loss_value"] < history[0]["loss_value"]
    assert history[-1]["loss_policy"] < history[0]["loss_policy"]


def test_too_old_steps_are_dropped_and_the_lag_reported(client):
    config = PPOConfig(batch_size=LANES * CHUNK, minibatch_size=128, epochs=1, max_policy_lag=1)
    learner = make_learner(client, config)
    learner.publish()
    old = collect(client, seed=0)  # acted by version 0

    for version in (1, 2):  # lag 0, then 1: within max_policy_lag
        write(client, old)
        metrics = learner.step()
        assert metrics["dropped"] == 0 and metrics["version"] == version

    write(client, old)  # lag 2: every step is dropped, nothing trained or published
    metrics = learner.step()
    assert metrics["dropped"] == metrics["sampled"] == LANES * CHUNK
    assert metrics["steps"] == 0 and "loss" not in metrics
    assert metrics["policy_lag_mean"] == metrics["policy_lag_max"] == 2
    assert metrics["version"] == 2 and client.get_weights()[1] == 2
    assert client.info(QUEUE)["size"] == 0  # the dropped steps are consumed, not requeued

    fresh = collect(client, seed=1)  # actors synced to version 2
    assert (fresh["policy_version"] == 2).all()
    n_old, n_new = write(client, old), write(client, fresh)
    learner = PPOLearner(  # a new learner picks up the server's version
        client,
        QUEUE,
        PPOConfig(batch_size=n_old + n_new, minibatch_size=128, epochs=1, max_policy_lag=1),
        learner.policy,
        learner.critic,
    )
    assert learner.version == 2
    metrics = learner.step()
    assert metrics["sampled"] == n_old + n_new
    assert metrics["dropped"] == n_old and metrics["steps"] == n_new
    assert metrics["policy_lag_max"] == 2
    assert metrics["policy_lag_mean"] == pytest.approx(2 * n_old / (n_old + n_new))
    assert metrics["version"] == 3
    assert_published(client, learner, 3, learner.policy)


def test_a_batch_without_policy_versions_is_refused(client):
    learner = make_learner(client, PPOConfig(batch_size=8))
    batch = TensorDict({"observation": torch.zeros(8, 4)}, [8])
    with pytest.raises(InvalidDataError, match="policy_version"):
        learner.drop_stale(batch)


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": 0}, {"clip_eps": 0.0}, {"gamma": 1.5}, {"max_policy_lag": -1}, {"lr": True}],
)
def test_config_checks_its_values(kwargs):
    with pytest.raises(InvalidConfigError, match=next(iter(kwargs))):
        PPOConfig(**kwargs)
