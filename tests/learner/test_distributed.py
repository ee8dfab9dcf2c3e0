"""Data-parallel learners: averaged gradients equal the gradient of the concatenated batch.

Two gloo processes (``torch.multiprocessing``) each hold part of one batch; after
:func:`~millpond.learner.distributed.average_gradients` (and after a whole data-parallel PPO
update) they must hold what one process computes on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from torch import nn

from millpond.learner import distributed
from millpond.learner.ppo import PPOConfig, PPOLearner

ROWS = (3, 5)  # unequal parts: the weights matter


def whole_batch() -> TensorDict:
    g = torch.Generator().manual_seed(1)
    n = sum(ROWS)
    return TensorDict(
        {
            "observation": torch.randn(n, 4, generator=g),
            "action": torch.randint(0, 2, (n,), generator=g),
            "sample_log_prob": torch.full((n,), -0.7),
            "advantage": torch.randn(n, generator=g),
            "value_target": torch.randn(n, generator=g),
        },
        batch_size=[n],
    )


def networks() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), nn.Linear(4, 1)


def part(batch: TensorDict, rank: int) -> TensorDict:
    start = sum(ROWS[:rank])
    return batch[start : start + ROWS[rank]]


class Publisher:
    """Stands in for the client: records what is published."""

    def __init__(self) -> None:
        self.published: list[int] = []

    def publish_weights(self, state, version: int) -> int:
        self.published.append(version)
        return version

    def publish_weights_later(self, state, version: int, max_lag=None):
        self.publish_weights(state, version)
        return Answered(version)


class Answered:
    """A publication answered at once."""

    def __init__(self, version: int) -> None:
        self.version = version

    def result(self) -> int:
        return self.version


def _rank_main(rank: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        batch = part(whole_batch(), rank)
        policy, critic = networks()
        learner = PPOLearner(None, "t", PPOConfig(), policy, critic, version=0, data_parallel=True)
        learner.loss(batch)["loss"].backward()
        params = [*policy.parameters(), *critic.parameters()]
        total = distributed.average_gradients(params, batch.shape[0])
        grads = [p.grad.clone() for p in params]
        # A whole update: each rank's part in one minibatch, one epoch.
        config = PPOConfig(epochs=1, minibatch_size=8, max_grad_norm=0.5)
        policy, critic = networks()
        client = Publisher()
        learner = PPOLearner(client, "t", config, policy, critic, version=0, data_parallel=True)
        learner.update(batch)
        version = learner.publish()
        results[rank] = {
            "total": total,
            "grads": grads,
            "params": [p.detach().clone() for p in learner.optimizer.param_groups[0]["params"]],
            "version": version,
            "published": client.published,
            "agree": distributed.all_true(rank == 0),
            "any": distributed.any_true(rank == 0),
        }
    finally:
        dist.destroy_process_group()


def run_two_ranks(main, tmp_path) -> dict:
    """``main(rank, init_file, results)`` in two processes; what each put in ``results``."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(main, args=(str(tmp_path / "init"), results), nprocs=2, join=True)
        return dict(results)


