"""The weight store's bounded staleness: a publication with ``max_lag`` waits for the actors
acting with older weights, never for actors that are writing, nor for one gone silent."""

from __future__ import annotations

import threading
import time

import pytest

from millpond.errors import DeadlineExceededError
from millpond.service import weights as weights_module
from millpond.service.weights import WeightStore


def publish_in_thread(store: WeightStore, version: int, max_lag: int) -> threading.Thread:
    thread = threading.Thread(target=store.publish, args=(version, b"w", max_lag), daemon=True)
    thread.start()
    return thread


def test_a_publication_waits_for_the_acting_actors_only(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(0, b"w")
    assert store.get(1, 0, "a", acting=True) == (0, None)  # a acts with its version 0
    store.get(0, 0, "b", acting=True)  # b loads version 0
    store.publish(1, b"w", max_lag=1)  # both hold 0 = 1 - 1: no wait
    assert store.acting() == {"a": 0, "b": 0}
    waiting = publish_in_thread(store, 2, max_lag=1)
    time.sleep(0.1)
    assert waiting.is_alive() and store.version == 1  # a and b act with 0 < 2 - 1
    assert store.get(1, 0, "a", acting=True) == (1, b"w")  # a loads 1
    time.sleep(0.05)
    assert waiting.is_alive()  # b still acts with 0
    store.get(1, 0, "b", acting=False)  # b stops acting to write: it holds nothing back
    waiting.join(timeout=5)
    assert store.version == 2 and store.acting() == {"a": 1}


def test_a_silent_actor_expires_and_a_deadline_ends_the_wait(tmp_path, monkeypatch):
    store = WeightStore(tmp_path)
    store.publish(0, b"w")
    store.get(0, 0, "gone", acting=True)
    deadline = time.monotonic() + 0.2
    with pytest.raises(DeadlineExceededError, match="acting with version 0"):
        store.publish(5, b"w", max_lag=2, wait=lambda: deadline - time.monotonic())
    assert store.version == 0  # nothing stored
    monkeypatch.setattr(weights_module, "ACTING_EXPIRY_S", 0.1)
    time.sleep(0.15)
    assert store.publish(5, b"w", max_lag=2) < 0.05  # the silent actor no longer counts
    assert store.version == 5
