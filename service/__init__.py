"""millpond.service: the replay shard — storage, samplers, rate limiter, tables."""

from millpond.service.config import TableConfig
from millpond.service.rate_limiter import RateLimiter
from millpond.service.segments import Segment
from millpond.service.shard import Shard
from millpond.service.spec import FieldSpec, TableSpec
from millpond.service.table import Table

__all__ = ["FieldSpec", "RateLimiter", "Segment", "Shard", "Table", "TableConfig", "TableSpec"]
