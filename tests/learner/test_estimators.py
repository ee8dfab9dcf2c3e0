"""Value estimators against plain loops, real table batches and TorchRL's estimators."""

import pytest
import torch
from tensordict import TensorDict

from millpond import TableConfig
from millpond.learner.estimators import (
    gae,
    gae_from_batch,
    n_step_return,
    td_lambda_return,
    trajectory_ends,
)
from millpond.testing import CountingDictEnv, chunk_segments, reference_index, rollout

GAMMAS = (0.0, 0.9, 0.99, 1.0)
LAMBDAS = (0.0, 0.5, 0.95, 1.0)


# -- plain-Python references ------------------------------------------------------------


def random_steps(rng, n, dtype=torch.float64):
    """Random rewards and values; each step continues, terminates, truncates or is cut."""
    kind = rng.choice(4, size=n, p=[0.7, 0.1, 0.1, 0.1])  # go on, terminated, truncated, cut
    return {
        "reward": torch.from_numpy(rng.normal(size=n)).to(dtype),
        "value": torch.from_numpy(rng.normal(size=n)).to(dtype),
        "next_value": torch.from_numpy(rng.normal(size=n)).to(dtype),
        "terminated": torch.from_numpy(kind == 1),
        "truncated": torch.from_numpy(kind == 2),
        "ends": torch.from_numpy(kind > 0),
    }


def horizon(t, ends, terminated, truncated):
    """How many steps from t to the end of its trajectory, t included."""
    h = 1
    while not (ends[t + h - 1] or terminated[t + h - 1] or truncated[t + h - 1]):
        if t + h == len(ends):
            break
        h += 1
    return h


def gae_loop(reward, value, next_value, terminated, ends, gamma, lmbda):
    """Forward view: A_t = sum_l (gamma lmbda)^l delta_{t+l} over the rest of the trajectory."""
    r, v, v1, term, end = (x.tolist() for x in (reward, value, next_value, terminated, ends))
    delta = [r[t] + gamma * v1[t] * (1 - term[t]) - v[t] for t in range(len(r))]
    advantage = []
    for t in range(len(r)):
        h = horizon(t, end, term, [False] * len(r))
        advantage.append(sum((gamma * lmbda) ** k * delta[t + k] for k in range(h)))
    return advantage


def n_step_loop(reward, next_value, terminated, truncated, ends, gamma, n):
    """n-step returns and bootstrap discounts, one step at a time."""
    r, v1, term, trunc, end = (
        x.tolist() for x in (reward, next_value, terminated, truncated, ends)
    )
    returns, discounts = [], []
    for t in range(len(r)):
        g, j, m = 0.0, t, 0
        while True:
            g += gamma**m * r[j]
            m += 1
            if m == n or term[j] or trunc[j] or end[j] or j == len(r) - 1:
                break
            j += 1
        discount = 0.0 if term[j] else gamma**m
        returns.append(g + discount * v1[j])
        discounts.append(discount)
    return returns, discounts


def lambda_return_loop(reward, next_value, terminated, ends, gamma, lmbda):
    """Forward view: (1 - lmbda) sum_n lmbda^(n-1) G^(n), the full return taking what is left."""
    no = torch.zeros_like(terminated)
    returns = []
    for t in range(len(reward)):
        h = horizon(t, ends.tolist(), terminated.tolist(), no.tolist())
        g_n = [
            n_step_loop(reward[t:], next_value[t:], terminated[t:], no[t:], ends[t:], gamma, n)[0][
                0
            ]
            for n in range(1, h + 1)
        ]
        returns.append(
            (1 - lmbda) * sum(lmbda ** (n - 1) * g_n[n - 1] for n in range(1, h))
            + lmbda ** (h - 1) * g_n[h - 1]
        )
    return returns


