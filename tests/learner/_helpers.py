"""Helpers of the reference learners' tests: CartPole experience collected by the real
:class:`millpond.actors.Collector`, written through ``client.writer``, and a check of the
weights a learner published; a client whose publications wait for a gate.

Test modules import it as ``tests.learner._helpers`` (pytest's ``--import-mode=importlib``
makes ``tests`` and ``tests.learner`` namespace packages under the root directory).
"""

from __future__ import annotations

import threading
from typing import Any

import gymnasium as gym
import torch
from tensordict import TensorDict

from millpond import ReplayClient
from millpond.actors import Collector, cut_batch

LANES, CHUNK = 4, 64  # 256 steps per chunk


def cartpole_spaces() -> tuple[gym.Space, gym.Space]:
    env = gym.make("CartPole-v1")
    spaces = env.observation_space, env.action_space
    env.close()
    return spaces


def collect_chunk(client: ReplayClient, policy: str, seed: int = 0, **kwargs: Any) -> TensorDict:
    """One CartPole chunk ``[LANES, CHUNK]`` acted by the factory ``policy`` with the server's
    latest weights (``kwargs`` go to the :class:`Collector`)."""
    with Collector(
        "CartPole-v1",
        num_envs=LANES,
        chunk_len=CHUNK,
        policy=policy,
        weight_source=client,
        seed=seed,
        **kwargs,
    ) as collector:
        return collector.collect()


def write_chunk(client: ReplayClient, table: str, chunk: TensorDict) -> int:
    """Write a chunk's segments into ``table`` (as an actor's writer would); returns the steps."""
    with client.writer(table) as writer:
        for segment in cut_batch(chunk):
            writer.write_segment(
                segment.steps, segment.tail, segment.episode_id, segment.first_step
            )
        writer.flush(timeout_s=10)
    return chunk.numel()


def assert_published(
    client: ReplayClient, learner: Any, version: int, network: torch.nn.Module
) -> None:
    """The server holds ``version``, the learner's version, with ``network``'s weights
    (once the publication the learner's last step handed over is stored)."""
    if hasattr(learner, "flush"):
        learner.flush()
    weights, got = client.get_weights()
    assert got == version == learner.version
    expected = network.state_dict()
    assert weights is not None and weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


class Gated:
    """A real client whose weight publications wait until :attr:`open` is set: the
    learner's next steps run while one handed over is held (its call is asked when its
    answer is waited for, after the gate opens)."""

    def __init__(self, client: ReplayClient) -> None:
        self._client = client
        self.open = threading.Event()

    def publish_weights(self, *args: Any, **kwargs: Any) -> int:
        assert self.open.wait(30)
        return self._client.publish_weights(*args, **kwargs)

    def publish_weights_later(self, *args: Any, **kwargs: Any) -> Any:
        gated = self

        class Held:
            def result(self) -> int:
                return gated.publish_weights(*args, **kwargs)

        return Held()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
