"""DQNLearner against a real in-process server, on fixed CartPole experience.

The experience comes from the real :class:`millpond.actors.Collector` running the factory
``"millpond.learner.networks:mlp_q"`` greedily (``deterministic=True``) with epsilon-greedy
exploration, and is written once into uniform, prioritized, slices and prioritized slices
tables; the learner
then samples the same stored steps over and over, so its TD loss is measured on fixed data.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

from millpond import ReplayClient, TableConfig
from millpond.actors import Collector, EpsilonGreedy, make_policy
from millpond.errors import InvalidConfigError, InvalidDataError, RateLimiterTimeoutError
from millpond.learner.dqn import DQNConfig, DQNLearner
from millpond.learner.networks import mlp_q
from tests.learner._helpers import assert_published, cartpole_spaces, collect_chunk, write_chunk

pytestmark = pytest.mark.usefixtures("one_thread")

FACTORY = "millpond.learner.networks:mlp_q"
TABLES = {
    "uniform": TableConfig.uniform("uniform", capacity=4096, seed=1),
    "prioritized": TableConfig.prioritized("prioritized", capacity=4096, seed=1),
    "slices": TableConfig.slices("slices", capacity=4096, slice_len=3, seed=1),
    "prioritized_slices": TableConfig.prioritized_slices(
        "prioritized_slices", capacity=4096, slice_len=3, seed=1, strict_length=False
    ),
}


def make_learner(client: ReplayClient, table: str, config: DQNConfig, seed: int = 0) -> DQNLearner:
    torch.manual_seed(seed)
    return DQNLearner(client, table, config, mlp_q(*cartpole_spaces()))


def collect(client: ReplayClient, seed: int = 0) -> TensorDict:
    """One chunk ``[P, T]``: greedy on the server's latest Q-network, epsilon 0.5."""
    return collect_chunk(
        client,
        FACTORY,
        seed,
        deterministic=True,
        epsilon=EpsilonGreedy(eps_start=0.5, eps_end=0.5, decay_frames=0),
    )


def test_dueling_head_is_value_plus_centred_advantage_and_loads_into_actors():
    """``mlp_q(dueling=True)`` computes ``V + A - mean(A)`` (Wang et al. 2016) from its
    output layer's two streams, and an actor built by the same factory and kwargs loads
    the learner's state dict and acts greedily on it."""
    obs_space, act_space = cartpole_spaces()
    torch.manual_seed(0)
    q = mlp_q(obs_space, act_space, (16, 8), dueling=True)
    obs = torch.randn(5, 4)
    with torch.no_grad():
        out = q.mlp(obs)  # [5, 1 + n]: V, then A
        value, advantage = out[:, 0], out[:, 1:]
        for b in range(5):
            mean = sum(float(a) for a in advantage[b]) / len(advantage[b])
            expected = [float(value[b]) + float(a) - mean for a in advantage[b]]
            torch.testing.assert_close(q(obs[b]), torch.tensor(expected))
    policy = make_policy(
        FACTORY,
        obs_space,
        act_space,
        num_envs=5,
        policy_kwargs={"hidden": (16, 8), "dueling": True},
        deterministic=True,
    )
    policy.module.load_state_dict(q.state_dict())
    out = policy(TensorDict({"observation": obs}, [5]), frames=0)
    with torch.no_grad():
        assert torch.equal(out["action"], q(obs).argmax(-1))


def test_actors_act_greedily_on_the_q_network():
    """``mlp_q`` as an actor factory with ``deterministic=True`` plays ``argmax_a Q(s, a)``."""
    obs_space, act_space = cartpole_spaces()
    policy = make_policy(FACTORY, obs_space, act_space, num_envs=8, deterministic=True)
    obs = torch.randn(8, 4)
    out = policy(TensorDict({"observation": obs}, [8]), frames=0)
    with torch.no_grad():
        greedy = policy.module(obs).argmax(-1)
    assert torch.equal(out["action"], greedy)


