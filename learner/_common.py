"""Small helpers the reference learners share: argument checks and the published version."""

from __future__ import annotations

from millpond.errors import InvalidConfigError
from millpond.learner.client import ReplayClient


def published_version(client: ReplayClient) -> int:
    """The weight version shard 0 holds now, ``-1`` if none (or if it cannot say)."""
    version = client.info().get("weights_version")
    return -1 if version is None else int(version)


def check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidConfigError(f"{name} ({value!r}) must be an integer >= {low}")


def check_number(name: str, value: object, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise InvalidConfigError(f"{name} ({value!r}) must be a number >= 0")
    if positive and value == 0:
        raise InvalidConfigError(f"{name} ({value!r}) must be > 0")
