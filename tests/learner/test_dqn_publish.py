"""DQN's publications on a thread of their own, against a real shard on loopback: the
version a step hands over holds that step's weights, the next wait (a step's hand-over,
``flush``, ``publish``, ``close``) waits for it and raises its refusal, and with
``max_policy_lag`` the acting actors hold it back on the thread while the learner goes on,
never past the bound in versions.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from millpond import ReplayClient, TableConfig
from millpond.errors import InvalidDataError
from millpond.learner.dqn import DQNConfig, DQNLearner
from millpond.learner.networks import mlp_q
from tests.learner._helpers import (
    Gated,
    assert_published,
    cartpole_spaces,
    collect_chunk,
    write_chunk,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def started(client: Any, **config: Any) -> DQNLearner:
    """A DQN learner on a uniform table of one CartPole chunk acted by its version 0."""
    client.create_table(TableConfig.uniform("replay", capacity=1024, seed=1))
    torch.manual_seed(0)
    learner = DQNLearner(
        client, "replay", DQNConfig(batch_size=16, **config), mlp_q(*cartpole_spaces(), (16,))
    )
    assert learner.publish() == 0
    chunk = collect_chunk(
        client, "millpond.learner.networks:mlp_q", policy_kwargs={"hidden": (16,)}
    )
    write_chunk(client, "replay", chunk)
    return learner


def stored(client: ReplayClient) -> int:
    return int(client.info()["weights_version"])


def test_a_step_hands_its_weights_over_and_flush_and_close_wait_for_them(client):
    gated = Gated(client)
    gated.open.set()
    learner = started(gated, publish_every=2)
    gated.open.clear()
    assert learner.step()["published"] is None
    metrics = learner.step()
    assert metrics["published"] == metrics["version"] == learner.version == 1
    handed = copy.deepcopy(learner.q_network)
    learner.step()  # trains on while version 1 is held
    assert stored(client) == 0
    gated.open.set()
    assert_published(client, learner, 1, handed)  # flushed: that step's weights
    gated.open.clear()
    assert learner.step()["published"] == 2  # the fourth step
    closing = threading.Thread(target=learner.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive() and stored(client) == 1  # close waits for version 2
    gated.open.set()
    closing.join(30)
    assert not closing.is_alive()
    assert_published(client, learner, 2, learner.q_network)


@pytest.mark.parametrize("wait", ["step", "flush", "publish", "close"])
def test_a_refused_publication_is_raised_at_the_next_wait(client, wait):
    learner = started(client, publish_every=1)
    client.publish_weights(learner.q_network.state_dict(), 5)  # a newer version from elsewhere
    assert learner.step()["published"] == 1  # handed over; refused on its thread
    with pytest.raises(InvalidDataError, match="not newer"):
        getattr(learner, wait)()
    learner.flush()  # raised once
    learner.close()


def test_actors_hold_a_publication_back_on_its_thread_within_the_bound(client):
    """``max_policy_lag`` 1 and one actor acting with version 0: version 2 waits on its
    thread while the learner steps on; the next hand-over waits for it, and the rendezvous
    never holds more than the actor's version plus one."""
    learner = started(client, publish_every=1, max_policy_lag=1)
    client.get_weights(actor="a", acting=True)  # acts with version 0
    assert learner.step()["published"] == 1
    learner.flush()
    assert stored(client) == 1
    assert learner.step()["published"] == 2  # the step does not wait for the actor
    assert stored(client) == 1 and learner.updates == 2
    out: dict[str, Any] = {}
    stepping = threading.Thread(target=lambda: out.update(learner.step()))
    stepping.start()
    stepping.join(0.3)
    # the gradient step is taken; the hand-over of version 3 waits for version 2
    assert stepping.is_alive() and stored(client) == 1
    _, acting = client.get_weights(actor="a", acting=True)  # now acts with version 1
    assert acting == 1
    stepping.join(30)
    assert not stepping.is_alive()
    assert out["published"] == 3 and out["publish_wait_s"] > 0  # version 2's wait
    assert stored(client) == 2  # version 3 waits for the actor to hold 2
    client.get_weights(actor="a", acting=False)  # writes: holds nothing back
    learner.close()
    assert stored(client) == 3