def close(actual, expected, atol=1e-10):
    expected = torch.as_tensor(expected, dtype=actual.dtype).reshape(actual.shape)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# -- GAE and TD(lambda) against the loops ------------------------------------------------


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("lmbda", LAMBDAS)
def test_gae_matches_loop(rng, gamma, lmbda):
    d = random_steps(rng, 150)
    args = (d["reward"], d["value"], d["next_value"], d["terminated"], d["ends"])
    advantage, value_target = gae(*args, gamma, lmbda)
    expected = gae_loop(*args, gamma, lmbda)
    close(advantage, expected)
    close(value_target, torch.tensor(expected, dtype=torch.float64) + d["value"])


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("lmbda", LAMBDAS)
def test_td_lambda_matches_forward_view(rng, gamma, lmbda):
    d = random_steps(rng, 60)
    args = (d["reward"], d["next_value"], d["terminated"], d["ends"])
    close(td_lambda_return(*args, gamma, lmbda), lambda_return_loop(*args, gamma, lmbda))


def test_float32_column_shapes_are_kept(rng):
    d = random_steps(rng, 200, torch.float32)
    col = {k: v[:, None] for k, v in d.items()}
    advantage, value_target = gae(
        col["reward"], col["value"], col["next_value"], col["terminated"], d["ends"], 0.99, 0.95
    )
    assert advantage.shape == value_target.shape == (200, 1)
    assert advantage.dtype == torch.float32
    expected = gae_loop(
        d["reward"], d["value"], d["next_value"], d["terminated"], d["ends"], 0.99, 0.95
    )
    close(advantage, expected, atol=1e-5)
    ret = td_lambda_return(col["reward"], col["next_value"], col["terminated"], d["ends"], 0.9, 0.8)
    assert ret.shape == (200, 1)


@pytest.mark.parametrize(
    ("dtype", "gamma", "lmbda", "atol"),
    [(torch.float64, 0.999, 1.0, 1e-10), (torch.float32, 0.99, 0.95, 1e-5)],
)
def test_long_trajectories(rng, dtype, gamma, lmbda, atol):
    """Hundreds of steps without an end: many doubling steps of the scan (in float32 its
    discount products fall below the smallest normal float, and are flushed)."""
    d = random_steps(rng, 1500)
    ends = torch.zeros(1500, dtype=torch.bool)
    ends[600] = True
    no = torch.zeros(1500, dtype=torch.bool)
    args = [d["reward"], d["value"], d["next_value"]]
    advantage, _ = gae(*(x.to(dtype) for x in args), no, ends, gamma, lmbda)
    close(advantage, gae_loop(*args, no, ends, gamma, lmbda), atol=atol)


def test_a_termination_ends_the_trajectory(rng):
    d = random_steps(rng, 100)
    args = (d["reward"], d["value"], d["next_value"], d["terminated"])
    cuts_only = d["ends"] & ~d["terminated"]
    torch.testing.assert_close(gae(*args, cuts_only, 0.99, 0.95), gae(*args, d["ends"], 0.99, 0.95))


def test_td_lambda_is_gae_value_target_when_values_chain(rng):
    d = random_steps(rng, 100)
    # Inside a trajectory V(s_{t+1}) is the next row's V(s_t).
    value = torch.where(d["ends"].roll(1), d["value"], d["next_value"].roll(1))
    _, value_target = gae(
        d["reward"], value, d["next_value"], d["terminated"], d["ends"], 0.99, 0.9
    )
    ret = td_lambda_return(d["reward"], d["next_value"], d["terminated"], d["ends"], 0.99, 0.9)
    close(ret, value_target)


def test_slices_layout_through_gae(rng):
    """[B, K] with the ends of trajectory_ends (every row ends) is B separate trajectories."""
    b, k = 6, 9
    d = random_steps(rng, b * k)
    ends = d["ends"].reshape(b, k).clone()
    ends[:, -1] = True
    grid = {key: v.reshape(b, k) for key, v in d.items()}
    advantage, _ = gae(
        grid["reward"], grid["value"], grid["next_value"], grid["terminated"], ends, 0.9, 0.7
    )
    assert advantage.shape == (b, k)
    for i in range(b):
        row = [grid[key][i] for key in ("reward", "value", "next_value", "terminated")]
        close(advantage[i], gae_loop(*row, ends[i], 0.9, 0.7))


