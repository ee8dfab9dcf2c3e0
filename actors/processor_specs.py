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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from millpond.errors import InvalidConfigError

from .import_specs import ImportSpec, check_arguments, entry_error, load_path, one_line
from .processors import ExperienceProcessor

__all__ = ["ProcessorSpec", "build_processors", "check_processors"]


@dataclass(frozen=True)
class ProcessorSpec(ImportSpec):
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

    what: ClassVar[str] = "processor"

    def build(self) -> ExperienceProcessor:
        """A new processor: the object at :attr:`path` called with :attr:`kwargs`."""
        factory = load_path(self.path, "processor", "path")
        kwargs = {k: _resolve(v, f"kwargs.{k}") for k, v in self.kwargs.items()}
        name = getattr(factory, "__qualname__", self.path)
        check_arguments(factory, kwargs, "kwargs", name)
        try:
            processor = factory(**kwargs)
        except Exception as e:
            where = "kwargs" if kwargs else "path"
            raise InvalidConfigError(f"{where}: {name}(...) failed: {one_line(e)}") from None
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
    return ProcessorSpec.check_all(specs, where)


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
            raise InvalidConfigError(entry_error(f"{where}[{i}]", e)) from None
    return out


def _resolve(value: Any, where: str) -> Any:
    """A ``{"path": ..., "kwargs": ...}`` mapping as the callable it names; other values as is."""
    if not (isinstance(value, Mapping) and "path" in value and set(value) <= {"path", "kwargs"}):
        return value
    function = load_path(value["path"], "callable", f"{where}.path")
    kwargs = value.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise InvalidConfigError(f"{where}.kwargs: expected a mapping, got {kwargs!r}")
    if not kwargs:
        return function
    kwargs = {k: _resolve(v, f"{where}.kwargs.{k}") for k, v in kwargs.items()}
    name = getattr(function, "__qualname__", value["path"])
    check_arguments(function, kwargs, f"{where}.kwargs", name, partial=True)
    return functools.partial(function, **kwargs)
