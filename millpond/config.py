"""Table configuration: a frozen dataclass with one preset per sampler kind."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from millpond.errors import InvalidConfigError
from millpond.spec import TableSpec

SAMPLERS = ("uniform", "prioritized", "queue", "slices")
COMPRESSIONS = (None, "zstd")


@dataclass(frozen=True)
class TableConfig:
    """How one table stores and serves its data.

    Attributes:
        name: the table's name (letters, digits, ``_``, ``-`` and ``.``).
        capacity: ring size in *slots*. A segment of L steps takes L+1 slots, so a table
            filled with segments of length L holds ``capacity * L / (L + 1)`` steps.
        sampler: ``"uniform"``, ``"prioritized"``, ``"queue"`` or ``"slices"``.
        min_size: steps the table must hold before sampling is allowed.
        samples_per_insert: sampled steps per inserted step, or ``None`` for no ratio limit.
        error_buffer: how far the ratio may drift, in samples, before one side blocks.
            Defaults to ``max(1, min_size) * samples_per_insert`` (Reverb's tolerance 1.0).
        alpha: prioritization exponent (prioritized tables).
        beta: importance-weight exponent (prioritized tables).
        slice_len: steps per sampled slice (slices tables).
        compression: ``None`` or ``"zstd"``: how observation bytes travel on the wire.
        spec: the declared keys, or ``None`` to take them from the first insert.
        seed: seeds the sampler's random generator, for reproducible tests.
        strict_length: slices tables: ``True`` (the default) samples only full slices of
            ``slice_len`` steps; ``False`` lets every stored step start one, so episode
            ends (and episodes shorter than ``slice_len``) begin slices too: a short slice
            repeats its last step, with ``("collector", "mask")`` false on the repeats
            (what n-step targets at episode ends need).
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

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name
            or not all(c.isalnum() or c in "_-." for c in self.name)
            or self.name.startswith(".")
        ):
            raise InvalidConfigError(
                f"table name ({self.name!r}) must be non-empty letters, digits, '_', '-' or '.'"
            )
        if (
            isinstance(self.capacity, bool)
            or not isinstance(self.capacity, int)
            or self.capacity < 2
        ):
            raise InvalidConfigError(
                f"capacity ({self.capacity!r}) must be an integer >= 2 (one step and its tail)"
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
        if self.sampler == "slices":
            if not isinstance(self.slice_len, int) or self.slice_len < 1:
                raise InvalidConfigError(
                    f"slice_len ({self.slice_len!r}) must be a positive integer for a slices table"
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
        if not self.strict_length and self.sampler != "slices":
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

    def with_spec(self, spec: TableSpec) -> TableConfig:
        return replace(self, spec=spec)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
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


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
