"""millpond.learner: the client library learners and actors use, and learner utilities.

:class:`ReplayClient` inserts (:meth:`~ReplayClient.extend`, :meth:`~ReplayClient.writer`),
samples (:meth:`~ReplayClient.sample`, :meth:`~ReplayClient.iterate`), updates priorities
and exchanges policy weights with a set of replay shards.
"""

from millpond.config import TableConfig
from millpond.learner.client import ReplayClient
from millpond.learner.dqn import DQNConfig, DQNLearner
from millpond.learner.ppo import PPOConfig, PPOLearner
from millpond.learner.writer import Writer

__all__ = [
    "DQNConfig",
    "DQNLearner",
    "PPOConfig",
    "PPOLearner",
    "ReplayClient",
    "TableConfig",
    "Writer",
]
