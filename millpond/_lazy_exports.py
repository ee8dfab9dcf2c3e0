"""A package's public names, each imported from its module on first use (PEP 562).

A process that needs one part of a package (a shard, an env actor, the CLI) then does not
pay for the imports of the others (torch, tensordict, grpc, the reference learners).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, public: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``public`` (name -> the module
    that defines it) is imported on first use and kept in ``namespace``, the package's
    globals, so that the next use finds it there."""

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
