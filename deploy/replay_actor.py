"""ReplayShardActor: one replay shard served over gRPC from inside a Ray actor.

``millpond launch`` starts the replay service this way so that Ray places, supervises and
stops the shards like every other part of the job; the shard itself is exactly what
``millpond serve`` runs (:func:`millpond.service.server.create_server`), and clients
reach it over gRPC at the address the actor reports.

A shard actor is pinned to its node (``NodeAffinitySchedulingStrategy(node, soft=False)``)
and restarted there by Ray (``replay.max_restarts``): it reopens its tables from its
directory, and serves on a port of its own choosing, which may differ from the last one.
Clients find it through :class:`ShardAddresses`, a resolver (see
:mod:`millpond.learner.client._shards`) that looks the shard's actor up by its name and asks it for
its address: Ray routes the question to the restarted actor, and answers that the actor is
dead for good when its restarts are spent or its node is gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from millpond.service.server import ServerConfig, create_server, tune_shard_process

__all__ = ["ReplayShardActor", "ShardAddresses"]

#: How long a resolver waits for a shard's actor to say where it serves.
RESOLVE_TIMEOUT_S = 2.0


class ReplayShardActor:
    """The body of the Ray actor (``ray.remote(ReplayShardActor)``).

    Args:
        config: the shard server's config (directory, host, port, tables...).
        advertise_host: the host clients should dial; ``None``: loopback when bound to
            loopback, else this node's IP address as Ray knows it.
    """

    def __init__(self, config: ServerConfig, advertise_host: str | None = None) -> None:
        tune_shard_process()  # this actor's process serves only its shard
        self._server, port = create_server(config)
        host = advertise_host
        if host is None:
            host = config.host
            if host in ("0.0.0.0", "::", ""):
                import ray

                host = ray.util.get_node_ip_address()
        self._address = f"{host}:{port}"
        self._metrics_host = host

    def address(self) -> str:
        """``host:port`` of this shard's gRPC server."""
        return self._address

    def status(self) -> dict[str, Any]:
        """Where this shard serves: ``address``, ``metrics`` (``host:port`` of its Prometheus
        endpoint, or ``None``), ``pid`` (a restarted shard has a new one), ``node_id`` and
        ``ip``."""
        import ray

        port = self._server.metrics_port
        return {
            "address": self._address,
            "metrics": None if port is None else f"{self._metrics_host}:{port}",
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def stop(self, grace_s: float = 5.0) -> bool:
        """Finish in-flight calls, checkpoint every table, close the shard."""
        self._server.stop(grace_s)
        return True


class ShardAddresses:
    """A client's resolver for the shards of a job: ``resolver(index)`` looks up shard
    ``index``'s Ray actor by its name and asks it for its address.

    Returns the address, or ``None`` while the actor does not answer (Ray is restarting
    it); raises :class:`~millpond.errors.ShardGoneError` once Ray says the actor
    is dead for good (restarts spent) or cannot be placed again (its node is gone). Holds
    only the actors' names and namespace, so it pickles small and travels with a
    :class:`~millpond.learner.ReplayClient` to env actors and learners (whose constructor
    arguments then stay inline, as Ray wants for actors it restarts).

    Args:
        names: the shard actors' names, shard 0 first.
        namespace: their Ray namespace.
        timeout_s: how long one question waits for the actor.
    """

    def __init__(
        self, names: Sequence[str], namespace: str, timeout_s: float = RESOLVE_TIMEOUT_S
    ) -> None:
        self.names = list(names)
        self.namespace = namespace
        self.timeout_s = timeout_s

    def __call__(self, index: int) -> str | None:
        import ray

        from millpond.errors import ShardGoneError

        # A call that was under way when the process died fails as if the actor were dead
        # even when Ray restarts it: only a second question, asked after, says it for sure.
        for attempt in range(2):
            try:
                actor = ray.get_actor(self.names[index], namespace=self.namespace)
                return ray.get(actor.address.remote(), timeout=self.timeout_s)
            except (
                ValueError,  # no live actor of that name: dead for good
                ray.exceptions.ActorDiedError,
                ray.exceptions.ActorUnschedulableError,
            ) as e:
                if attempt == 1:
                    raise ShardGoneError(f"its Ray actor is gone: {_first_line(e)}") from None
                time.sleep(0.5)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                return None  # restarting: ask again later
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