@pytest.mark.parametrize(
    ("kind", "n_step"),
    [("uniform", 1), ("prioritized", 1), ("slices", 3), ("prioritized_slices", 3)],
)
def test_steps_lower_the_td_loss_on_fixed_data_and_publish_weights(client, kind, n_step):
    config = DQNConfig(
        batch_size=64,
        lr=1e-3,
        n_step=n_step,
        prioritized=kind.startswith("prioritized"),
        target_update_every=1000,  # a fixed target: the loss is a fixed regression
        publish_every=10,
    )
    client.create_table(TABLES[kind])
    learner = make_learner(client, kind, config)
    assert learner.publish() == 0
    chunk = collect(client)
    assert (chunk["policy_version"] == 0).all()
    write_chunk(client, kind, chunk)
    fixed = client.sample(kind, 64)
    assert fixed.shape == ((64, 3) if kind.endswith("slices") else (64,))
    with torch.no_grad():
        before = float(learner.loss(fixed)[0])
    for i in range(1, 41):
        metrics = learner.step()
        assert metrics["updates"] == i
        assert metrics["published"] == (i // 10 if i % 10 == 0 else None)
        assert metrics["version"] == i // 10
        assert metrics["sample_age_max"] == (i - 1) // 10
        # acted by version 0, published before the first step: i - 1 steps since
        assert metrics["sample_age_steps_max"] == metrics["sample_age_steps_mean"] == i - 1
        assert metrics["target_updated"] is False
    assert_published(client, learner, 4, learner.q_network)
    with torch.no_grad():
        after = float(learner.loss(fixed)[0])
    assert after < 0.7 * before


class Spy:
    """The client, recording what the learner samples and the priorities it sends."""

    def __init__(self, client: ReplayClient) -> None:
        self.client = client
        self.batches: list[TensorDict] = []
        self.priorities: list[tuple[TensorDict, torch.Tensor]] = []

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def sample(self, table: str, batch_size: int, timeout_s: float | None = None) -> TensorDict:
        batch = self.client.sample(table, batch_size, timeout_s)
        self.batches.append(batch.clone())
        return batch

    def update_priorities(self, table: str, index, priorities) -> int:
        self.priorities.append((index, torch.as_tensor(priorities)))
        return self.client.update_priorities(table, index, priorities)


def test_priorities_follow_the_td_errors(client):
    table = TABLES["prioritized"]
    client.create_table(table)
    n = write_chunk(client, table.name, collect(client))
    assert client.info(table.name)["mass"] == pytest.approx(n)  # every new step: priority 1
    assert bool((client.sample(table.name, 64)["weight"] == 1).all())

    spy = Spy(client)
    config = DQNConfig(batch_size=64, prioritized=True, priority_eps=1e-3)
    learner = make_learner(spy, table.name, config)  # type: ignore[arg-type]
    # The same networks, kept as they are before the step, to recompute its TD errors.
    before = DQNLearner(client, table.name, config, copy.deepcopy(learner.q_network))
    metrics = learner.step()
    assert metrics["priorities_applied"] == 64
    (batch,), ((index, priorities),) = spy.batches, spy.priorities
    assert torch.equal(index["slot"], batch["index", "slot"])
    with torch.no_grad():
        _, td_error, _ = before.loss(batch)
    torch.testing.assert_close(priorities.float(), td_error.abs() + config.priority_eps)

    # The table's mass is sum_i p_i^alpha: the sampled slots now hold their new priority
    # (a slot drawn twice keeps the last), every other step still 1.
    last = dict(zip(index["slot"].tolist(), priorities.tolist(), strict=True))
    expected = n - len(last) + sum(p**table.alpha for p in last.values())
    assert client.info(table.name)["mass"] == pytest.approx(expected, rel=1e-6)
    assert client.sample(table.name, 256)["weight"].unique().numel() > 1  # no longer uniform


def test_target_network_is_copied_on_schedule(client):
    client.create_table(TABLES["uniform"])
    write_chunk(client, "uniform", collect(client))
    learner = make_learner(
        client, "uniform", DQNConfig(batch_size=32, lr=1e-2, target_update_every=3)
    )

    def synced() -> bool:
        online, target = learner.q_network.state_dict(), learner.target_network.state_dict()
        return all(torch.equal(online[k], target[k]) for k in online)

    assert synced()  # the target starts as a copy
    flags = []
    for _ in range(7):
        flags.append(learner.step()["target_updated"])
        assert synced() == flags[-1]
    assert flags == [False, False, True, False, False, True, False]
    assert not any(p.requires_grad for p in learner.target_network.parameters())


def test_soft_target_updates_follow_polyak_averaging(client):
    client.create_table(TABLES["uniform"])
    write_chunk(client, "uniform", collect(client))
    tau = 0.1
    learner = make_learner(client, "uniform", DQNConfig(batch_size=32, lr=1e-2, target_tau=tau))
    for _ in range(3):
        before = {k: v.clone() for k, v in learner.target_network.state_dict().items()}
        assert learner.step()["target_updated"]
        online = learner.q_network.state_dict()
        for name, target in learner.target_network.state_dict().items():
            expected = (1 - tau) * before[name] + tau * online[name]  # after the step's update
            torch.testing.assert_close(target, expected)
        assert not torch.equal(target, online[name])  # soft: not a copy
    with pytest.raises(InvalidConfigError, match="target_tau"):
        DQNConfig(target_tau=0.0)


def hand_n_step_target(learner: DQNLearner, row: TensorDict, n: int, gamma: float) -> float:
    """The n-step target of a slice's first step, summed one reward at a time."""
    double = learner.config.double_dqn
    G = 0.0
    for k in range(n):
        G += gamma**k * float(row["next", "reward"][k])
        terminated = bool(row["next", "terminated"][k])
        stop = terminated or bool(row["next", "truncated"][k]) or k == n - 1
        if stop:
            if not terminated:
                next_obs = row["next", "observation"][k]
                q_target = learner.target_network(next_obs)
                a = int(learner.q_network(next_obs).argmax()) if double else int(q_target.argmax())
                G += gamma ** (k + 1) * float(q_target[a])
            return G
    raise AssertionError("unreachable")


@pytest.mark.parametrize("double_dqn", [False, True])
def test_n_step_target_equals_a_hand_computed_one(client, double_dqn):
    gamma = 0.9
    client.create_table(TABLES["slices"])
    write_chunk(client, "slices", collect(client))
    batch = client.sample("slices", 16)  # [16, 3]: one episode's consecutive steps per row
    for n in (1, 2, 3):
        config = DQNConfig(gamma=gamma, n_step=n, double_dqn=double_dqn)
        learner = make_learner(client, "slices", config, seed=n)
        with torch.no_grad():
            # Make the online and target networks differ, so that Double DQN matters.
            for p in learner.q_network.parameters():
                p.add_(0.1 * torch.randn_like(p))
            y = learner.target(batch)
            expected = [hand_n_step_target(learner, batch[b], n, gamma) for b in range(16)]
        torch.testing.assert_close(y, torch.tensor(expected))

    # Episode ends inside a slice: a termination stops the sum with no bootstrap, a
    # truncation stops it and bootstraps from its real next observation.
    rewards = torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]]).unsqueeze(-1)
    terminated = torch.zeros(2, 3, 1, dtype=torch.bool)
    truncated = torch.zeros(2, 3, 1, dtype=torch.bool)
    terminated[0, 1] = True
    truncated[1, 0] = True
    next_obs = torch.randn(2, 3, 4)
    handmade = TensorDict(
        {
            "next": {
                "observation": next_obs,
                "reward": rewards,
                "terminated": terminated,
                "truncated": truncated,
            }
        },
        [2, 3],
    )
    learner = make_learner(client, "slices", DQNConfig(gamma=gamma, n_step=3, double_dqn=False))
    with torch.no_grad():
        y = learner.target(handmade)
        bootstrap = float(learner.target_network(next_obs[1, 0]).max())
    torch.testing.assert_close(y, torch.tensor([1.0 + gamma * 2.0, 1.0 + gamma * bootstrap]))