def test_empty():
    e = torch.zeros(0)
    no = torch.zeros(0, dtype=torch.bool)
    assert gae(e, e, e, no, no, 0.9, 0.9)[0].shape == (0,)
    assert td_lambda_return(e, e, no, no, 0.9, 0.9).shape == (0,)


# -- n-step ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 12])
@pytest.mark.parametrize("gamma", (0.9, 0.99, 1.0))
@pytest.mark.parametrize("column", [False, True])
def test_n_step_on_slices_matches_loop(rng, n, gamma, column):
    b, k = 7, 10
    d = random_steps(rng, b * k)
    grid = {key: v.reshape(b, k, 1) if column else v.reshape(b, k) for key, v in d.items()}
    ret, discount = n_step_return(
        grid["reward"], grid["next_value"], grid["terminated"], grid["truncated"], gamma, n
    )
    assert ret.shape == discount.shape == grid["reward"].shape
    row_end = torch.zeros(k, dtype=torch.bool)
    row_end[-1] = True
    for i in range(b):
        row = [d[key].reshape(b, k)[i] for key in ("reward", "next_value", "terminated")]
        expected, expected_discount = n_step_loop(
            *row, d["truncated"].reshape(b, k)[i], row_end, gamma, n
        )
        close(ret[i], expected)
        close(discount[i], expected_discount)


@pytest.mark.parametrize("column", [False, True])
def test_n_step_on_single_transitions_is_one_step(rng, column):
    d = random_steps(rng, 50)
    shape = (50, 1) if column else (50,)
    r, v1, term, trunc = (
        d[k].reshape(shape) for k in ("reward", "next_value", "terminated", "truncated")
    )
    ret, discount = n_step_return(r, v1, term, trunc, 0.99, n=3)
    close(discount, 0.99 * (~term).double())
    close(ret, r + 0.99 * (~term).double() * v1)


def test_n_step_needs_a_step():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="n"):
        n_step_return(x, x, x.bool(), x.bool(), 0.9, 0)


@pytest.mark.parametrize("n", [1, 2, 4, 50])
def test_n_step_on_a_queue_batch_with_ends(rng, n):
    d = random_steps(rng, 120)
    args = (d["reward"], d["next_value"], d["terminated"], d["truncated"])
    ret, discount = n_step_return(*args, 0.97, n, ends=d["ends"])
    expected, expected_discount = n_step_loop(*args, d["ends"], 0.97, n)
    close(ret, expected)
    close(discount, expected_discount)


def test_n_step_past_the_horizon_is_td1(rng):
    d = random_steps(rng, 80)
    ret, _ = n_step_return(
        d["reward"], d["next_value"], d["terminated"], d["truncated"], 0.95, 80, ends=d["ends"]
    )
    close(ret, td_lambda_return(d["reward"], d["next_value"], d["terminated"], d["ends"], 0.95, 1))


# -- real table batches ------------------------------------------------------------------


def two_lane_segments(rng, steps=150):
    """Rollouts of two envs, chunked, their chunks interleaved as two actors would send them."""
    teds, lanes = [], []
    for lane, offset in enumerate((0, 1000)):
        env = CountingDictEnv(
            pixel_shape=(2, 3), terminate_prob=0.08, min_len=3, max_len=14, episode_offset=offset
        )
        ted = rollout(env, steps, seed=lane, episode_offset=offset)
        teds.append(ted)
        lanes.append(chunk_segments(ted, rng, max_chunk=9))
    order = rng.permutation([0] * len(lanes[0]) + [1] * len(lanes[1]))
    segments = [pair for lane in order for pair in lanes[lane].pop(0)]
    return torch.cat(teds), segments


