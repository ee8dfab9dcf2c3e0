"""Table specs: which keys a table stores, with their dtypes and per-step shapes.

A spec is declared with the table or taken from the first insert, then enforced on every
insert. Keys come in two roles: *observation* keys are stored once per slot (the step slots
and the segment's tail slot), and *step* keys are stored for step slots only (actions,
rewards, flags, log-probs, ...). Keys are tuples of strings; ``("next", "reward")`` is a
step key, and observation keys never live under ``"next"``: ``("next", obs)`` is rebuilt at
sample time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from millpond.errors import InvalidConfigError, InvalidDataError

Key = tuple[str, ...]

OBSERVATION = "observation"
STEP = "step"

#: Keys a table produces itself when sampling, so a writer may not send them.
RESERVED_KEYS: frozenset[Key] = frozenset(
    {
        ("index",),
        ("episode_id",),
        ("step",),
        ("weight",),
        ("done",),
        ("terminated",),
        ("truncated",),
    }
)


#: Nested keys sampling produces: the mask of slices shorter than asked.
MASK: Key = ("collector", "mask")
#: A collector's count of each step's index in its episode (millpond's collectors write it).
STEP_COUNT: Key = ("collector", "step_count")


def is_reserved(key: Key) -> bool:
    """Whether ``key`` is, or nests under, a key that sampling produces itself."""
    return key[:1] in RESERVED_KEYS or key[:2] == MASK


#: Episode-end flags, stored as one bool per step; ``("next", "done")`` is derived from them.
TERMINATED: Key = ("next", "terminated")
TRUNCATED: Key = ("next", "truncated")
DONE: Key = ("next", "done")

_KEY_PART = re.compile(r"^[A-Za-z0-9_\-]+$")

#: The longest key, its parts joined by ``.``: it names a column file (``KEY.bin``), and
#: file systems allow 255 bytes per name (so no table ever stored a longer key).
MAX_KEY_BYTES = 255 - len(".bin")
#: The most parts a key may have (how deep a TensorDict nests it).
MAX_KEY_DEPTH = 32
#: The most bytes one step may take (one key, and every key of a slot together).
MAX_ROW_BYTES = 2**30
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a torch dtype (``"float32"``), as stored in metadata and on the wire."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; raises :class:`InvalidConfigError` for unknown names."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise InvalidConfigError(
            f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}"
        ) from None


def _short_shape(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else f"{text[:80]}... ({len(shape)} dimensions)"


def format_key(key: Key) -> str:
    """A key as users write it: ``'action'`` or ``('next', 'reward')``."""
    return repr(key[0]) if len(key) == 1 else repr(key)


def check_key(key: Key) -> Key:
    """Validate a key's parts (letters, digits, ``_`` and ``-``) and return it as a tuple."""
    key = (key,) if isinstance(key, str) else tuple(key)
    check_key_size(key)
    if not key or not all(isinstance(p, str) and _KEY_PART.match(p) for p in key):
        raise InvalidDataError(
            f"invalid key {_short_key(key)}: each part must be a non-empty string of letters, "
            "digits, '_' or '-'"
        )
    return key


def check_key_size(key: Key) -> None:
    """Refuse (:class:`InvalidDataError`) a key deeper than :data:`MAX_KEY_DEPTH` parts or
    longer than :data:`MAX_KEY_BYTES` (its parts joined by ``.``)."""
    if len(key) > MAX_KEY_DEPTH:
        raise InvalidDataError(
            f"key {_short_key(key)} has {len(key)} parts, more than the limit ({MAX_KEY_DEPTH})"
        )
    size = sum(len(str(p).encode("utf-8", "surrogatepass")) for p in key) + len(key) - 1
    if size > MAX_KEY_BYTES:
        raise InvalidDataError(
            f"key {_short_key(key)} takes {size} bytes, more than the limit "
            f"({MAX_KEY_BYTES} bytes, its parts joined by '.')"
        )


def _short_key(key: tuple) -> str:
    """A key for an error message, cut short: errors quote keys, not megabytes."""
    text = repr(key)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(key)} parts)"


@dataclass(frozen=True)
class FieldSpec:
    """One stored key.

    Attributes:
        dtype: the element type.
        shape: the shape of one step (the batch dimensions excluded).
        role: ``"observation"`` (stored for step and tail slots) or ``"step"``.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    role: str = STEP

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidConfigError(f"dtype ({self.dtype!r}) must be a torch dtype")
        shape = self.shape
        if not isinstance(shape, tuple | list) or not all(
            isinstance(s, int | np.integer) and not isinstance(s, bool) for s in shape
        ):
            raise InvalidConfigError(f"shape ({shape!r}) must be a tuple of integers")
        shape = tuple(int(s) for s in shape)
        object.__setattr__(self, "shape", shape)  # one form, so that equal specs compare equal
        if any(s < 0 for s in shape):
            raise InvalidConfigError(f"shape {list(shape)} has a negative dimension")
        # Zero dimensions count as 1, so that an empty shape cannot hide overflowing ones.
        span = torch.empty((), dtype=self.dtype).element_size()
        for s in shape:
            span *= max(s, 1)
        if span > MAX_ROW_BYTES:
            raise InvalidConfigError(
                f"shape {_short_shape(shape)} of {dtype_name(self.dtype)} takes {span} bytes "
                f"per step, more than the limit ({MAX_ROW_BYTES} bytes)"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of one step of this key."""
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


