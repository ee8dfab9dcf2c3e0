"""The rate limiter as pure logic: Reverb's min-size and samples-per-insert semantics."""

import numpy as np
import pytest

from millpond.errors import InvalidConfigError
from millpond.service.rate_limiter import RateLimiter


def test_min_size_only():
    r = RateLimiter(min_size=10)
    assert r.can_insert(size=0)
    assert not r.can_sample(size=9)
    assert r.can_sample(size=10)
    r.on_sample(1000)  # no ratio: samples never block inserts
    assert r.can_insert(size=10)


def test_min_size_zero_still_needs_one_step():
    r = RateLimiter(min_size=0)
    assert not r.can_sample(size=0)
    assert r.can_sample(size=1)


def test_samples_per_insert_bounds():
    # spi 2, min_size 10, error buffer 5: diff must stay within [15, 25].
    r = RateLimiter(min_size=10, samples_per_insert=2.0, error_buffer=5.0)
    assert (r.min_diff, r.max_diff) == (15.0, 25.0)
    r.on_insert(10)  # diff 20
    assert r.can_sample(size=10)
    r.on_insert(3)  # diff 26 > 25: inserts blocked until learners sample
    assert not r.can_insert(size=13)
    r.on_sample(2)  # diff 24
    assert r.can_insert(size=13)
    r.on_sample(9)  # diff 15: still allowed to sample (checked before the batch)
    assert r.can_sample(size=13)
    r.on_sample(1)  # diff 14 < 15: samples blocked until actors insert
    assert not r.can_sample(size=13)
    assert r.can_insert(size=13)


def test_inserts_below_min_size_always_proceed():
    r = RateLimiter(min_size=100, samples_per_insert=1.0, error_buffer=1.0)
    r.on_insert(99)
    assert r.can_insert(size=99)


def test_a_table_that_shrank_below_min_size_takes_inserts_whatever_the_ratio():
    # The table reached min_size, actors ran ahead of the ratio, then evictions freed more
    # than inserts added (writer regions set aside, a queue's deliveries): no sample can
    # proceed below min_size, so an insert must, or both sides wait for good.
    r = RateLimiter(min_size=100, samples_per_insert=10.0, error_buffer=50.0)
    r.on_insert(120)  # diff 1200 > max_diff 1050: learners are behind
    assert not r.can_insert(size=120)
    assert not r.can_sample(size=90)
    assert r.can_insert(size=90)
    assert r.why_insert_waits(size=90) is None
    assert r.can_insert(size=99) and not r.can_insert(size=100)


def test_no_deadlock_with_batches_larger_than_the_buffer():
    # Whatever the counts, at least one side can always move.
    r = RateLimiter(min_size=1, samples_per_insert=0.5, error_buffer=0.0)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        assert r.can_insert(size=10**6) or r.can_sample(size=10**6)
        if r.can_insert(size=10**6) and rng.random() < 0.5:
            r.on_insert(int(rng.integers(1, 500)))
        elif r.can_sample(size=10**6):
            r.on_sample(256)


def test_one_side_can_always_move_whatever_the_table_holds():
    # Sizes that fall as well as rise (evictions), against every limiter state reached.
    rng = np.random.default_rng(2)
    for min_size, spi, e in [(100, 10.0, 50.0), (1, 0.5, 0.0), (9000, 12.8, 4000.0)]:
        r = RateLimiter(min_size=min_size, samples_per_insert=spi, error_buffer=e)
        size = 0
        for _ in range(3000):
            assert r.can_insert(size) or r.can_sample(size), (r.describe(), size)
            if r.can_insert(size) and rng.random() < 0.5:
                n = int(rng.integers(1, 300))
                r.on_insert(n)
                size = max(0, size + n - int(rng.integers(0, 2 * n)))  # evictions too
            elif r.can_sample(size):
                r.on_sample(int(rng.integers(1, 300)))


def test_long_run_ratio_follows_target():
    r = RateLimiter(min_size=100, samples_per_insert=4.0, error_buffer=256.0)
    rng = np.random.default_rng(1)
    for _ in range(20000):
        if rng.random() < 0.5 and r.can_insert(size=10**6):
            r.on_insert(10)
        elif r.can_sample(size=10**6):
            r.on_sample(32)
    assert r.inserts > 1000
    assert abs(r.samples / r.inserts - 4.0) < 0.1


def test_counters_live_in_the_given_array():
    backing = np.zeros(2, dtype=np.int64)
    r = RateLimiter(counters=backing)
    r.on_insert(5)
    r.on_sample(3)
    assert backing.tolist() == [5, 3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_size": -1},
        {"samples_per_insert": 0.0, "error_buffer": 1.0},
        {"samples_per_insert": 1.0},
        {"samples_per_insert": 1.0, "error_buffer": -1.0},
    ],
)
def test_bad_config(kwargs):
    with pytest.raises(InvalidConfigError):
        RateLimiter(**kwargs)


def test_uncounted_redraws_are_bounded_by_the_steps_dropped(make_table):
    """Redraws (rows a colocated reader found overwritten) are not counted, but only as far
    as steps were dropped since: asking for "redraws" of a table that overwrote nothing is
    sampling, held back by the rate limiter like any sample."""
    from millpond import TableConfig
    from millpond.errors import RateLimiterTimeoutError
    from millpond.testing import constant_segment

    config = TableConfig.uniform(
        "limited", 40, min_size=1, samples_per_insert=1.0, error_buffer=8.0
    )
    table = make_table(config)
    for episode in range(2):  # 16 steps in 18 slots: nothing evicted
        table.insert(*constant_segment(episode, length=8), episode_id=episode)
    before = table.info()["samples"]
    with pytest.raises(RateLimiterTimeoutError):
        for _ in range(50):  # without a bound: uncounted and never held back, for ever
            table.sample_colocated(4, timeout=0.2, counted=False)
    assert table.info()["samples"] > before  # counted as the samples they were
    for episode in range(2, 6):  # the ring wraps: the first segments are evicted
        table.insert(*constant_segment(episode, length=8), episode_id=episode, timeout=5)
        table.sample(8, timeout=5)  # keeps inserts going
    counted = table.info()["samples"]
    table.sample_colocated(4, timeout=0.2, counted=False)  # a real redraw: evicted rows
    assert table.info()["samples"] == counted


def test_what_each_side_waits_for_is_said_in_steps():
    r = RateLimiter(min_size=10, samples_per_insert=8.0, error_buffer=16.0)
    assert r.why_sample_waits(size=4) == "6 more steps needed before sampling (min_size 10)"
    r.on_insert(10)  # diff 80 in [64, 96]
    assert r.why_sample_waits(size=10) is None and r.why_insert_waits(size=10) is None
    r.on_sample(40)  # diff 40: 24 below the lower bound, 3 inserted steps at 8 each
    assert r.why_sample_waits(size=10) == "3 more inserted steps needed at samples_per_insert 8"
    r.on_insert(10)  # diff 120: 24 above the upper bound
    assert r.why_insert_waits(size=20) == "24 more sampled steps needed at samples_per_insert 8"
