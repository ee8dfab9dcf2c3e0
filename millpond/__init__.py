"""millpond: a distributed actor-learner data service for reinforcement learning.

Ray actors stream compact experience (each observation sent and stored once) to a sharded
replay service; shards keep it in memory-mapped files and rebuild ``("next", obs)`` at
sample time, so learners receive TorchRL-style TED TensorDicts.

This package is the ground floor: the vocabulary every side shares, in modules that import
nothing else of millpond (:mod:`.errors`, :mod:`.spec`, :mod:`.config`, :mod:`.segments`,
:mod:`.ted`, :mod:`.segmenting`, :mod:`.sample_format`, :mod:`.routing`,
:mod:`.storage_format`, :mod:`.colocated`, :mod:`.checks`, :mod:`.insert_checks`). The
subpackages stand on it (``docs/architecture.md``); this ``__init__`` re-exports the public
names (each imported on first use), and :mod:`.cli` and :mod:`.testing` sit on top of everything.
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

from millpond import _lazy_compiler
from millpond import errors as _errors  # light: no dependencies
from millpond._lazy_exports import lazy_exports

# tensordict's compile marks wait for torch._dynamo (~1 s of CPU per process) until something
# imports it: only learners compile (their optimizers), not shards, env actors or the driver.
_lazy_compiler.install()

# The public names, imported on first use (PEP 562): a process that needs one floor of
# millpond (a shard, an env actor, the CLI) does not pay for the others' imports (torch,
# tensordict, grpc: seconds per process on a small machine).
_PUBLIC = {
    "TableConfig": "millpond.config",
    **dict.fromkeys(_errors.__all__, "millpond.errors"),
    # The public face: the client and the in-process shard, from the floors above.
    "ReplayClient": "millpond.learner.client",
    "Writer": "millpond.learner.client",
    "Segment": "millpond.segments",
    "Shard": "millpond.service.shard",
    "Table": "millpond.service.table",
    "FieldSpec": "millpond.spec",
    "TableSpec": "millpond.spec",
    # Training jobs from Python, and what they trained.
    "Job": "millpond.deploy.job",
    "JobResult": "millpond.deploy.job",
    "job_config": "millpond.deploy.job",
    "LaunchConfig": "millpond.deploy.launch_config",
    "load_config": "millpond.deploy.launch_config",
    "TrainedPolicy": "millpond.deploy.trained_policy",
    "load_policy": "millpond.deploy.trained_policy",
}


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "ColocationError",
    "DeadlineExceededError",
    "FieldSpec",
    "InvalidConfigError",
    "InvalidDataError",
    "Job",
    "JobResult",
    "LaunchConfig",
    "MillpondError",
    "PermissionDeniedError",
    "RateLimiterTimeoutError",
    "ReplayClient",
    "ResourceExhaustedError",
    "Segment",
    "Shard",
    "ShardBusyError",
    "ShardGoneError",
    "ShardUnavailableError",
    "StorageCorruptedError",
    "Table",
    "TableConfig",
    "TableExistsError",
    "TableNotFoundError",
    "TableSpec",
    "TrainedPolicy",
    "Writer",
    "__version__",
    "job_config",
    "load_config",
    "load_policy",
]