def test_averaged_gradients_equal_the_gradient_of_the_concatenated_batch(tmp_path):
    results = run_two_ranks(_rank_main, tmp_path)

    batch = whole_batch()
    policy, critic = networks()
    learner = PPOLearner(None, "t", PPOConfig(), policy, critic, version=0)
    learner.loss(batch)["loss"].backward()
    expected = [p.grad for p in [*policy.parameters(), *critic.parameters()]]
    for rank in (0, 1):
        assert results[rank]["total"] == sum(ROWS)
        for got, want in zip(results[rank]["grads"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    config = PPOConfig(epochs=1, minibatch_size=8, max_grad_norm=0.5)
    policy, critic = networks()
    single = PPOLearner(None, "t", config, policy, critic, version=0)
    single.update(batch)
    want = single.optimizer.param_groups[0]["params"]
    for rank in (0, 1):
        for got, w in zip(results[rank]["params"], want, strict=True):
            torch.testing.assert_close(got, w.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # the ranks stay identical
    assert results[0]["version"] == results[1]["version"] == 1
    assert results[0]["published"] == [1] and results[1]["published"] == []  # rank 0 alone
    assert results[0]["agree"] is False and results[0]["any"] is True


def test_without_a_group_everything_is_the_single_process_case():
    assert distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.all_true(True) and not distributed.any_true(False)
    assert distributed.global_max(3.0) == 3.0
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 2.0)
    assert distributed.average_gradients([p], 4) == 4.0 and torch.equal(
        p.grad, torch.full((2,), 2.0)
    )
    turn = distributed.BatchTurn(False)
    assert turn.take(lambda: "batch") == "batch"


def _turn_main(rank: int, init_file: str, results) -> None:
    import datetime

    from millpond.errors import DeadlineExceededError, ShardUnavailableError

    # A short group timeout: a rank left waiting in a collective fails the test, not hangs it.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )
    try:
        turn = distributed.BatchTurn(True)
        outcomes = []

        def unreachable():
            raise ShardUnavailableError("every shard is down")

        # Turn 1: rank 0's sample fails (not a timeout), rank 1 gets a batch and keeps it.
        try:
            turn.take(unreachable if rank == 0 else (lambda: "kept"))
        except (ShardUnavailableError, DeadlineExceededError) as e:
            outcomes.append(type(e).__name__)
        # Turn 2: both have batches; rank 1 hands over the one it kept, not a new one.
        outcomes.append(turn.take(lambda: f"fresh-{rank}"))
        outcomes.append(distributed.all_true(True))  # the group is still in step
        results[rank] = outcomes
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_sample_fails_outright_keeps_the_group_in_step(tmp_path):
    results = run_two_ranks(_turn_main, tmp_path)
    assert results[0] == ["ShardUnavailableError", "fresh-0", True]
    assert results[1] == ["DeadlineExceededError", "kept", True]


class _Batches:
    """Stands in for the sample source: always this rank's part of the batch."""

    def __init__(self, batch: TensorDict) -> None:
        self.batch = batch

    def next(self) -> TensorDict:
        return self.batch

    def close(self) -> None:
        pass


def _td3_learner(batch: TensorDict, data_parallel: bool, client=None):
    """A TD3 learner with no target smoothing noise and a policy step every step: one
    step is then a deterministic function of the batch."""
    from millpond.learner.box_networks import TwinQ, mlp_td3_actor
    from millpond.learner.td3 import TD3Config, TD3Learner
    from tests.learner.test_sac import ACT, OBS

    torch.manual_seed(0)
    config = TD3Config(policy_delay=1, target_noise=0.0, publish_every=1)
    policy, critic = mlp_td3_actor(OBS, ACT, (8,)), TwinQ(OBS, ACT, (8,))
    learner = TD3Learner(
        client, "t", config, policy, critic, ACT, version=0, data_parallel=data_parallel
    )
    learner._batches = _Batches(batch)
    return learner


def _actor_critic_main(rank: int, init_file: str, results) -> None:
    from tests.learner.test_sac import fixed_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        client = Publisher()
        learner = _td3_learner(part(fixed_batch(sum(ROWS)), rank), True, client)
        learner.step()
        modules = (learner.policy, learner.critic, learner.target_policy, learner.target_critic)
        results[rank] = {
            "params": [p.detach().clone() for m in modules for p in m.parameters()],
            "published": client.published,
        }
    finally:
        dist.destroy_process_group()


def test_a_data_parallel_actor_critic_step_is_the_step_on_the_concatenated_batch(tmp_path):
    """Two TD3 ranks (the actor-critic step SAC shares), each stepping on its part of one
    batch, end with the networks and targets one learner has after a step on the whole
    batch; rank 0 alone publishes."""
    from tests.learner.test_sac import fixed_batch

    results = run_two_ranks(_actor_critic_main, tmp_path)
    single = _td3_learner(fixed_batch(sum(ROWS)), False, Publisher())
    single.step()
    modules = (single.policy, single.critic, single.target_policy, single.target_critic)
    want = [p.detach() for m in modules for p in m.parameters()]
    for rank in (0, 1):
        for got, w in zip(results[rank]["params"], want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    assert results[0]["published"] == [1] and results[1]["published"] == []