@dataclass(frozen=True)
class TableSpec:
    """The keys of a table, each with its :class:`FieldSpec`.

    ``fields`` maps key tuples to specs. Use :meth:`from_example` to take a spec from data.
    """

    fields: Mapping[Key, FieldSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, f in self.fields.items():
            check_key(key)
            if f.role not in (OBSERVATION, STEP):
                raise InvalidConfigError(f"key {format_key(key)}: unknown role {f.role!r}")
            if f.role == OBSERVATION and key[0] == "next":
                raise InvalidConfigError(
                    f"observation key {format_key(key)} may not live under 'next': "
                    "('next', obs) is rebuilt from the following slot"
                )
            if is_reserved(key):
                raise InvalidConfigError(f"key {format_key(key)} is reserved for sampled output")
        if not any(f.role == OBSERVATION for f in self.fields.values()):
            raise InvalidConfigError("a table spec needs at least one observation key")
        if self.slot_bytes > MAX_ROW_BYTES:
            raise InvalidConfigError(
                f"a step of this spec takes {self.slot_bytes} bytes (every key together), "
                f"more than the limit ({MAX_ROW_BYTES} bytes)"
            )

    @property
    def observation_keys(self) -> list[Key]:
        return [k for k, f in self.fields.items() if f.role == OBSERVATION]

    @property
    def step_keys(self) -> list[Key]:
        return [k for k, f in self.fields.items() if f.role == STEP]

    @property
    def observation_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields.values() if f.role == OBSERVATION)

    @property
    def step_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields.values() if f.role == STEP)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's data (every key: a tail slot holds fewer, never more)."""
        return self.observation_bytes + self.step_bytes

    @classmethod
    def from_example(
        cls, steps: Mapping[Key, torch.Tensor], tail: Mapping[Key, torch.Tensor]
    ) -> TableSpec:
        """The spec of a segment: ``tail``'s keys are the observation keys, the rest are step keys.

        Both arguments map keys to tensors with a leading step dimension (the tail's is 1).
        """
        fields: dict[Key, FieldSpec] = {}
        for key, t in tail.items():
            fields[key] = FieldSpec(t.dtype, tuple(t.shape[1:]), OBSERVATION)
        for key, t in steps.items():
            if key not in fields:
                fields[key] = FieldSpec(t.dtype, tuple(t.shape[1:]), STEP)
        return cls(fields)

    def to_json(self) -> list[dict]:
        return [
            {"key": list(k), "dtype": dtype_name(f.dtype), "shape": list(f.shape), "role": f.role}
            for k, f in self.fields.items()
        ]

    @classmethod
    def from_json(cls, items: Iterable[Mapping]) -> TableSpec:
        try:
            return cls(
                {
                    check_key(tuple(it["key"])): FieldSpec(
                        parse_dtype(it["dtype"]),
                        tuple(int(s) for s in it["shape"]),
                        it.get("role", STEP),
                    )
                    for it in items
                }
            )
        except (KeyError, TypeError) as e:
            raise InvalidConfigError(f"malformed table spec: {e!r}") from e

    def check(self, columns: Mapping[Key, torch.Tensor], roles: tuple[str, ...], what: str) -> None:
        """Raise :class:`InvalidDataError` unless ``columns`` holds exactly the keys of ``roles``.

        ``what`` names the part of the segment being checked (``"steps"`` or ``"tail"``) in messages.
        """
        expected = {k: f for k, f in self.fields.items() if f.role in roles}
        missing = [format_key(k) for k in expected if k not in columns]
        extra = [format_key(k) for k in columns if k not in expected]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing key(s) {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected key(s) {', '.join(extra)}")
            raise InvalidDataError(f"{what} do not match the table spec: {'; '.join(parts)}")
        for key, t in columns.items():
            f = expected[key]
            if t.dtype != f.dtype or tuple(t.shape[1:]) != f.shape:
                raise InvalidDataError(
                    f"key {format_key(key)} in {what}: expected {f.describe()} per step, "
                    f"received {dtype_name(t.dtype)}{list(t.shape[1:])}"
                )
