"""A one-shard learner iterating over the wire, against a real server on loopback: its
batches come on one stream at a time, ``prefetch`` per Sample call, the next call opened
once the last answer of one has arrived, so that one answer transfers at a time (answers
of calls in flight together share the connection and land in bursts).

The batches are checked against ``sample`` calls one after another on a same-seeded table
(the shard draws them in the same order), and the calls' requests and answers are logged
as the client makes and receives them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.learner.client._shards import ShardHandle
from millpond.testing import pattern_segment

OBS = (6, 10)


def _fill(client: ReplayClient, table: str) -> None:
    with client.writer(table, f"{table}-writer") as w:
        w.write_segments([pattern_segment(e, 3 * e, 9 + e % 4, OBS) for e in range(30)])


class _LoggedCall:
    """A Sample call whose answers are logged, in the order the client receives them."""

    def __init__(self, call, number: int, log: list) -> None:
        self._call, self._number, self._log = call, number, log

    def __iter__(self):
        return self

    def __next__(self):
        answer = next(self._call)
        self._log.append(("answer", self._number))
        return answer

    def __getattr__(self, name: str):
        return getattr(self._call, name)


@pytest.fixture
def logged_calls(monkeypatch) -> list:
    """Every wire Sample call of the test: ``("open", n, request)`` and ``("answer", n)``."""
    log: list = []
    lock = threading.Lock()
    real = ShardHandle.raw_sample

    def raw_sample(self):
        multicallable = real.fget(self)

        def call(request, **kwargs):
            with lock:
                number = sum(1 for event in log if event[0] == "open")
                log.append(("open", number, request))
            return _LoggedCall(multicallable(request, **kwargs), number, log)

        return call

    monkeypatch.setattr(ShardHandle, "raw_sample", property(raw_sample))
    return log


@pytest.mark.parametrize("prefetch", [1, 3])
def test_one_answer_transfers_at_a_time(server1, table_name, logged_calls, prefetch):
    """Each call asks ``prefetch`` batches, and the next opens only after the last answer
    of the one before arrived: never two calls' answers on the wire together."""
    with ReplayClient(server1.address, colocated=False) as client:
        client.create_table(TableConfig.uniform(table_name, capacity=2_000, seed=5))
        _fill(client, table_name)
        logged_calls.clear()
        stream = client.iterate(table_name, 16, prefetch=prefetch)
        for _ in range(3 * prefetch):
            assert next(stream).shape == (16,)
        stream.close()
    opened = [event for event in logged_calls if event[0] == "open"]
    # The fourth opens as the third's last batch arrives, before it is handed out; the one
    # batch made ahead of the consumer is the fourth call's last with prefetch 1 (a fifth).
    assert 4 <= len(opened) <= 4 + (prefetch == 1), opened
    for _, _, request in opened:
        assert (request.batch_size, request.num_batches) == (16, prefetch)
        assert not request.colocated
    for _, number, _ in opened[1:]:
        before = logged_calls[: logged_calls.index(opened[number])]
        # everything the call before it was asked for had arrived when it opened
        assert before.count(("answer", number - 1)) == prefetch, logged_calls
        assert ("answer", number) not in before


@pytest.mark.parametrize("kind", ["uniform", "prioritized"])
def test_batches_come_in_the_order_the_shard_draws_them(server1, table_name, kind):
    """The iterator's batches are the batches of ``sample`` calls one after another on a
    same-seeded table, in the same order."""
    configs = {"uniform": TableConfig.uniform, "prioritized": TableConfig.prioritized}
    batches = {}
    with ReplayClient(server1.address, colocated=False) as client:
        for mode in ("iterate", "sample"):
            name = f"{table_name}-{mode}"
            client.create_table(configs[kind](name, capacity=2_000, seed=21))
            _fill(client, name)
            if mode == "iterate":
                stream = client.iterate(name, 16, prefetch=3)
                batches[mode] = [next(stream) for _ in range(7)]
                stream.close()
                assert "millpond-read-ahead" not in {t.name for t in threading.enumerate()}
                steps = batches[mode][0].numel()
                # 7 delivered; at most the rest of the last call and the whole next drawn
                assert 7 * steps <= client.info(name)["samples"] <= 4 * 3 * steps
            else:
                batches[mode] = [client.sample(name, 16) for _ in range(7)]
    for i, (got, expected) in enumerate(zip(batches["iterate"], batches["sample"], strict=True)):
        keys = set(expected.keys(True, True))
        assert keys == set(got.keys(True, True)), i
        for key in keys:
            assert torch.equal(got[key], expected[key]), (i, key)
