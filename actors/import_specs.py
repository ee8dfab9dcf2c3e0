"""Things named by import path in configs: a ``path`` and its keyword arguments.

An :class:`ImportSpec` is the shape of a ``{"path": ..., "kwargs": ...}`` entry of a
``millpond launch`` config (an experience processor, an env wrapper). The path is
``"package.module:Name"`` or ``"package.module.Name"``. Specs, not the objects they name,
travel to Ray actors, so they are checked where the config is read and built where they run.
Errors (:class:`~millpond.errors.InvalidConfigError`) start with the field at fault
(``path: ...``, ``kwargs: ...``) so that a config prefixes its own key (:func:`entry_error`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from millpond.errors import InvalidConfigError

from .policies import load_factory

__all__ = ["ImportSpec", "check_arguments", "entry_error", "load_path", "one_line"]


@dataclass(frozen=True)
class ImportSpec:
    """Something named by import path, with its keyword arguments (see the module doc).

    Attributes:
        path: ``"package.module:Name"`` or ``"package.module.Name"``.
        kwargs: its keyword arguments (``None``: none).
    """

    path: str = ""  # required: the default only lets a config say "path: missing"
    kwargs: Mapping[str, Any] | None = field(default_factory=dict)

    #: What the path names, for messages ("processor", "wrapper").
    what: ClassVar[str] = "object"

    def __post_init__(self) -> None:
        if self.kwargs is None:  # `kwargs:` left empty in YAML
            object.__setattr__(self, "kwargs", {})
        if isinstance(self.path, str) and not self.path:
            raise InvalidConfigError(f"path: missing (the {self.what}'s import path)")
        if not isinstance(self.path, str):
            raise InvalidConfigError(f"path: expected an import path, got {self.path!r}")
        if not isinstance(self.kwargs, Mapping):
            raise InvalidConfigError(f"kwargs: expected a mapping, got {self.kwargs!r}")
        if not all(isinstance(k, str) for k in self.kwargs):
            raise InvalidConfigError(f"kwargs: keys must be strings, got {list(self.kwargs)}")

    def check(self) -> None:
        """Refuse a spec that cannot be built (subclasses load or build it once)."""

    @classmethod
    def check_all(cls, specs: Any, where: str) -> tuple[Any, ...]:
        """Specs from specs or ``{"path", "kwargs"}`` mappings, each checked; errors name the
        entry under ``where``, e.g. ``processors[1].kwargs: ...``."""
        if isinstance(specs, str | Mapping | ImportSpec) or not isinstance(specs, Sequence):
            raise InvalidConfigError(f"{where}: expected a list of {cls.what} specs, got {specs!r}")
        out = []
        for i, spec in enumerate(specs):
            try:
                spec = cls.of(spec)
                spec.check()
            except InvalidConfigError as e:
                raise InvalidConfigError(entry_error(f"{where}[{i}]", e)) from None
            out.append(spec)
        return tuple(out)

    @classmethod
    def of(cls, value: Any) -> Any:
        """A spec from a spec or a ``{"path": ..., "kwargs": ...}`` mapping."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidConfigError(
                f"expected a {cls.__name__} or a mapping with 'path' and 'kwargs', got {value!r}"
            )
        unknown = sorted(set(value) - {"path", "kwargs"})
        if unknown:
            raise InvalidConfigError(f"{unknown[0]}: unknown key (known: path, kwargs)")
        return cls(value.get("path", ""), value.get("kwargs"))


def load_path(path: str, what: str, where: str) -> Callable[..., Any]:
    """The callable at ``path``; errors start with ``where``."""
    if not isinstance(path, str):
        raise InvalidConfigError(f"{where}: expected an import path, got {path!r}")
    spec = path
    if ":" not in path and "." in path:  # "package.module.Name"
        module, _, name = path.rpartition(".")
        spec = f"{module}:{name}"
    try:
        return load_factory(spec, what)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"{where}: {e}") from None


def check_arguments(
    function: Callable[..., Any],
    kwargs: Mapping[str, Any],
    where: str,
    name: str,
    *,
    partial: bool = False,
    leading: int = 0,
) -> None:
    """Refuse ``kwargs`` that ``function``'s signature does not take, naming the argument.

    ``partial``: other required arguments may be given later; ``leading``: that many
    positional arguments come first (a wrapper's env).
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have none: calling them will tell
        return
    params = signature.parameters.values()
    plain = signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in params],
        return_annotation=inspect.Signature.empty,
    )
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        unknown = [k for k in kwargs if k not in signature.parameters]
        if unknown:
            raise InvalidConfigError(f"{where}: {name}{plain} has no argument {unknown[0]!r}")
    try:
        (signature.bind_partial if partial else signature.bind)(*[None] * leading, **kwargs)
    except TypeError as e:
        raise InvalidConfigError(f"{where}: {name}{plain}: {e}") from None


def entry_error(where: str, e: InvalidConfigError) -> str:
    """``e``'s message under the config entry ``where`` (``processors[1].kwargs: ...``)."""
    message = str(e)
    head = message.partition(":")[0]
    return f"{where}.{message}" if head and " " not in head else f"{where}: {message}"


def one_line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
