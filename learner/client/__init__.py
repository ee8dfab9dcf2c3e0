"""millpond.learner.client: the client library learners and actors use to reach replay shards.

:class:`ReplayClient` inserts (:meth:`~ReplayClient.extend`, :meth:`~ReplayClient.writer`),
samples (:meth:`~ReplayClient.sample`, :meth:`~ReplayClient.iterate`), updates priorities
and exchanges policy weights with a set of replay shards; a :class:`Writer` streams an
actor's segments to the shard it is pinned to, and a :class:`TableReader` reads a table's
snapshot. The package loads none of the reference learners beside it in
:mod:`millpond.learner`.
"""

from millpond.learner.client.replay_client import ReplayClient
from millpond.learner.client.table_reader import TableReader
from millpond.learner.client.writer import Writer

__all__ = ["ReplayClient", "TableReader", "Writer"]
