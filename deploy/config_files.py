"""Reading ``millpond launch`` config files: YAML into plain mappings, ``--set`` applied.

Light on purpose (YAML only): the launcher reads a file's ``ray`` section with it to start
Ray while the job's heavy modules import, before :func:`~millpond.deploy.launch_config.
load_config` checks the whole file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from millpond.errors import InvalidConfigError

__all__ = ["apply_override", "one_line", "read_config_doc", "set_key"]


def read_config_doc(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A YAML config file as a mapping of sections, ``key=value`` overrides applied;
    not checked beyond being a mapping (:func:`~millpond.deploy.launch_config.load_config`
    checks it)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InvalidConfigError(f"config file {p} not found") from None
    except OSError as e:
        raise InvalidConfigError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidConfigError(f"{p} is not valid YAML: {one_line(e)}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise InvalidConfigError(
            f"{p}: expected a mapping of sections, got {doc!r} ({type(doc).__name__})"
        )
    for item in overrides:
        apply_override(doc, item)
    return doc


def apply_override(doc: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested mapping; the value is read as YAML (``1e-3``, ``[64]``)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise InvalidConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. learner.ppo.lr=1e-3")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    set_key(doc, key.strip(), value, f"--set {item!r}")


def set_key(doc: dict[str, Any], key: str, value: Any, what: str | None = None) -> None:
    """Set the dotted ``key`` (``learner.ppo.lr``) of a nested mapping to ``value``, making
    the sections on the way; ``what`` names the change in errors (the key by default)."""
    parts = key.split(".")
    node = doc
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InvalidConfigError(
                f"{what or key}: {'.'.join(parts[: depth + 1])} is not a section"
            )
        node = child
    node[parts[-1]] = value


def one_line(e: Exception) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split())
