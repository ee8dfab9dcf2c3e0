"""millpond.learner: the client library (:mod:`millpond.learner.client`), and beside it value
estimators and reference learners.

:class:`ReplayClient` inserts (:meth:`~ReplayClient.extend`, :meth:`~ReplayClient.writer`),
samples (:meth:`~ReplayClient.sample`, :meth:`~ReplayClient.iterate`), updates priorities
and exchanges policy weights with a set of replay shards. The names below are imported on
first use (PEP 562), so that a process that needs only the client (an env actor) does not
load the reference learners (torch.nn, optimizers, torch.distributed).
"""

from millpond._lazy_exports import lazy_exports

_PUBLIC = {
    "DQNConfig": "millpond.learner.dqn",
    "DQNLearner": "millpond.learner.dqn",
    "PPOConfig": "millpond.learner.ppo",
    "PPOLearner": "millpond.learner.ppo",
    "ReplayClient": "millpond.learner.client",
    "SACConfig": "millpond.learner.sac",
    "SACLearner": "millpond.learner.sac",
    "TD3Config": "millpond.learner.td3",
    "TD3Learner": "millpond.learner.td3",
    "TableConfig": "millpond.config",
    "Writer": "millpond.learner.client",
}


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())

__all__ = [
    "DQNConfig",
    "DQNLearner",
    "PPOConfig",
    "PPOLearner",
    "ReplayClient",
    "SACConfig",
    "SACLearner",
    "TD3Config",
    "TD3Learner",
    "TableConfig",
    "Writer",
]
