"""millpond: a distributed actor-learner data service for reinforcement learning.

Ray actors stream compact experience (each observation sent and stored once) to a sharded
replay service; shards keep it in memory-mapped files and rebuild ``("next", obs)`` at
sample time, so learners receive TorchRL-style TED TensorDicts.

This package is the ground floor: the vocabulary every side shares, in modules that import
nothing else of millpond (:mod:`.errors`, :mod:`.spec`, :mod:`.config`, :mod:`.segments`,
:mod:`.ted`, :mod:`.segmenting`, :mod:`.sample_format`, :mod:`.routing`,
:mod:`.storage_format`, :mod:`.colocated`). The
subpackages stand on it (``docs/architecture.md``); this ``__init__`` re-exports the public
names, and :mod:`.cli` and :mod:`.testing` sit on top of everything.
"""

import os as _os

# A checkout's top-level folders (service/, actors/, learner/, protos/, deploy/) are
# millpond's subpackages (pyproject's package-dir). When the checkout root itself is on
# sys.path (Ray's `--working-dir .`, a script run from the root), `import millpond` finds
# this folder before any installed copy; let its subpackages be found beside it so the
# checkout imports whole instead of failing with "No module named 'millpond.service'".
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "service")) and _os.path.isfile(
    _os.path.join(_checkout, "service", "shard.py")
):
    __path__.append(_checkout)

from millpond.colocated import ColocationError
from millpond.config import TableConfig
from millpond.errors import (
    AuthenticationError,
    ClosedError,
    DeadlineExceededError,
    InvalidConfigError,
    InvalidDataError,
    MillpondError,
    PermissionDeniedError,
    RateLimiterTimeoutError,
    ResourceExhaustedError,
    ShardBusyError,
    ShardUnavailableError,
    StorageCorruptedError,
    TableExistsError,
    TableNotFoundError,
)

# The public face: the client and the in-process shard, from the floors above.
from millpond.learner.client import ReplayClient
from millpond.learner.writer import Writer
from millpond.segments import Segment
from millpond.service.shard import Shard
from millpond.service.table import Table
from millpond.spec import FieldSpec, TableSpec

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "ColocationError",
    "DeadlineExceededError",
    "FieldSpec",
    "InvalidConfigError",
    "InvalidDataError",
    "MillpondError",
    "PermissionDeniedError",
    "RateLimiterTimeoutError",
    "ReplayClient",
    "ResourceExhaustedError",
    "Segment",
    "Shard",
    "ShardBusyError",
    "ShardUnavailableError",
    "StorageCorruptedError",
    "Table",
    "TableConfig",
    "TableExistsError",
    "TableNotFoundError",
    "TableSpec",
    "Writer",
    "__version__",
]
