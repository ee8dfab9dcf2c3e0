"""Keep torch's compiler front end (``torch._dynamo``) out of processes that never compile.

tensordict marks a few functions for ``torch.compile`` as it imports
(``torch.compiler.allow_in_graph`` and ``assume_constant_result``), and each mark imports
``torch._dynamo``: ~1 s of CPU per process. Of a job's processes only a learner needs it
(``torch.optim`` imports it on an optimizer's first use); a shard, an env actor and the
driver import tensordict and never compile, and on a small machine their imports are most
of a job's start.

So while tensordict imports, those marks are recorded instead of applied, and when
``torch._dynamo`` is first imported (by an optimizer, ``torch.compile``, anything) the
recorded marks are applied to it, before any code can be compiled. Both marks return the
function they are given, so what tensordict keeps is the same object either way, and a
process that compiles ends with the same marks as one that imported tensordict plainly.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType

#: The marks tensordict applies at import that would import ``torch._dynamo``.
_MARKS = ("allow_in_graph", "assume_constant_result")
_DYNAMO = "torch._dynamo"

_recorded: list[tuple[str, Callable]] = []
_lock = threading.Lock()


@contextlib.contextmanager
def _marks_recorded() -> Iterator[None]:
    """``torch.compiler``'s marks record their function while this lasts, unless
    ``torch._dynamo`` is loaded already (then they apply as usual)."""
    import torch.compiler

    originals = {name: getattr(torch.compiler, name, None) for name in _MARKS}

    def recording(name: str, original: Callable) -> Callable:
        def mark(fn):
            with _lock:
                if _DYNAMO not in sys.modules:
                    _recorded.append((name, fn))
                    return fn
            return original(fn)

        return mark

    for name, original in originals.items():
        if original is not None:
            setattr(torch.compiler, name, recording(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(torch.compiler, name, original)


def _apply_recorded(dynamo: ModuleType) -> None:
    """Apply the recorded marks to the just-imported ``torch._dynamo``."""
    with _lock:
        recorded = list(_recorded)
        _recorded.clear()
    for name, fn in recorded:
        try:
            getattr(dynamo, name)(fn)
        except Exception as exc:  # a torch whose marks changed: compile still works, unmarked
            warnings.warn(
                f"millpond: could not apply torch.compiler.{name} to {fn!r} that tensordict "
                f"asked for as it imported ({exc}); torch.compile may trace into it",
                RuntimeWarning,
                stacklevel=2,
            )


class _Around(importlib.abc.Loader):
    """A module's own loader, with something run around (``around``) or after (``after``)
    its execution."""

    def __init__(self, loader, around=None, after=None) -> None:
        self._loader, self._around, self._after = loader, around, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Introspection (reload, resources, tracebacks) sees the module's own loader.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with self._around() if self._around else contextlib.nullcontext():
            self._loader.exec_module(module)
        if self._after:
            self._after(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of tensordict and ``torch._dynamo`` as they are first found."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "tensordict":
            if _DYNAMO in sys.modules:
                return None
            wrap = {"around": _marks_recorded}
        elif fullname == _DYNAMO:
            wrap = {"after": _apply_recorded}
        else:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Around(spec.loader, **wrap)
        return spec


def install() -> None:
    """Record tensordict's compiler marks until ``torch._dynamo`` is imported (idempotent;
    nothing to do in a process that imported either already)."""
    if "tensordict" in sys.modules or _DYNAMO in sys.modules:
        return
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