def expected_ends(segments):
    """From the segments' records: a queue batch's trajectories are its segments, so each
    segment's last step ends one (where an actor's chunk ended too, as in the collector's
    own record)."""
    ends = []
    for _, rec in segments:
        ends += [False] * (rec.length - 1) + [True]
    return torch.tensor(ends)


def continued_cuts(segments) -> list[int]:
    """Rows of the cuts that the next segment of the batch continues (same episode)."""
    rows, row = [], -1
    for i, (_, rec) in enumerate(segments):
        row += rec.length
        nxt = segments[i + 1][1] if i + 1 < len(segments) else None
        if (
            rec.end == "cut"
            and nxt is not None
            and (nxt.episode_id, nxt.first_step) == (rec.episode_id, rec.first_step + rec.length)
        ):
            rows.append(row)
    return rows


@pytest.fixture
def queue_batch(rng, make_table):
    ted, segments = two_lane_segments(rng)
    table = make_table(TableConfig.queue("q", 2000))
    for seg, _ in segments:
        table.insert(seg.steps, seg.tail, seg.episode_id, seg.first_step)
    batch = table.sample(len(ted))
    assert batch.shape == (len(ted),)
    rows = [(r.episode_id, r.first_step + i) for _, r in segments for i in range(r.length)]
    assert list(zip(batch["episode_id"].tolist(), batch["step"].tolist())) == rows
    return ted, segments, batch


def test_trajectory_ends_on_a_queue_batch(queue_batch):
    _, segments, batch = queue_batch
    kinds = [r.end for _, r in segments]
    assert {"terminated", "truncated", "cut"} <= set(kinds)
    expected = expected_ends(segments)
    ends = trajectory_ends(batch)
    assert ends.dtype == torch.bool
    assert ends.tolist() == expected.tolist()
    # A cut that the next segment of the batch continues ends a trajectory all the same:
    # the batch marks it truncated, as the chunk's end was in the collector's record.
    continued = continued_cuts(segments)
    assert continued and all(ends[row] for row in continued)
    assert all(batch["next", "truncated"][row] for row in continued)


def test_trajectory_ends_on_a_slices_batch(rng, make_table):
    _, segments = two_lane_segments(rng)
    table = make_table(TableConfig.slices("s", 2000, slice_len=4, seed=0))
    for seg, _ in segments:
        table.insert(seg.steps, seg.tail, seg.episode_id, seg.first_step)
    batch = table.sample(32)
    ends = trajectory_ends(batch)
    assert ends.shape == (32, 4)
    expected = batch["next", "done"].squeeze(-1).clone()
    expected[:, -1] = True
    assert ends.tolist() == expected.tolist()


def critic(obs):
    """A fixed value function of both observation keys, in float64."""
    state = obs["observation", "state"].double()
    pixels = obs["observation", "pixels"].double().flatten(1)
    return (state * torch.linspace(-0.5, 0.5, 8, dtype=torch.float64)).sum(
        -1, keepdim=True
    ) + pixels.mean(-1, keepdim=True) / 100


def test_gae_from_batch_matches_gae_on_every_next_observation(queue_batch):
    _, segments, batch = queue_batch
    advantage, value_target = gae_from_batch(batch, critic, 0.99, 0.95)
    assert advantage.shape == (len(batch), 1)
    value, next_value = critic(batch), critic(batch["next"])
    expected, _ = gae(
        batch["next", "reward"],
        value,
        next_value,
        batch["next", "terminated"],
        expected_ends(segments),
        0.99,
        0.95,
    )
    close(advantage, expected)
    close(value_target, expected + value)
    assert torch.equal(batch["advantage"], advantage)
    assert torch.equal(batch["value_target"], value_target)
    close(batch["state_value"], value)


