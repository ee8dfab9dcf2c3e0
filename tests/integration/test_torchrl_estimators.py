"""TorchRL's value estimators, run unchanged on what the service returns, equal the reference.

The reference is the collector's own uncompacted record: a real TorchRL ``Collector`` steps
three CartPole lanes (a 15-step limit, so episodes are truncated as well as terminated) in
batches of ``[3, 20]``; trajectories run on from one batch into the next. The batches go
through ``ReplayClient.extend`` into a table; what the table returns goes through TorchRL's
``GAE``, ``TD1``, ``TDLambda`` and ``TD0`` exactly as a TorchRL user would call them, and
every row must match its row of the record:

- queue batches (whole segments) against the estimator on each collector batch, where a
  lane's time axis ends with the batch, as it does in TorchRL's own on-policy loop;
- uniform transitions against TD(0) on the record (a transition stands alone);
- slices ``[B, K]`` against a plain-Python GAE over the same ``K`` consecutive steps of
  the record, stopped after the last one (TorchRL's ``SliceSampler`` convention).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule

from millpond import ReplayClient, TableConfig

torchrl = pytest.importorskip("torchrl")
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv  # noqa: E402
from torchrl.objectives.value import GAE, TD0Estimator, TD1Estimator, TDLambdaEstimator  # noqa: E402

LANES, TIME, BATCHES = 3, 20, 3
GAMMA, LMBDA = 0.97, 0.9


def collector_batches(seed: int) -> list[TensorDictBase]:
    env = TransformedEnv(
        SerialEnv(LANES, lambda: GymEnv("CartPole-v1", max_episode_steps=15)), StepCounter()
    )
    env.set_seed(seed)
    collector = Collector(
        env, policy=None, frames_per_batch=LANES * TIME, total_frames=LANES * TIME * BATCHES
    )
    try:
        return [td.clone() for td in collector]
    finally:
        collector.shutdown()


@pytest.fixture(scope="module")
def record() -> list[TensorDictBase]:
    batches = collector_batches(seed=3)
    flags = torch.cat(batches, -1)["next"]
    assert flags["terminated"].any() and flags["truncated"].any()
    return batches


@pytest.fixture(scope="module")
def value_net() -> TensorDictModule:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["state_value"])


def estimators(value_net: TensorDictModule) -> dict[str, object]:
    return {
        "GAE": GAE(gamma=GAMMA, lmbda=LMBDA, value_network=value_net),
        "TD1": TD1Estimator(gamma=GAMMA, value_network=value_net),
        "TDLambda": TDLambdaEstimator(gamma=GAMMA, lmbda=LMBDA, value_network=value_net),
        "TD0": TD0Estimator(gamma=GAMMA, value_network=value_net),
    }


def row_key(td: TensorDictBase) -> list[bytes]:
    """Each row's identity: its observation, next observation and action, as bytes."""
    flat = td.reshape(-1)
    parts = [flat["observation"], flat["next", "observation"], flat["action"].float()]
    rows = torch.cat([p.reshape(len(flat), -1).float() for p in parts], -1)
    return [r.numpy().tobytes() for r in rows]


def targets(estimator, td: TensorDictBase) -> torch.Tensor:
    with torch.no_grad():
        out = estimator(td.clone())
    return out["value_target"].reshape(-1)


def by_row(td: TensorDictBase, values: torch.Tensor) -> dict[bytes, float]:
    return dict(zip(row_key(td), values.tolist()))


def test_the_record_rows_are_distinct(record) -> None:
    keys = row_key(torch.cat(record, -1))
    assert len(set(keys)) == len(keys), "rows must be told apart by their bytes"


@pytest.mark.parametrize("name", ["GAE", "TD1", "TDLambda", "TD0"])
def test_estimators_on_queue_batches_equal_the_collector_record(
    client: ReplayClient, table_name: str, record, value_net, name
) -> None:
    estimator = estimators(value_net)[name]
    client.create_table(TableConfig.queue(table_name, capacity=1_000))
    expected: dict[bytes, float] = {}
    for batch in record:
        expected.update(by_row(batch, targets(estimator, batch)))
        client.extend(table_name, batch)
    got: dict[bytes, float] = {}
    while size := client.info(table_name)["size"]:
        # Whole segments, several lanes' in one batch.
        sample = client.sample(table_name, min(2 * TIME, size))
        got.update(by_row(sample, targets(estimator, sample)))
    assert got.keys() == expected.keys()
    wrong = [k for k in got if abs(got[k] - expected[k]) > 1e-4]
    assert not wrong, f"{len(wrong)} of {len(got)} rows differ from the record"


@pytest.mark.parametrize("name", ["GAE", "TD1", "TDLambda", "TD0"])
def test_estimators_on_uniform_transitions_are_one_step_targets(
    client: ReplayClient, table_name: str, record, value_net, name
) -> None:
    client.create_table(TableConfig.uniform(table_name, capacity=1_000, seed=1))
    td0 = estimators(value_net)["TD0"]
    expected: dict[bytes, float] = {}
    for batch in record:
        expected.update(by_row(batch, targets(td0, batch)))
        client.extend(table_name, batch)
    sample = client.sample(table_name, 256)
    keys, values = row_key(sample), targets(estimators(value_net)[name], sample).tolist()
    assert set(keys) <= expected.keys()
    wrong = [k for k, v in zip(keys, values) if abs(v - expected[k]) > 1e-4]
    assert not wrong, f"{len(wrong)} of {len(keys)} transitions differ from TD(0) on the record"


def plain_gae_targets(rows: TensorDictBase, value_net) -> list[float]:
    """GAE value targets over consecutive steps, the window stopped after its last row."""
    with torch.no_grad():
        v = value_net(rows.clone())["state_value"].reshape(-1).tolist()
        nxt = value_net(rows["next"].clone())["state_value"].reshape(-1).tolist()
    reward = rows["next", "reward"].reshape(-1).tolist()
    terminated = rows["next", "terminated"].reshape(-1).tolist()
    done = rows["next", "done"].reshape(-1).tolist()
    advantage, out = 0.0, [0.0] * len(v)
    for t in reversed(range(len(v))):
        last = t == len(v) - 1 or done[t]
        delta = reward[t] + GAMMA * nxt[t] * (1 - terminated[t]) - v[t]
        advantage = delta + (0.0 if last else GAMMA * LMBDA * advantage)
        out[t] = advantage + v[t]
    return out


def test_gae_on_slices_equals_gae_over_the_same_record_steps(
    client: ReplayClient, table_name: str, record, value_net
) -> None:
    k = 6
    client.create_table(TableConfig.slices(table_name, capacity=1_000, slice_len=k, seed=2))
    for batch in record:
        client.extend(table_name, batch)
    lanes = torch.cat(record, -1)  # [3, 60]: each lane's steps in order, across batches
    where = {key: i for i, key in enumerate(row_key(lanes))}
    flat = lanes.reshape(-1)
    sample = client.sample(table_name, 32)
    assert sample.batch_size == (32, k)
    got = targets(estimators(value_net)["GAE"], sample).reshape(32, k)
    for b in range(32):
        rows = [where[key] for key in row_key(sample[b])]
        assert rows == list(range(rows[0], rows[0] + k)), "a slice is not consecutive steps"
        expected = plain_gae_targets(flat[rows[0] : rows[0] + k], value_net)
        assert torch.allclose(got[b], torch.tensor(expected), atol=1e-4), f"slice {b}"