def test_n_step_targets_begin_at_every_step_episode_ends_included(client):
    """With ``strict_length=False`` the last ``n - 1`` steps of an episode begin targets too,
    and each target is the n-step return over the episode's own remaining steps, checked
    against the collected chunk itself (rewards and flags by episode and step)."""
    gamma, n = 0.9, 3
    config = TableConfig.slices("ends", capacity=4096, slice_len=n, seed=2, strict_length=False)
    client.create_table(config)
    chunk = collect(client)
    write_chunk(client, "ends", chunk)
    flat = chunk.reshape(-1)
    record = {
        (e, s): i
        for i, (e, s) in enumerate(
            zip(flat["collector", "traj_ids"].tolist(), flat["collector", "step_count"].tolist())
        )
    }
    learner = make_learner(client, "ends", DQNConfig(gamma=gamma, n_step=n, double_dqn=False))
    starts_at_end = 0
    for _ in range(4):
        batch = client.sample("ends", 256)
        with torch.no_grad():
            y = learner.target(batch)
        for b in range(256):
            ep, step = int(batch["episode_id"][b, 0]), int(batch["step"][b, 0])
            G = 0.0
            for k in range(n):
                row = flat[record[(ep, step + k)]]
                G += gamma**k * float(row["next", "reward"])
                if bool(row["next", "terminated"]):
                    starts_at_end += k == 0
                    break
                nxt = record.get((ep, step + k + 1))
                if bool(row["next", "truncated"]) or k == n - 1 or nxt is None:
                    with torch.no_grad():
                        q = learner.target_network(row["next", "observation"])
                    G += gamma ** (k + 1) * float(q.max())
                    break
            assert abs(float(y[b]) - G) < 1e-4, (ep, step, float(y[b]), G)
    assert starts_at_end > 0, "no target began at an episode's terminal step"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_rate_limiter_paces_the_updates(client, prefetch):
    """With ``samples_per_insert`` the server holds the learner to the stored experience:
    once the error buffer is spent, each inserted step buys ``spi`` sampled steps (with
    prefetched requests too: a request the limiter holds back is not a step)."""
    spi, batch_size = 0.5, 64
    client.create_table(
        TableConfig.uniform("paced", capacity=4096, samples_per_insert=spi, error_buffer=256)
    )
    config = DQNConfig(batch_size=batch_size, sample_timeout_s=0.3, prefetch=prefetch)
    learner = make_learner(client, "paced", config)
    chunk = collect(client)

    def steps_until_blocked() -> int:
        steps = 0
        while True:
            try:
                learner.step()
            except RateLimiterTimeoutError:
                return steps
            steps += 1

    inserted = write_chunk(client, "paced", chunk)
    first = steps_until_blocked()  # the error buffer lets it run ahead: 256 / 64 more steps
    assert first == inserted * spi / batch_size + 256 // batch_size
    inserted = write_chunk(client, "paced", chunk)
    assert steps_until_blocked() == inserted * spi / batch_size
    assert learner.updates == first + inserted * spi / batch_size


