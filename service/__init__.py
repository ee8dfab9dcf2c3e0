"""millpond.service: the replay shard — storage, samplers, rate limiter, tables, gRPC server.

It stands on the ground floor (:mod:`millpond.spec`, :mod:`millpond.config`,
:mod:`millpond.segments`, ...) and the wire (:mod:`millpond.protos`), and never imports the
client (:mod:`millpond.learner`) or the env side (:mod:`millpond.actors`).
"""

from millpond.service.rate_limiter import RateLimiter
from millpond.service.shard import Shard
from millpond.service.sink import TableSink
from millpond.service.table import Table

__all__ = ["RateLimiter", "Shard", "Table", "TableSink"]
