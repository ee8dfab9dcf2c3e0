"""read_ahead: items made on a thread of their own, one ahead, errors in their place."""

import threading
import time

import pytest

from millpond.learner.client._read_ahead import read_ahead

NAME = "test-read-ahead"


def _alive() -> bool:
    return NAME in {t.name for t in threading.enumerate()}


def test_items_come_in_order_then_the_error_in_its_place():
    def source():
        yield from range(5)
        raise ValueError("the sixth")

    got = []
    with pytest.raises(ValueError, match="the sixth"):
        for item in read_ahead(source(), lambda: None, NAME):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]
    assert not _alive()


def test_at_most_one_item_is_made_ahead_of_the_one_held():
    made = []

    def source():
        for i in range(100):
            made.append(i)
            yield i

    items = read_ahead(source(), lambda: None, NAME)
    assert next(items) == 0
    time.sleep(0.3)
    assert made == [0, 1]  # the next one, made while 0 is held; no more
    assert next(items) == 1
    time.sleep(0.3)
    assert made == [0, 1, 2]
    items.close()
    assert not _alive()


def test_closing_cancels_a_source_that_waits_and_joins_its_thread():
    release = threading.Event()
    closed = threading.Event()

    def source():
        try:
            yield "first"
            release.wait(30)  # a shard that holds the next batch back
            yield "never handed out"
        finally:
            closed.set()

    items = read_ahead(source(), release.set, NAME)
    assert next(items) == "first"
    started = time.monotonic()
    items.close()
    assert time.monotonic() - started < 5
    assert closed.is_set() and not _alive()