def test_n_step_needs_slices_and_priorities_need_a_prioritized_table(client):
    client.create_table(TABLES["uniform"])
    write_chunk(client, "uniform", collect(client))
    learner = make_learner(client, "uniform", DQNConfig(batch_size=8, n_step=3))
    with pytest.raises(InvalidDataError, match="slices"):
        learner.step()
    client.create_table(TABLES["slices"])
    write_chunk(client, "slices", collect(client))
    learner = make_learner(client, "slices", DQNConfig(batch_size=8, n_step=3, prioritized=True))
    with pytest.raises(InvalidDataError, match="prioritized_slices table"):
        learner.step()


def test_prioritized_n_step_targets_weights_and_priorities(client):
    """Prioritized n-step DQN on a prioritized slices table: the batch's targets, its
    importance-weighted loss and the new priorities of each slice's first step, against a
    plain-Python loop over the same sampled batch."""
    gamma, n, eps = 0.9, 3, 1e-3
    table = TABLES["prioritized_slices"]
    client.create_table(table)
    steps = write_chunk(client, table.name, collect(client))
    spy = Spy(client)
    config = DQNConfig(
        batch_size=64, gamma=gamma, n_step=n, prioritized=True, priority_eps=eps, huber=False
    )
    learner = make_learner(spy, table.name, config)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in learner.q_network.parameters():  # online and target differ: Double DQN
            p.add_(0.1 * torch.randn_like(p))
    learner.step()  # new priorities: the next batch is drawn, and weighted, unevenly
    before = DQNLearner(client, table.name, config, copy.deepcopy(learner.q_network))
    before.target_network.load_state_dict(learner.target_network.state_dict())
    metrics = learner.step()
    batch = spy.batches[-1]
    index, priorities = spy.priorities[-1]
    assert batch.shape == (64, n)
    assert torch.equal(index["slot"], batch["index", "slot"][:, 0])
    weights = batch["weight"][:, 0]
    assert weights.unique().numel() > 1 and float(weights.max()) <= 1.0
    assert metrics["priorities_applied"] == 64
    with torch.no_grad():
        y = before.target(batch)
        loss, td_error, _ = before.loss(batch)
        ys, losses, errors = [], 0.0, []
        for b in range(64):
            row = batch[b]
            target = hand_n_step_target(before, row, n, gamma)
            q = float(before.q_network(row["observation"][0])[int(row["action"][0])])
            ys.append(target)
            errors.append(target - q)
            losses += float(row["weight"][0]) * 0.5 * (target - q) ** 2
    torch.testing.assert_close(y, torch.tensor(ys))
    torch.testing.assert_close(td_error, torch.tensor(errors), atol=1e-5, rtol=1e-5)
    assert float(loss) == pytest.approx(losses / 64, rel=1e-5)
    torch.testing.assert_close(priorities.float(), td_error.abs() + eps)

    # Every stored step begins a slice (strict_length=False): the mass is sum_i p_i^alpha
    # over them, the steps never sampled still at priority 1.
    last: dict[int, float] = {}
    for idx, prios in spy.priorities:
        last.update(zip(idx["slot"].tolist(), prios.tolist(), strict=True))
    expected = steps - len(last) + sum(p**table.alpha for p in last.values())
    assert client.info(table.name)["mass"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"gamma": -0.1},
        {"target_update_every": 0},
        {"huber": 1},
        {"lr": 0},
        {"metrics_every": 0},
    ],
)
def test_config_checks_its_values(kwargs):
    with pytest.raises(InvalidConfigError, match=next(iter(kwargs))):
        DQNConfig(**kwargs)


