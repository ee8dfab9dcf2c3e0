"""Round trips through real servers: what writers send comes back bit for bit, every table kind.

Data are rollouts of CartPole (15-step limit: terminations and truncations) and of a
dict-observation env with uint8 pixels, cut into chunks as actors cut them (so segments end
at terminations, truncations and chunk cuts), written by several pinned writers that cover
every shard. Each sampled row is looked up by ``(episode_id, step)`` in the recorded rollout
and compared key by key, ``("next", obs)`` included.
"""

import numpy as np
import pytest
import torch

from millpond import DeadlineExceededError, TableConfig
from millpond.routing import writer_hash

ENV_NAMES = ["cartpole", "dict"]


def fill(ctx, client, server, table, env_name, *, steps=80, per_shard=2):
    """Record one rollout per writer (writers covering every shard), write them; return the
    reference and the writer ids."""
    exp = ctx["make_experience"]()
    wids = ctx["covering_writer_ids"](table, server.shards, per_shard)
    for k, _ in enumerate(wids):
        env = ctx["envs"][env_name](episode_offset=1000 * k)
        exp.add_rollout(env, steps, seed=k, episode_offset=1000 * k, rng=ctx["rng"])
    assert {r.end for r in exp.records()} == {"terminated", "truncated", "cut"}
    ctx["write"](client, table, exp, wids)
    info = client.info(table)
    assert info["size"] == exp.num_steps
    assert [s["size"] > 0 for s in info["shards"]] == [True] * server.shards
    return exp, wids


@pytest.fixture
def ctx(make_experience, covering_writer_ids, envs, write, rng):
    return {
        "make_experience": make_experience,
        "covering_writer_ids": covering_writer_ids,
        "envs": envs,
        "write": write,
        "rng": rng,
    }


def sample_until_all_seen(client, table, exp, batch_size=256, **check):
    """Sample until every written step came back once at least; returns the last batch."""
    seen: set = set()
    shards: set = set()
    for _ in range(exp.batches_to_cover(batch_size)):
        batch = client.sample(table, batch_size)
        assert batch.batch_size == torch.Size([batch_size])
        seen.update(exp.check(batch, **check))
        shards.update(batch["index", "shard"].tolist())
        if len(seen) == exp.num_steps:
            break
    assert seen == set(exp.index), f"{exp.num_steps - len(seen)} steps never sampled"
    return batch, shards


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_uniform(client, server, table_name, ctx, env_name):
    client.create_table(TableConfig.uniform(table_name, capacity=5_000, seed=1))
    exp, _ = fill(ctx, client, server, table_name, env_name)
    _, shards = sample_until_all_seen(client, table_name, exp)
    assert shards == set(range(server.shards))


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_zstd_compressed_table(client, server, table_name, ctx, env_name):
    config = TableConfig.uniform(table_name, capacity=5_000, compression="zstd", seed=2)
    assert client.create_table(config).compression == "zstd"
    exp, _ = fill(ctx, client, server, table_name, env_name)
    sample_until_all_seen(client, table_name, exp)


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_queue_drains_each_step_once_in_fifo_order_per_shard(
    client, server, table_name, ctx, env_name
):
    client.create_table(TableConfig.queue(table_name, capacity=5_000))
    exp, wids = fill(ctx, client, server, table_name, env_name)
    # Writers ran one after another, so each shard's order is its writers' rows in turn.
    expected: dict[int, list] = {s: [] for s in range(server.shards)}
    for wid, ted in zip(wids, exp.teds, strict=True):
        keys = list(zip(ted["collector", "traj_ids"].tolist(), ted["step_count"].tolist()))
        expected[writer_hash(wid) % server.shards] += keys
    delivered: dict[int, list] = {s: [] for s in range(server.shards)}
    remaining = exp.num_steps
    while remaining:
        batch = client.sample(table_name, min(40, remaining), timeout_s=10)
        keys = exp.check(batch, stops="segment")
        for shard, key in zip(batch["index", "shard"].tolist(), keys, strict=True):
            delivered[shard].append(key)
        remaining -= len(keys)
        assert remaining >= 0
    assert delivered == expected
    assert client.info(table_name)["size"] == 0
    with pytest.raises(DeadlineExceededError):
        client.sample(table_name, 1, timeout_s=0.3)


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_slices_are_consecutive_steps_of_one_episode(client, server, table_name, ctx, env_name):
    k = 4
    client.create_table(TableConfig.slices(table_name, capacity=5_000, slice_len=k, seed=3))
    exp, _ = fill(ctx, client, server, table_name, env_name)
    # Every start of k steps inside one episode can be drawn, across chunk cuts too.
    lengths: dict[int, int] = {}
    for ep, step in exp.index:
        lengths[ep] = max(lengths.get(ep, 0), step + 1)
    starts = {(ep, s) for ep, n in lengths.items() for s in range(n - k + 1)}
    cut_ends = {
        (r.episode_id, r.first_step + r.length - 1) for r in exp.records() if r.end == "cut"
    }
    seen_starts: set = set()
    crossed_cut = False
    for _ in range(60):
        batch = client.sample(table_name, 128)
        assert batch.batch_size == torch.Size([128, k])
        exp.check(batch)
        eps, steps = batch["episode_id"], batch["step"]
        assert bool((eps == eps[:, :1]).all()), "a slice mixes episodes"
        assert bool((steps == steps[:, :1] + torch.arange(k)).all()), "a slice skips steps"
        for ep, s in zip(eps[:, 0].tolist(), steps[:, 0].tolist(), strict=True):
            seen_starts.add((ep, s))
            crossed_cut |= any((ep, s + i) in cut_ends for i in range(k - 1))
        if seen_starts == starts and crossed_cut:
            break
    assert seen_starts == starts
    assert crossed_cut, "no slice ran across a chunk cut"


