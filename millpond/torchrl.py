"""TorchRL's replay buffers over a millpond table: a TorchRL training script moves onto a
replay service by changing the line that builds its buffer.

:class:`ReplayBuffer` (a uniform table) and :class:`PrioritizedReplayBuffer` (a prioritized
one) answer what a script asks of ``TensorDictReplayBuffer`` and
``TensorDictPrioritizedReplayBuffer``: ``extend`` (any collector output the client takes),
``add``, ``sample()`` / ``sample(batch_size, return_info=True)``, ``for batch in rb``,
``update_tensordict_priority`` / ``update_priority``, ``len``, ``write_count``, a
``transform`` applied at sample time (its ``inv`` at extend), ``state_dict`` /
``load_state_dict``, ``dumps`` / ``loads`` (a TED export of the table), ``empty``, and a
collector's ``replay_buffer=`` argument. What they cannot honour raises
:class:`TorchRLUnsupportedError`, naming it and what to use instead.

They are not TorchRL ``Storage``/``Sampler``/``Writer`` components: a millpond shard picks
the rows (by its sampler, under its rate limiter) and rebuilds ``("next", obs)`` itself,
while a TorchRL storage is asked for rows its local sampler chose. Samples are millpond's
TED: ``"index"`` is a TensorDict (``slot``, ``generation``, ``shard``) that a priority
update takes as it is, so a priority for a slot overwritten since it was sampled is dropped.

This module is the only one of millpond that imports torchrl (``pip install
millpond[torchrl]``); ``import millpond`` does not import it.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs.transforms import Compose, Transform

from millpond._torchrl_encodings import decode, extend_encoded, holds_encoding
from millpond._torchrl_refusals import (
    TorchRLUnsupportedError,
    check_constructor_kwargs,
    missing_attribute,
)
from millpond.checks import check_batch_size
from millpond.config import TableConfig
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner.client import ReplayClient
from millpond.spec import TableSpec

__all__ = ["PrioritizedReplayBuffer", "ReplayBuffer", "TorchRLUnsupportedError"]

_REDUCTIONS = ("max", "min", "mean", "median", "sum")
_NO_PRIORITY_DUMPS = (
    "PrioritizedReplayBuffer.{what}: a TED export holds the steps, not their priorities; "
    "rb.client.checkpoint() keeps both (`millpond serve --dir` on that directory resumes "
    "them), and `millpond export --format ted` exports the steps alone"
)


class ReplayBuffer:
    """A TorchRL ``TensorDictReplayBuffer`` whose storage is a millpond table (uniform).

    Args:
        client: a :class:`~millpond.ReplayClient`, or the service's address(es) (the buffer
            then owns a client of its own and closes it in :meth:`close`).
        table: the table's name, or a :class:`~millpond.TableConfig` to create it with
            (an identical existing table is used as it is).
        batch_size: what :meth:`sample` draws when given no size, and what iteration draws.
        transform: a TorchRL ``Transform`` (or a callable on a TensorDict) applied to every
            sampled batch; a ``Transform``'s ``inv`` is applied to what is extended.
        prefetch: keep this many sample requests in flight (batches of ``batch_size``),
            as TorchRL's ``prefetch`` does; ``None``: ask when asked.
        timeout_s: how long a sample waits for the table's rate limiter or data (default:
            the client's).

    TorchRL's other constructor arguments (``storage``, ``sampler``, ``writer``, ...) raise
    :class:`TorchRLUnsupportedError` saying what stands for them here.

    Attributes: ``client`` (what the buffer reaches its table through), ``table`` (the
    table's name), ``batch_size`` and ``transform``, as given.
    """

    _SAMPLERS: tuple[str, ...] = ("uniform",)

    def __init__(
        self,
        client: ReplayClient | str | Sequence[str],
        table: str | TableConfig,
        *,
        batch_size: int | None = None,
        transform: Transform | Callable[[TensorDictBase], TensorDictBase] | None = None,
        prefetch: int | None = None,
        timeout_s: float | None = None,
        **torchrl_kwargs: Any,
    ) -> None:
        check_constructor_kwargs(torchrl_kwargs, type(self).__name__)
        if batch_size is not None:
            check_batch_size(batch_size)
        if prefetch is not None and (
            isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1
        ):
            raise InvalidConfigError(f"prefetch ({prefetch!r}) must be a positive integer or None")
        if prefetch is not None and batch_size is None:
            raise InvalidConfigError("prefetch needs a batch_size: it draws batches of that size")
        self.transform = _as_transform(transform)
        self.batch_size = batch_size
        self._prefetch = prefetch
        self._timeout_s = timeout_s
        self._batches: Iterator[TensorDict] | None = None
        self._owns_client = not isinstance(client, ReplayClient)
        self.client: ReplayClient = ReplayClient(client) if self._owns_client else client
        try:
            self._config = self._open_table(table)
        except BaseException:
            self.close()
            raise
        self.table: str = self._config.name
        self._spec: TableSpec | None = self._config.spec

    # -- identity ------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table={self.table!r}, "
            f"addresses={','.join(self.client.addresses)!r}, batch_size={self.batch_size})"
        )

    def __len__(self) -> int:
        """The steps the table holds now, on all its shards (every writer's)."""
        return int(self.client.info(self.table)["size"])

    @property
    def write_count(self) -> int:
        """The steps stored into the table since it was created, by every writer."""
        return int(self.client.info(self.table)["inserts"])

    # -- insert --------------------------------------------------------------------------
    def extend(self, data: TensorDictBase, *, update_priority: bool | None = None) -> int:
        """Store TED data (``[T]``, ``[P, T]``, ``[B, P, T]``, ``split_trajs`` output, a
        lazy stack of them); returns the steps stored, once the shard stored them all.

        Each buffer's client is one source of trajectories (see
        :meth:`ReplayClient.extend`): give each collector its own buffer or client.
        Unlike TorchRL, no storage indices are returned: the shard places the steps. A
        one-hot ``"action"`` is stored as its index (rebuilt bit for bit when sampled).
        """
        if not isinstance(data, TensorDictBase):
            raise InvalidDataError(
                f"{type(self).__name__}.extend takes a TED TensorDict, received "
                f"{type(data).__name__}"
            )
        self._check_extend_priorities(data, update_priority)
        if isinstance(self.transform, Transform):
            data = self.transform.inv(data)
            if data is None:
                return 0
        return extend_encoded(
            lambda td: self.client.extend(self.table, td), data, self._table_spec()
        )

    def add(self, data: TensorDictBase) -> int:
        """Store one step: a TensorDict of batch ``[]`` (one env) or ``[P]`` (one step of
        each of P lanes, what a collector with ``extend_buffer=False`` adds). A step that
        continues the trajectory of the previous call continues its episode; each call
        is stored as a segment of its own (one slot more per step than :meth:`extend`)."""
        if not isinstance(data, TensorDictBase) or data.batch_dims > 1:
            raise InvalidDataError(
                f"{type(self).__name__}.add takes one step: a TensorDict of batch [] or [P]; "
                f"received {_describe(data)} (use extend for [T] or [P, T] data)"
            )
        return self.extend(data.unsqueeze(-1))

    def _check_extend_priorities(self, data: TensorDictBase, update_priority: bool | None) -> None:
        if update_priority:
            raise TorchRLUnsupportedError(
                f"{type(self).__name__}.extend(update_priority=True): a uniform table has no "
                "priorities; use PrioritizedReplayBuffer with TableConfig.prioritized"
            )

    # -- sample --------------------------------------------------------------------------
    def sample(
        self, batch_size: int | None = None, return_info: bool = False
    ) -> TensorDict | tuple[TensorDict, dict[str, Any]]:
        """A TED batch of ``batch_size`` steps (default: the buffer's), transformed.

        The batch holds ``"index"`` (``slot``, ``generation``, ``shard``: what a priority
        update takes) as TorchRL's does; with ``return_info``, ``(batch, info)`` where info
        holds ``"index"`` (and ``"priority_weight"`` for a prioritized table).
        """
        if batch_size is None:
            batch_size = self.batch_size
            if batch_size is None:
                raise InvalidConfigError(
                    "batch_size not given: pass it to sample() or to the buffer's constructor"
                )
        check_batch_size(batch_size)
        if self._prefetch is not None and batch_size == self.batch_size:
            if self._batches is None:
                self._batches = self.client.iterate(
                    self.table, batch_size, self._prefetch, self._timeout_s
                )
            batch = next(self._batches)
        else:
            batch = self.client.sample(self.table, batch_size, self._timeout_s)
        batch = decode(batch)
        info = self._info(batch)
        if self.transform is not None:
            batch = self.transform(batch)
            for key, value in info.items():  # as TorchRL: the info outlives the transform
                batch.set(key, value)
        return (batch, info) if return_info else batch

    def _info(self, batch: TensorDict) -> dict[str, Any]:
        return {"index": batch["index"]}

    def next(self) -> TensorDict:
        """The next batch of ``batch_size`` (TorchRL's ``rb.next()``)."""
        return self.sample()

    def __iter__(self) -> Iterator[TensorDict]:
        """Batches of ``batch_size`` for ever (TorchRL's random sampler never runs out)."""
        if self.batch_size is None:
            raise InvalidConfigError(
                "cannot iterate over the buffer: construct it with a batch_size"
            )
        while True:
            yield self.sample()

    # -- priorities ----------------------------------------------------------------------
    def update_priority(self, index: Any, priority: Any) -> int:
        """TorchRL's no-op on a uniform table; returns 0."""
        return 0

    def update_tensordict_priority(self, data: TensorDictBase) -> int:
        """TorchRL's no-op on a uniform table; returns 0."""
        return 0

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The buffer's own state: its table, batch size and transform's state. The data
        stays in the service (durable there: ``rb.client.checkpoint()``)."""
        transform = self.transform.state_dict() if isinstance(self.transform, Transform) else {}
        return {"table": self.table, "batch_size": self.batch_size, "transform": transform}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s batch size and transform state (same table)."""
        if state_dict.get("table") != self.table:
            raise InvalidConfigError(
                f"the state is of table {state_dict.get('table')!r}, this buffer's is "
                f"{self.table!r}: build a buffer over that table to load it"
            )
        self.batch_size = state_dict["batch_size"]
        self._close_batches()
        if isinstance(self.transform, Transform):
            self.transform.load_state_dict(state_dict["transform"])

    def dumps(self, path: str | Path) -> None:
        """Write the table's steps to ``path`` as a memory-mapped TED export (a consistent
        snapshot, read while inserts go on, episodes kept together): what ``millpond export
        --format ted`` writes. :meth:`loads` stores it back; ``TensorDict.load_memmap(path)``
        gives it to a local TorchRL buffer's ``extend``."""
        from millpond.service.export import export_ted, spooled_table

        path = Path(path).absolute()
        if path.exists() and any(path.iterdir()):
            raise InvalidConfigError(f"{path} holds files: dump into a new or empty directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.client.read_table(self.table) as reader:
            slots = reader.steps + reader.segments
            with (
                tempfile.TemporaryDirectory(dir=path.parent) as spool,
                spooled_table(self.table, reader, slots, spool) as snapshot,
            ):
                if not holds_encoding(reader.config.spec):
                    export_ted(snapshot, path, order="episode")
                    return
                export_ted(snapshot, f"{spool}/ted", order="episode")
                decode(TensorDict.load_memmap(f"{spool}/ted").clone()).memmap_(path)

    def loads(self, path: str | Path) -> None:
        """Store a :meth:`dumps` export (or ``millpond export --format ted``'s) into the
        table, which must be empty: TorchRL's ``loads`` replaces a buffer's contents, and a
        shared table's steps are not dropped behind its other users' backs (:meth:`empty`
        does it on purpose)."""
        held = len(self)
        if held:
            raise InvalidDataError(
                f"table {self.table!r} holds {held} steps: loads replaces a buffer's contents; "
                "call rb.empty() first (it drops them for every user of the table)"
            )
        exported = TensorDict.load_memmap(Path(path))
        # An export's trajectory ids are the table's episode ids (beyond what extend takes as
        # trajectory ids, and one id may have been reused by a source after its episode
        # ended): number its runs of consecutive steps afresh, and store them as a source
        # of their own (a copy of the client), never joined to the buffer's trajectories.
        ids, steps = exported["collector", "traj_ids"], exported["step"]
        new_run = torch.ones(len(ids), dtype=torch.bool)
        new_run[1:] = (ids[1:] != ids[:-1]) | (steps[1:] != steps[:-1] + 1)
        fresh = torch.cumsum(new_run.long(), 0) - 1
        exported = decode(exported.exclude(("collector", "traj_ids")))  # a raw export too
        exported["collector", "traj_ids"] = fresh
        with copy.copy(self.client) as loader:
            extend_encoded(lambda td: loader.extend(self.table, td), exported, self._table_spec())

    def empty(self, empty_write_count: bool = True) -> None:
        """Drop every step of the table, for every user of it (``ReplayClient.reset``)."""
        if not empty_write_count:
            raise TorchRLUnsupportedError(
                "empty(empty_write_count=False): the table's write count is its own and "
                "restarts with it; read rb.write_count before emptying to keep it"
            )
        self._close_batches()
        self.client.reset(self.table)
        self._spec = None

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Cancel prefetched samples; close the client if the buffer made it."""
        self._close_batches()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (in another process) gets a client of its own, with the same options: one
        # source of trajectories per copy, as extend wants.
        kwargs = {
            "batch_size": self.batch_size,
            "transform": self.transform,
            "prefetch": self._prefetch,
            "timeout_s": self._timeout_s,
            **self._reduce_kwargs(),
        }
        return (_rebuild, (type(self), self.client, self.table, kwargs))

    def _reduce_kwargs(self) -> dict[str, Any]:
        return {}

    @property
    def _storage(self) -> TableStorage:
        # What TorchRL's collectors probe (``rb._storage``): the table, initialised, on no
        # local device. A multi-process collector then hands each worker a copy of this
        # buffer (its own client: one source each) instead of preparing a local storage.
        return TableStorage(self.table)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise missing_attribute(type(self).__name__, name)

    def __getitem__(self, index: Any) -> Any:
        raise TorchRLUnsupportedError(
            f"{type(self).__name__}[...]: steps are reached by sampling, not by position; "
            "read the table with rb.client.read_table(rb.table) or rb.dumps(path)"
        )

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TorchRLUnsupportedError(
            f"{type(self).__name__}[...] = ...: stored steps are immutable; extend new data"
        )

    # -- helpers -------------------------------------------------------------------------
    def _open_table(self, table: str | TableConfig) -> TableConfig:
        if isinstance(table, TableConfig):
            config = self.client.create_table(table)
        elif isinstance(table, str) and table:
            config = self.client.info(table)["config"]
        else:
            raise InvalidConfigError(f"table ({table!r}) must be a table name or a TableConfig")
        if config.sampler not in self._SAMPLERS:
            raise InvalidConfigError(
                f"table {config.name!r} samples {config.sampler!r}; {type(self).__name__} "
                f"takes {' or '.join(self._SAMPLERS)} tables (ReplayBuffer: uniform, "
                "PrioritizedReplayBuffer: prioritized); sample other tables with "
                "ReplayClient.sample"
            )
        return config

    def _table_spec(self) -> TableSpec | None:
        # What the table stores, once its first insert (anyone's) has fixed it.
        if self._spec is None:
            self._spec = self.client.info(self.table)["config"].spec
        return self._spec

    def _close_batches(self) -> None:
        if self._batches is not None:
            with contextlib.suppress(Exception):
                self._batches.close()  # type: ignore[attr-defined]
            self._batches = None


class TableStorage:
    """``rb._storage`` of a millpond buffer: what TorchRL's collectors ask of a storage
    (``initialized``, ``device``), and nothing else; anything more is refused, naming
    what to use."""

    initialized = True
    device = None

    def __init__(self, table: str) -> None:
        self.table = table

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_storage":  # a TensorDict storage's data: none
            raise AttributeError(name)
        raise TorchRLUnsupportedError(
            f"the storage of a millpond buffer is table {self.table!r}, in the service: its "
            f"{name!r} is not here; read the table with rb.client.read_table(rb.table) or "
            "rb.dumps(path)"
        )

    def __len__(self) -> int:
        raise TorchRLUnsupportedError("len(rb._storage): use len(rb)")


class PrioritizedReplayBuffer(ReplayBuffer):
    """A TorchRL ``TensorDictPrioritizedReplayBuffer`` whose storage is a millpond
    prioritized table.

    Args (besides :class:`ReplayBuffer`'s):
        alpha, beta: the table's exponents; given, they are set on the table (for every
            user of it, as ``ReplayClient.configure_table`` does), else the table's stay.
        eps: added to every priority before it is sent, as TorchRL's sampler does.
        priority_key: the batch key :meth:`update_tensordict_priority` reads (TorchRL's
            losses write ``"td_error"``).
        reduction: how a batch row's several priority values become one (``"max"``,
            ``"min"``, ``"mean"``, ``"median"``, ``"sum"``), as TorchRL's.

    Samples carry ``"priority_weight"``, the importance weights TorchRL's losses read.
    """

    _SAMPLERS = ("prioritized",)

    def __init__(
        self,
        client: ReplayClient | str | Sequence[str],
        table: str | TableConfig,
        *,
        alpha: float | None = None,
        beta: float | None = None,
        eps: float = 1e-8,
        priority_key: str = "td_error",
        reduction: str = "max",
        **kwargs: Any,
    ) -> None:
        if reduction not in _REDUCTIONS:
            raise InvalidConfigError(f"reduction ({reduction!r}) must be one of {_REDUCTIONS}")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
            raise InvalidConfigError(f"eps ({eps!r}) must be a number >= 0")
        super().__init__(client, table, **kwargs)
        self.priority_key = priority_key
        self.reduction = reduction
        self._eps = float(eps)
        live = {k: v for k, v in (("alpha", alpha), ("beta", beta)) if v is not None}
        if live:
            self._config = self.client.configure_table(self.table, **live)

    def _reduce_kwargs(self) -> dict[str, Any]:
        return {"eps": self._eps, "priority_key": self.priority_key, "reduction": self.reduction}

    def _check_extend_priorities(self, data: TensorDictBase, update_priority: bool | None) -> None:
        if update_priority is not False and self.priority_key in data.keys(include_nested=True):
            raise TorchRLUnsupportedError(
                f"extend with {self.priority_key!r} in the data: initial priorities are not "
                "carried by extend; drop the key (new steps get the table's largest priority "
                "so far) or write with rb.client.writer(rb.table).write_segment(..., "
                "priorities=...)"
            )

    def dumps(self, path: str | Path) -> None:
        """Refused: an export holds the steps, not their priorities."""
        raise TorchRLUnsupportedError(_NO_PRIORITY_DUMPS.format(what="dumps"))

    def loads(self, path: str | Path) -> None:
        """Refused: an export holds the steps, not their priorities."""
        raise TorchRLUnsupportedError(_NO_PRIORITY_DUMPS.format(what="loads"))

    def _info(self, batch: TensorDict) -> dict[str, Any]:
        weight = batch.pop("weight")
        batch.set("priority_weight", weight)
        return {"index": batch["index"], "priority_weight": weight}

    def update_priority(self, index: Any, priority: Any) -> int:
        """Set the priorities of sampled steps: ``index`` is a sample's ``"index"`` (or
        ``info["index"]``), ``priority`` one value per step (rows of several values are
        reduced by ``reduction``). Steps overwritten since they were sampled keep the new
        data's priority. Returns how many priorities were applied."""
        if not isinstance(index, TensorDictBase) or "slot" not in index:
            raise InvalidDataError(
                "update_priority takes a sample's 'index' (a TensorDict of slot, generation "
                f"and shard), received {_describe(index)}: storage positions cannot name a "
                "millpond step, nor tell it from a step that overwrote it"
            )
        rows = index.batch_size.numel()
        priority = torch.as_tensor(priority).detach().to("cpu", torch.float64)
        if priority.numel() == 0 or priority.numel() % max(rows, 1):
            raise InvalidDataError(
                f"update_priority: {priority.numel()} priorities for {rows} steps"
            )
        priority = _reduce(priority.reshape(rows, -1), self.reduction)
        return self.client.update_priorities(self.table, index, priority + self._eps)

    def update_tensordict_priority(self, data: TensorDictBase) -> int:
        """``update_priority(data["index"], data[priority_key])``: the loss's TD errors."""
        priority = data.get(self.priority_key, None)
        if priority is None:
            raise InvalidDataError(
                f"the batch has no {self.priority_key!r}: run the loss on it first (TorchRL's "
                "losses write 'td_error'), or name the key with priority_key="
            )
        return self.update_priority(data.get("index"), priority)


# -- helpers ------------------------------------------------------------------------------------
def _as_transform(
    transform: Transform | Callable[[TensorDictBase], TensorDictBase] | None,
) -> Transform | Callable[[TensorDictBase], TensorDictBase] | None:
    """As TorchRL holds it: a ``Transform`` in a ``Compose``, in eval mode; a callable as is."""
    if transform is None:
        return None
    if isinstance(transform, Transform):
        transform = transform if isinstance(transform, Compose) else Compose(transform)
        transform.eval()
        return transform
    if callable(transform):
        return transform
    raise InvalidConfigError(f"transform ({transform!r}) must be a TorchRL Transform or a callable")


def _reduce(priority: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction in ("max", "min", "median"):
        return getattr(priority, reduction)(dim=1).values
    return getattr(priority, reduction)(dim=1)


def _describe(x: Any) -> str:
    if isinstance(x, TensorDictBase | torch.Tensor):
        return f"{type(x).__name__} of shape {list(x.shape)}"
    return type(x).__name__


def _rebuild(cls: type, client: ReplayClient, table: str, kwargs: dict[str, Any]) -> Any:
    # The client arrives as a new one (it pickles as its addresses and options): the copy
    # owns it.
    buffer = cls(client, table, **kwargs)
    buffer._owns_client = True
    return buffer
