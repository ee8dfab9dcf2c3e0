"""Experience processors named by import path, built where they run.

A :class:`ProcessorSpec` names a processor by import path
and keyword arguments, e.g. ``ProcessorSpec("millpond.actors.processors:StepFilter",
{"keep": {"path": "millpond.actors.processors:key_in", "kwargs": {"key": "task",
"values": [0, 1]}}})``: the shape of an ``actors.processors`` entry of a ``millpond launch``
config. The path is ``"package.module:Name"`` (or ``"package.module.Name"``) of an
:class:`ExperienceProcessor` class or of a factory returning one. A keyword argument that
is a mapping of ``path`` (and optionally ``kwargs``) stands for a callable (a predicate, an
annotation, a reward function): the function at ``path``, with ``kwargs`` bound as keyword
arguments (:func:`functools.partial`), so that predicates can be written as
``def keep(ted, *, option): ...``. Specs, not processors, travel to Ray actors: each actor
builds its own (they hold per-actor state). :meth:`ProcessorSpec.check` builds one once to
catch a bad path, a non-processor or bad keyword arguments before anything starts.
:func:`key_in`, :func:`label_episode` and :func:`sparse_goal_reward` are ready-made
callables for the filters, the annotator and the relabeller.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from millpond.errors import InvalidConfigError

from .policies import load_factory
from .processors import ExperienceProcessor

__all__ = ["ProcessorSpec", "build_processors", "check_processors"]


@dataclass(frozen=True)
class ProcessorSpec:
    """An experience processor named by import path, built where it runs (see the module doc).

    Attributes:
        path: ``"package.module:Name"`` or ``"package.module.Name"``: an
            :class:`ExperienceProcessor` class, or a factory returning one.
        kwargs: its keyword arguments (``None``: none). A value that is a mapping of
            ``path`` (and optionally ``kwargs``) is the callable at that path with those
            keyword arguments bound.

    Errors (:class:`~millpond.errors.InvalidConfigError`) start with the field at fault
    (``path: ...``, ``kwargs: ...``, ``kwargs.keep.path: ...``), so that a config prefixes
    its own key.
    """

    path: str = ""  # required: the default only lets a config say "path: missing"
    kwargs: Mapping[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kwargs is None:  # `kwargs:` left empty in YAML
            object.__setattr__(self, "kwargs", {})
        if isinstance(self.path, str) and not self.path:
            raise InvalidConfigError("path: missing (the processor's import path)")
        if not isinstance(self.path, str):
            raise InvalidConfigError(f"path: expected an import path, got {self.path!r}")
        if not isinstance(self.kwargs, Mapping):
            raise InvalidConfigError(f"kwargs: expected a mapping, got {self.kwargs!r}")
        if not all(isinstance(k, str) for k in self.kwargs):
            raise InvalidConfigError(f"kwargs: keys must be strings, got {list(self.kwargs)}")

    @classmethod
    def of(cls, value: ProcessorSpec | Mapping[str, Any]) -> ProcessorSpec:
        """A spec from a spec or a ``{"path": ..., "kwargs": ...}`` mapping."""
        if isinstance(value, ProcessorSpec):
            return value
        if not isinstance(value, Mapping):
            raise InvalidConfigError(
                f"expected a ProcessorSpec or a mapping with 'path' and 'kwargs', got {value!r}"
            )
        unknown = sorted(set(value) - {"path", "kwargs"})
        if unknown:
            raise InvalidConfigError(f"{unknown[0]}: unknown key (known: path, kwargs)")
        return cls(value.get("path", ""), value.get("kwargs"))

    def build(self) -> ExperienceProcessor:
        """A new processor: the object at :attr:`path` called with :attr:`kwargs`."""
        factory = _load(self.path, "processor", "path")
        kwargs = {k: _resolve(v, f"kwargs.{k}") for k, v in self.kwargs.items()}
        name = getattr(factory, "__qualname__", self.path)
        _check_arguments(factory, kwargs, "kwargs", name, partial=False)
        try:
            processor = factory(**kwargs)
        except Exception as e:
            where = "kwargs" if kwargs else "path"
            raise InvalidConfigError(f"{where}: {name}(...) failed: {_one_line(e)}") from None
        if not isinstance(processor, ExperienceProcessor):
            raise InvalidConfigError(
                f"path: {self.path!r} gave {type(processor).__name__}, not an "
                "ExperienceProcessor (a subclass of millpond.actors.ExperienceProcessor, or a "
                "factory returning one)"
            )
        return processor

    def check(self) -> None:
        """Build a processor once and discard it: a bad spec fails here, not in an actor."""
        self.build()


def check_processors(
    specs: Sequence[ProcessorSpec | Mapping[str, Any]], where: str = "processors"
) -> tuple[ProcessorSpec, ...]:
    """Specs from specs or ``{"path", "kwargs"}`` mappings, each checked (built once).

    Errors name the entry under ``where``, e.g. ``processors[1].kwargs: ...``.
    """
    if isinstance(specs, str | Mapping | ProcessorSpec) or not isinstance(specs, Sequence):
        raise InvalidConfigError(f"{where}: expected a list of processor specs, got {specs!r}")
    out = []
    for i, spec in enumerate(specs):
        try:
            spec = ProcessorSpec.of(spec)
            spec.check()
        except InvalidConfigError as e:
            raise InvalidConfigError(_entry(f"{where}[{i}]", e)) from None
        out.append(spec)
    return tuple(out)


def build_processors(
    specs: Sequence[ProcessorSpec | Mapping[str, Any]], where: str = "processors"
) -> list[ExperienceProcessor]:
    """New processors from specs (or ``{"path", "kwargs"}`` mappings), in order.

    Errors name the entry under ``where``, e.g. ``processors[1].kwargs: ...``.
    """
    out = []
    for i, spec in enumerate(specs):
        try:
            out.append(ProcessorSpec.of(spec).build())
        except InvalidConfigError as e:
            raise InvalidConfigError(_entry(f"{where}[{i}]", e)) from None
    return out


def _entry(where: str, e: InvalidConfigError) -> str:
    message = str(e)
    head = message.partition(":")[0]
    return f"{where}.{message}" if head and " " not in head else f"{where}: {message}"


def _load(path: str, what: str, where: str) -> Callable[..., Any]:
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


def _resolve(value: Any, where: str) -> Any:
    """A ``{"path": ..., "kwargs": ...}`` mapping as the callable it names; other values as is."""
    if not (isinstance(value, Mapping) and "path" in value and set(value) <= {"path", "kwargs"}):
        return value
    function = _load(value["path"], "callable", f"{where}.path")
    kwargs = value.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise InvalidConfigError(f"{where}.kwargs: expected a mapping, got {kwargs!r}")
    if not kwargs:
        return function
    kwargs = {k: _resolve(v, f"{where}.kwargs.{k}") for k, v in kwargs.items()}
    name = getattr(function, "__qualname__", value["path"])
    _check_arguments(function, kwargs, f"{where}.kwargs", name, partial=True)
    return functools.partial(function, **kwargs)


def _check_arguments(
    function: Callable[..., Any], kwargs: Mapping[str, Any], where: str, name: str, partial: bool
) -> None:
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
        (signature.bind_partial if partial else signature.bind)(**kwargs)
    except TypeError as e:
        raise InvalidConfigError(f"{where}: {name}{plain}: {e}") from None


def _one_line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
