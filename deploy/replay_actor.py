"""ReplayShardActor: one replay shard served over gRPC from inside a Ray actor.

``millpond launch`` starts the replay service this way so that Ray places, supervises and
stops the shards like every other part of the job; the shard itself is exactly what
``millpond serve`` runs (:func:`millpond.service.server.create_server`), and clients
reach it over gRPC at the address the actor reports.
"""

from __future__ import annotations

from millpond.service.server import ServerConfig, create_server, tune_shard_process

__all__ = ["ReplayShardActor"]


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

    def address(self) -> str:
        """``host:port`` of this shard's gRPC server."""
        return self._address

    def stop(self, grace_s: float = 5.0) -> bool:
        """Finish in-flight calls, checkpoint every table, close the shard."""
        self._server.stop(grace_s)
        return True
