"""What the reference learners share beyond the ground floor's checks: the published version."""

from __future__ import annotations

from millpond.learner.client import ReplayClient


def published_version(client: ReplayClient) -> int:
    """The weight version the weights rendezvous holds now, ``-1`` if none (or if it
    cannot say)."""
    version = client.info().get("weights_version")
    return -1 if version is None else int(version)
