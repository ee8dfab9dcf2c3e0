"""Table configuration: a frozen dataclass with one preset per sampler kind."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from millpond.errors import InvalidConfigError
from millpond.frame_stacks import check_stacks, normalize_stacks, stacks_to_json
from millpond.spec import MAX_ROW_BYTES, Key, TableSpec

__all__ = [
    "COMPRESSIONS",
    "MAX_CAPACITY",
    "MAX_NAME_BYTES",
    "MAX_ROW_BYTES",
    "MAX_SEED",
    "MAX_TABLE_BYTES",
    "MAX_TIMEOUT_MS",
    "PRIORITIZED_SAMPLERS",
    "SAMPLERS",
    "SLICE_SAMPLERS",
    "TableConfig",
    "check_table_bytes",
]

SAMPLERS = ("uniform", "prioritized", "queue", "slices", "prioritized_slices")
#: The samplers that keep priorities (``update_priorities``, ``alpha`` and ``beta``).
PRIORITIZED_SAMPLERS = ("prioritized", "prioritized_slices")
#: The samplers that return slices ``[B, slice_len]`` (``slice_len``, ``strict_length``).
SLICE_SAMPLERS = ("slices", "prioritized_slices")
COMPRESSIONS = (None, "zstd")

# Limits on what a table, a request or a step may declare: each one is checked where the
# value enters (a config, a spec, a request), so that an absurd value is refused by name
# instead of failing deep inside (an overflow, a file name the file system refuses, an
# allocation of terabytes).

#: The most slots a table may have: slot pointers and segment records are int32.
MAX_CAPACITY = 2**31 - 1
#: The longest table name, in UTF-8 bytes: it names a directory (file systems allow 255).
MAX_NAME_BYTES = 255
#: The most bytes a table may map: capacity x (a slot's bytes + its bookkeeping). 16 TiB,
#: the largest file ext4 holds, and far below the 128 TiB a process can address.
MAX_TABLE_BYTES = 2**44
#: Bookkeeping bytes per slot besides its data (slot pointer, its share of a segment
#: record, sampler state), counted against :data:`MAX_TABLE_BYTES`.
SLOT_OVERHEAD_BYTES = 64
#: The largest seed: the sampler's generator takes a non-negative 64-bit integer.
MAX_SEED = 2**63 - 1
#: The longest wait a request may ask for (``timeout_ms``), in milliseconds: 30 days. Longer
#: waits overflow thread waits; 0 already means "wait forever".
MAX_TIMEOUT_MS = 30 * 24 * 3600 * 1000


#: The settings of a table that may change while it runs (``TableConfig.configured``).
LIVE_SETTINGS = ("min_size", "samples_per_insert", "error_buffer", "alpha", "beta")


@dataclass(frozen=True)
class TableConfig:
    """How one table stores and serves its data.

    Attributes:
        name: the table's name (letters, digits, ``_``, ``-`` and ``.``).
        capacity: ring size in *slots*. A segment of L steps takes L+1 slots, so a table
            filled with segments of length L holds ``capacity * L / (L + 1)`` steps.
        sampler: ``"uniform"``, ``"prioritized"``, ``"queue"``, ``"slices"`` or
            ``"prioritized_slices"``.
        min_size: steps the table must hold before sampling is allowed.
        samples_per_insert: sampled steps per inserted step, or ``None`` for no ratio limit.
        error_buffer: how far the ratio may drift, in samples, before one side blocks.
            Defaults to ``max(1, min_size) * samples_per_insert`` (Reverb's tolerance 1.0).
        alpha: prioritization exponent (prioritized and prioritized slices tables).
        beta: importance-weight exponent (prioritized and prioritized slices tables).
        slice_len: steps per sampled slice (slices and prioritized slices tables).
        compression: ``None`` or ``"zstd"``: how observation bytes travel on the wire.
        spec: the declared keys, or ``None`` to take them from the first insert.
        seed: seeds the sampler's random generator, for reproducible tests.
        strict_length: slices and prioritized slices tables: ``True`` (the default) samples only full slices of
            ``slice_len`` steps; ``False`` lets every stored step start one, so episode
            ends (and episodes shorter than ``slice_len``) begin slices too: a short slice
            repeats its last step, with ``("collector", "mask")`` false on the repeats
            (what n-step targets at episode ends need).
        verify_reads: check the checksum of every sampled segment before returning it
            (a segment damaged on disk is dropped and redrawn, never served). Costs about
            4x the sample time; recovery checks every segment on open regardless.
        frame_stacks: frame-stacked observation keys and their frame counts, ``{key: k}``
            (a key as a tuple, or its parts joined by ``.``): each such observation is a
            stack of the ``k`` latest frames along dim 0, oldest first (gymnasium's
            ``FrameStackObservation``), and each frame is sent and stored once
            (:mod:`millpond.frame_stacks`). The key must be an observation of shape
            ``[k, *frame]``, ``k >= 2``.
    """

    name: str
    capacity: int
    sampler: str = "uniform"
    min_size: int = 1
    samples_per_insert: float | None = None
    error_buffer: float | None = None
    alpha: float = 0.6
    beta: float = 0.4
    slice_len: int | None = None
    compression: str | None = None
    spec: TableSpec | None = field(default=None, compare=False)
    seed: int | None = None
    strict_length: bool = True
    verify_reads: bool = False
    frame_stacks: dict[Key, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name
            or not all(c.isalnum() or c in "_-." for c in self.name)
            or self.name.startswith(".")
        ):
            raise InvalidConfigError(
                f"table name ({_short(self.name)}) must be non-empty letters, digits, '_', "
                "'-' or '.'"
            )
        name_bytes = len(self.name.encode("utf-8", "surrogatepass"))
        if name_bytes > MAX_NAME_BYTES:
            raise InvalidConfigError(
                f"table name ({_short(self.name)}) takes {name_bytes} bytes, more than the "
                f"limit ({MAX_NAME_BYTES} bytes)"
            )
        if (
            isinstance(self.capacity, bool)
            or not isinstance(self.capacity, int)
            or self.capacity < 2
        ):
            raise InvalidConfigError(
                f"capacity ({self.capacity!r}) must be an integer >= 2 (one step and its tail)"
            )
        if self.capacity > MAX_CAPACITY:
            raise InvalidConfigError(
                f"capacity ({self.capacity}) exceeds the largest a table can address "
                f"({MAX_CAPACITY} slots: slot pointers and segment records are int32)"
            )
        if self.sampler not in SAMPLERS:
            raise InvalidConfigError(f"sampler ({self.sampler!r}) must be one of {SAMPLERS}")
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise InvalidConfigError(f"min_size ({self.min_size!r}) must be a non-negative integer")
        spi = self.samples_per_insert
        if spi is not None and (not _is_real(spi) or spi <= 0):
            raise InvalidConfigError(
                f"samples_per_insert ({spi!r}) must be a positive number or None"
            )
        eb = self.error_buffer
        if eb is not None and (not _is_real(eb) or eb < 0):
            raise InvalidConfigError(f"error_buffer ({eb!r}) must be a non-negative number")
        if eb is not None and spi is None:
            raise InvalidConfigError("error_buffer needs samples_per_insert")
        if not _is_real(self.alpha) or self.alpha < 0:
            raise InvalidConfigError(f"alpha ({self.alpha!r}) must be >= 0")
        if not _is_real(self.beta) or self.beta < 0:
            raise InvalidConfigError(f"beta ({self.beta!r}) must be >= 0")
        if self.sampler in SLICE_SAMPLERS:
            if not isinstance(self.slice_len, int) or self.slice_len < 1:
                raise InvalidConfigError(
                    f"slice_len ({self.slice_len!r}) must be a positive integer for a "
                    f"{self.sampler} table"
                )
            if self.slice_len + 1 > self.capacity:
                raise InvalidConfigError(
                    f"slice_len ({self.slice_len}) needs capacity >= {self.slice_len + 1}"
                )
        elif self.slice_len is not None:
            raise InvalidConfigError(f"slice_len is only for slices tables, not {self.sampler!r}")
        if not isinstance(self.strict_length, bool):
            raise InvalidConfigError(
                f"strict_length ({self.strict_length!r}) must be True or False"
            )
        if not isinstance(self.verify_reads, bool):
            raise InvalidConfigError(f"verify_reads ({self.verify_reads!r}) must be True or False")
        if not self.strict_length and self.sampler not in SLICE_SAMPLERS:
            raise InvalidConfigError(
                f"strict_length=False is only for slices tables, not {self.sampler!r}"
            )
        if self.sampler == "queue" and spi is not None:
            raise InvalidConfigError(
                "a queue table delivers each step once; it takes no samples_per_insert"
            )
        if self.compression not in COMPRESSIONS:
            raise InvalidConfigError(
                f"compression ({self.compression!r}) must be one of {COMPRESSIONS}"
            )
        if self.spec is not None and not isinstance(self.spec, TableSpec):
            raise InvalidConfigError("spec must be a TableSpec or None")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidConfigError(f"seed ({self.seed!r}) must be an integer in [0, {MAX_SEED}]")
        if self.min_size > MAX_CAPACITY:
            # a table never holds more steps than slots: such a table could never be sampled
            raise InvalidConfigError(
                f"min_size ({self.min_size}) exceeds the largest capacity ({MAX_CAPACITY})"
            )
        object.__setattr__(self, "frame_stacks", normalize_stacks(self.frame_stacks))
        if self.spec is not None:
            check_stacks(self.frame_stacks, self.spec)
        check_table_bytes(self.capacity, self.spec, self.frame_stacks)

    @property
    def has_priorities(self) -> bool:
        """Whether the sampler keeps priorities (:data:`PRIORITIZED_SAMPLERS`)."""
        return self.sampler in PRIORITIZED_SAMPLERS

    @property
    def has_slices(self) -> bool:
        """Whether samples are slices ``[B, slice_len]`` (:data:`SLICE_SAMPLERS`)."""
        return self.sampler in SLICE_SAMPLERS

    @property
    def effective_error_buffer(self) -> float | None:
        """The error buffer in force: the declared one, or the default described above."""
        if self.samples_per_insert is None:
            return None
        if self.error_buffer is not None:
            return float(self.error_buffer)
        return float(max(1, self.min_size)) * float(self.samples_per_insert)

    # Presets, one per sampler kind.
    @classmethod
    def uniform(cls, name: str, capacity: int, **kwargs: Any) -> TableConfig:
        """Uniform sampling over stored steps (DQN-style replay)."""
        return cls(name=name, capacity=capacity, sampler="uniform", **kwargs)

    @classmethod
    def prioritized(
        cls, name: str, capacity: int, alpha: float = 0.6, beta: float = 0.4, **kwargs: Any
    ) -> TableConfig:
        """Proportional prioritized replay (sum-tree) with importance weights."""
        return cls(
            name=name, capacity=capacity, sampler="prioritized", alpha=alpha, beta=beta, **kwargs
        )

    @classmethod
    def queue(cls, name: str, capacity: int, **kwargs: Any) -> TableConfig:
        """FIFO: each step delivered once, in insertion order, whole segments together."""
        return cls(name=name, capacity=capacity, sampler="queue", **kwargs)

    @classmethod
    def slices(cls, name: str, capacity: int, slice_len: int, **kwargs: Any) -> TableConfig:
        """Sequences of ``slice_len`` consecutive steps of one episode."""
        return cls(name=name, capacity=capacity, sampler="slices", slice_len=slice_len, **kwargs)

    @classmethod
    def prioritized_slices(
        cls,
        name: str,
        capacity: int,
        slice_len: int,
        alpha: float = 0.6,
        beta: float = 0.4,
        **kwargs: Any,
    ) -> TableConfig:
        """Slices as :meth:`slices`, each drawn with the priority of its first step, with
        importance weights (prioritized n-step replay: Rainbow, Ape-X)."""
        return cls(
            name=name,
            capacity=capacity,
            sampler="prioritized_slices",
            slice_len=slice_len,
            alpha=alpha,
            beta=beta,
            **kwargs,
        )

    def with_spec(self, spec: TableSpec) -> TableConfig:
        return replace(self, spec=spec)

    def configured(self, **settings: Any) -> TableConfig:
        """This config with live settings changed (:data:`LIVE_SETTINGS`, what
        ``ReplayClient.configure_table`` changes on a running table), checked as any
        config is; the settings not given are kept. ``samples_per_insert=None`` drops the
        ratio, and its error buffer."""
        unknown = set(settings) - set(LIVE_SETTINGS)
        if unknown:
            raise InvalidConfigError(
                f"{sorted(unknown)} cannot change on a running table; the live settings are "
                f"{list(LIVE_SETTINGS)}"
            )
        if ("alpha" in settings or "beta" in settings) and not self.has_priorities:
            raise InvalidConfigError(
                f"alpha and beta are for prioritized tables; {self.name!r} is {self.sampler!r}"
            )
        if "samples_per_insert" in settings and settings["samples_per_insert"] is None:
            settings.setdefault("error_buffer", None)
        return replace(self, **settings)

    def without_live_settings(self) -> TableConfig:
        """This config with the live settings at their defaults: what two configs of one
        table share however its settings were changed while it ran."""
        defaults = TableConfig(name=self.name, capacity=self.capacity)
        return replace(self, **{k: getattr(defaults, k) for k in LIVE_SETTINGS})

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.verify_reads:  # configs written before the option read the same
            del d["verify_reads"]
        if self.frame_stacks:
            d["frame_stacks"] = stacks_to_json(self.frame_stacks)
        else:  # likewise
            del d["frame_stacks"]
        d["spec"] = self.spec.to_json() if self.spec is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TableConfig:
        d = dict(d)
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise InvalidConfigError(f"unknown table config key(s): {sorted(unknown)}")
        spec = d.pop("spec", None)
        try:
            return cls(**d, spec=TableSpec.from_json(spec) if spec is not None else None)
        except TypeError as e:
            raise InvalidConfigError(f"bad table config: {e}") from e


def check_table_bytes(
    capacity: int, spec: TableSpec | None, stacks: dict[Key, int] | None = None
) -> None:
    """Refuse (:class:`InvalidConfigError`) a table whose files would map more than
    :data:`MAX_TABLE_BYTES`: ``capacity`` slots of ``spec``'s keys plus their bookkeeping
    (a frame-stacked key maps a frame per slot, and about half a stack per slot more for
    its prefixes: their rows number ``capacity // 2``)."""
    slot = SLOT_OVERHEAD_BYTES + (spec.slot_bytes if spec is not None else 0)
    for key, k in (stacks or {}).items() if spec is not None else ():
        stack = spec.fields[key].nbytes
        slot -= stack - stack // k - (stack // k * (k - 1) + 1) // 2
    total = capacity * slot
    if total > MAX_TABLE_BYTES:
        raise InvalidConfigError(
            f"capacity ({capacity}) x {slot} bytes per slot = {total} bytes, more than the "
            f"largest table ({MAX_TABLE_BYTES} bytes); lower the capacity"
        )


def _short(text: str, limit: int = 64) -> str:
    """``repr(text)``, cut to ``limit`` characters: errors quote names, not megabytes."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
