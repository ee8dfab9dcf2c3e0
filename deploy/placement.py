"""Where a job's Ray actors go: the ``.options`` a role's resources and node labels make,
the hint an error gives when they find no room, where they went, and an actor's death told
in one line."""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["located", "placement", "placement_hint"]


def placement(resources: dict[str, float], labels: dict[str, str]) -> dict[str, Any]:
    """Ray ``.options`` for a role's custom resources and node labels (none when unset)."""
    options: dict[str, Any] = {}
    if resources:
        options["resources"] = dict(resources)
    if labels:
        options["label_selector"] = dict(labels)
    return options


def placement_hint(section: Any) -> str:
    """``, on nodes with ...``: the resources and labels a config section asks for."""
    parts = [f"resources {section.resources}" if section.resources else ""]
    parts.append(f"labels {section.label_selector}" if section.label_selector else "")
    wanted = " and ".join(p for p in parts if p)
    return f", on nodes with {wanted}" if wanted else ""


def located(refs: list[Any], timeout_s: float) -> list[Any]:
    """The answers of calls that asked actors where they run (``__ray_call__`` of
    :func:`~millpond.deploy.learner_actor.where`), waiting ``timeout_s`` at most: ``None``
    for an actor that did not answer or died."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return [_value(r) if r in ready else None for r in refs]


def _value(ref: Any) -> Any:
    """A finished Ray call's value, ``None`` if it failed (its actor died)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None