def test_gae_from_batch_critic_kinds(queue_batch):
    from tensordict.nn import TensorDictModule

    _, _, batch = queue_batch
    calls = []

    def counting_critic(obs):
        calls.append((len(obs), torch.is_grad_enabled()))
        return critic(obs)

    advantage, _ = gae_from_batch(batch, counting_critic, 0.9, 0.8)
    # One call, without gradients: every row, plus the next observation where one ends.
    assert calls == [(len(batch) + int(trajectory_ends(batch).sum()), False)]
    module = TensorDictModule(
        lambda state, pixels: critic(
            TensorDict({"observation": {"state": state, "pixels": pixels}}, [len(state)])
        ),
        in_keys=[("observation", "state"), ("observation", "pixels")],
        out_keys=["state_value"],
    )
    close(gae_from_batch(batch, module, 0.9, 0.8)[0], advantage)
    w = torch.linspace(-0.5, 0.5, 8, dtype=torch.float64)
    on_state = gae_from_batch(
        batch,
        lambda s: (s.double() * w).sum(-1, keepdim=True),
        0.9,
        0.8,
        obs_key=("observation", "state"),
    )[0]
    value = (batch["observation", "state"].double() * w).sum(-1, keepdim=True)
    next_value = (batch["next", "observation", "state"].double() * w).sum(-1, keepdim=True)
    expected, _ = gae(
        batch["next", "reward"],
        value,
        next_value,
        batch["next", "terminated"],
        trajectory_ends(batch),
        0.9,
        0.8,
    )
    close(on_state, expected)


# -- TorchRL ---------------------------------------------------------------------------


@pytest.mark.parametrize(("gamma", "lmbda"), [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0), (0.97, 0.3)])
def test_torchrl_functionals_on_uncompacted_ted(rng, gamma, lmbda):
    functional = pytest.importorskip("torchrl.objectives.value.functional")
    d = random_steps(rng, 300, torch.float32)
    col = {k: v[:, None] for k, v in d.items()}
    # TorchRL marks the cut as a truncation: done, not terminated.
    done = col["terminated"] | col["truncated"] | col["ends"]
    ours, ours_target = gae(
        d["reward"], d["value"], d["next_value"], d["terminated"], d["ends"], gamma, lmbda
    )
    ret = td_lambda_return(d["reward"], d["next_value"], d["terminated"], d["ends"], gamma, lmbda)
    for estimate in (
        functional.generalized_advantage_estimate,
        functional.vec_generalized_advantage_estimate,
    ):
        theirs, theirs_target = estimate(
            gamma,
            lmbda,
            col["value"],
            col["next_value"],
            col["reward"],
            done,
            col["terminated"],
            time_dim=0,
        )
        close(ours, theirs, atol=1e-5)
        close(ours_target, theirs_target, atol=1e-5)
    for estimate in (
        functional.td_lambda_return_estimate,
        functional.vec_td_lambda_return_estimate,
    ):
        theirs = estimate(
            gamma, lmbda, col["next_value"], col["reward"], done, col["terminated"], time_dim=0
        )
        close(ret, theirs, atol=1e-5)


def test_torchrl_gae_on_the_rollout_the_queue_batch_came_from(queue_batch):
    """The real table batch against TorchRL's GAE on the original, uncompacted rollout."""
    value_module = pytest.importorskip("torchrl.objectives.value")
    ted, segments, batch = queue_batch
    index = reference_index(ted)
    rows = [index[k] for k in zip(batch["episode_id"].tolist(), batch["step"].tolist())]
    td = ted[torch.tensor(rows)].clone()
    # Cuts are truncations to TorchRL: done without terminated.
    td["next", "done"] = td["next", "done"] | expected_ends(segments)[:, None]
    assert (td["next", "done"] & ~td["next", "terminated"] & ~td["next", "truncated"]).any()
    td["state_value"] = critic(td)
    td["next", "state_value"] = critic(td["next"])
    # gamma and lmbda exact in float32, the dtype TorchRL keeps them in.
    gamma, lmbda = 0.96875, 0.9375
    value_module.GAE(gamma=gamma, lmbda=lmbda, value_network=None)(td, time_dim=0)

    advantage, value_target = gae_from_batch(batch, critic, gamma, lmbda)
    close(advantage, td["advantage"], atol=1e-5)
    close(value_target, td["value_target"], atol=1e-5)