def test_prioritized_weights_routing_and_stale_indexes(client, server, table_name, ctx):
    alpha, beta = 1.0, 0.5
    config = TableConfig.prioritized(table_name, capacity=5_000, alpha=alpha, beta=beta, seed=4)
    client.create_table(config)
    exp, _ = fill(ctx, client, server, table_name, "dict")

    # Sample every step once at least, keeping each one's index (slot, generation, shard).
    index: dict = {}
    for _ in range(60):
        batch = client.sample(table_name, 256)
        keys = exp.check(batch, weights=True)
        assert bool((batch["weight"] == 1).all())  # equal priorities: equal weights
        for i, key in enumerate(keys):
            index[key] = batch["index"][i]
        if len(index) == exp.num_steps:
            break
    assert len(index) == exp.num_steps
    keys = sorted(index)
    stacked = torch.stack([index[key] for key in keys])
    assert set(stacked["shard"].tolist()) == set(range(server.shards))

    # Priority 0 for most steps, 1 or 4 for a chosen third: only the chosen come back, and
    # their weights follow (p / min p on the shard) ** (-alpha * beta).
    rng = np.random.default_rng(5)
    chosen = rng.random(len(keys)) < 1 / 3
    prio = np.where(chosen, np.where(rng.random(len(keys)) < 0.5, 1.0, 4.0), 0.0)
    applied = client.update_priorities(table_name, stacked, torch.as_tensor(prio))
    assert applied == len(keys)
    priority = dict(zip(keys, prio.tolist(), strict=True))
    shard_of = dict(zip(keys, stacked["shard"].tolist(), strict=True))
    min_on_shard = {}
    for key, p in priority.items():
        if p > 0:
            s = shard_of[key]
            min_on_shard[s] = min(min_on_shard.get(s, np.inf), p)
    heavy = draws = 0
    for _ in range(12):
        batch = client.sample(table_name, 256)
        got = exp.check(batch, weights=True)
        p = np.array([priority[key] for key in got])
        assert (p > 0).all(), "a step of priority 0 was sampled"
        assert batch["index", "shard"].tolist() == [shard_of[key] for key in got]
        s_min = np.array([min_on_shard[shard_of[key]] for key in got])
        expected_w = (p / s_min) ** (-alpha * beta)
        np.testing.assert_allclose(batch["weight"].numpy(), expected_w, rtol=1e-5)
        heavy += int((p == 4).sum())
        draws += len(p)
    # Shards split the batch by total priority, so P(heavy) is the global share.
    share = 4 * (prio == 4).sum() / prio.sum()
    sigma = np.sqrt(share * (1 - share) / draws)
    assert abs(heavy / draws - share) < 5 * sigma + 0.01

    # After a reset and new data in the same slots, the old indexes are stale: ignored.
    client.reset(table_name)
    assert client.info(table_name)["size"] == 0
    wids = ctx["covering_writer_ids"](f"{table_name}-again", server.shards, 2)
    ctx["write"](client, table_name, exp, wids)
    assert client.update_priorities(table_name, stacked, torch.zeros(len(keys))) == 0
    batch = client.sample(table_name, 256)
    exp.check(batch, weights=True)
    assert bool((batch["weight"] == 1).all())  # nothing changed the new steps' priorities
    assert client.update_priorities(table_name, batch["index"], torch.ones(256)) == 256


def test_update_priorities_accepts_index_mapping_and_any_shape(client, server, table_name, ctx):
    client.create_table(TableConfig.prioritized(table_name, capacity=5_000, seed=6))
    exp, _ = fill(ctx, client, server, table_name, "cartpole", steps=40, per_shard=1)
    batch = client.sample(table_name, 64)
    exp.check(batch, weights=True)
    index = {k: batch["index", k].numpy() for k in ("slot", "generation", "shard")}
    assert client.update_priorities(table_name, index, np.full((8, 8), 2.0)) == 64


def test_a_queue_gives_each_step_to_one_of_several_learners(client, server, table_name, ctx):
    """Data-parallel learners sample one queue at once, each with a client of its own: every
    step reaches exactly one of them."""
    import threading

    from millpond import ReplayClient

    client.create_table(TableConfig.queue(table_name, capacity=5_000))
    exp, _ = fill(ctx, client, server, table_name, "cartpole")
    delivered: list[list] = [[], []]
    errors: list[BaseException] = []

    def learner(rank: int) -> None:
        own = ReplayClient(server.address, timeout_s=30)
        try:
            while True:
                try:
                    batch = own.sample(table_name, 16, timeout_s=0.3)
                except DeadlineExceededError:  # fewer steps left than a batch
                    return
                exp.check(batch, stops="segment")  # each row is a written step, exactly
                rows = zip(batch["index", "shard"].tolist(), batch["index", "slot"].tolist())
                delivered[rank] += list(rows)
        except BaseException as e:
            errors.append(e)
        finally:
            own.close()

    threads = [threading.Thread(target=learner, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    both = delivered[0] + delivered[1]
    for _ in range(10):  # what no 16-step batch could take (a batch holds whole segments)
        left = client.info(table_name)["size"]
        if not left:
            break
        rest = client.sample(table_name, left, timeout_s=10)
        both += list(zip(rest["index", "shard"].tolist(), rest["index", "slot"].tolist()))
    assert len(both) == len(set(both))  # no step reached two learners
    # and none was lost: with several shards, a sample that times out on one shard after
    # others answered returns what they delivered (a short batch), not nothing
    assert len(both) == exp.num_steps