def test_one_step_targets_on_a_uniform_sample_bootstrap_unless_terminated(client):
    """A uniform table marks every sampled row ``("next", "truncated")`` unless it
    terminated (so that TorchRL estimators stop there); the 1-step DQN target must still
    bootstrap on those rows, from their real next observation, and not on terminated ones."""
    gamma = 0.9
    client.create_table(TABLES["uniform"])
    # Episodes of at most 15 steps: the sample holds time-limit truncations and terminations.
    with Collector(
        "CartPole-v1",
        num_envs=4,
        chunk_len=128,
        env_kwargs={"max_episode_steps": 15},
        seed=0,
    ) as collector:
        write_chunk(client, "uniform", collector.collect())
    batch = client.sample("uniform", 512)
    terminated = batch["next", "terminated"].reshape(-1)
    assert terminated.any() and not terminated.all()
    assert batch["next", "truncated"].reshape(-1)[~terminated].all()
    learner = make_learner(client, "uniform", DQNConfig(gamma=gamma, double_dqn=False))
    with torch.no_grad():
        for p in learner.target_network.parameters():
            p.add_(0.1 * torch.randn_like(p))  # a target network whose values are not zero
        y = learner.target(batch)
        bootstrap = learner.target_network(batch["next", "observation"]).max(-1).values
    reward = batch["next", "reward"].reshape(-1)
    expected = reward + gamma * torch.where(terminated, 0.0, bootstrap)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("huber", [False, True])
def test_unweighted_loss_and_its_gradients_are_the_elementwise_mean(client, huber):
    """An unweighted batch's loss (the mean taken by the loss's own op) and the gradients
    it gives the Q-network, against the elementwise loss written out: (y - Q)^2 / 2, or
    Huber's 0.5 d^2 for |d| < 1 and |d| - 0.5 beyond, averaged over the batch."""
    client.create_table(TABLES["uniform"])
    write_chunk(client, "uniform", collect(client))
    batch = client.sample("uniform", 256)
    learner = make_learner(client, "uniform", DQNConfig(huber=huber, double_dqn=False))
    with torch.no_grad():
        for p in learner.target_network.parameters():
            p.add_(0.5 * torch.randn_like(p))  # TD errors on both sides of Huber's 1
    loss, td_error, q_value = learner.loss(batch)
    loss.backward()
    grads = [p.grad.clone() for p in learner.q_network.parameters()]

    reference = copy.deepcopy(learner.q_network)
    reference.zero_grad(set_to_none=True)
    y = learner.target(batch)
    q = reference(batch["observation"]).gather(-1, batch["action"].reshape(-1, 1)).squeeze(-1)
    d = y - q
    if huber:
        assert (d.abs() > 1).any() and (d.abs() < 1).any()
        elementwise = torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5)
    else:
        elementwise = 0.5 * d**2
    expected = elementwise.sum() / len(elementwise)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(td_error, d)
    torch.testing.assert_close(q_value, q)
    for got, want in zip(grads, (p.grad for p in reference.parameters()), strict=True):
        torch.testing.assert_close(got, want)


def test_metrics_every_reports_every_nth_step_and_trains_the_same(client):
    """With ``metrics_every=3`` the statistics come on steps 3, 6, 9, equal to those an
    every-step learner reports on the same batches; the training is unchanged."""
    chunk = collect(client)
    for name in ("every", "third"):
        client.create_table(TableConfig.uniform(name, capacity=4096, seed=1))
        write_chunk(client, name, chunk)
    config = DQNConfig(batch_size=32, lr=1e-2, target_update_every=4)
    every = make_learner(client, "every", config)
    third = make_learner(client, "third", DQNConfig(**{**vars(config), "metrics_every": 3}))
    stats = ("loss", "td_error", "q_value", "sample_age_mean", "sample_age_steps_max")
    for step in range(1, 10):
        want, got = every.step(), third.step()
        assert got["updates"] == want["updates"] == step
        assert got["target_updated"] == want["target_updated"]
        if step % 3:
            assert not set(stats) & set(got)
        else:
            assert {k: got[k] for k in stats} == {k: want[k] for k in stats}
    for p, q in zip(every.q_network.parameters(), third.q_network.parameters(), strict=True):
        assert torch.equal(p, q)
    every.close()
    third.close()
