"""The replay shards a ``millpond launch`` job starts, and the driver's watch over them.

:class:`ShardSupervisor` places ``replay.shards``
:class:`~millpond.deploy.replay_actor.ReplayShardActor` Ray actors, each pinned to its node
(restarted there by Ray, on its directory, or not at all), and at the end checkpoints and
stops the ones still there. :class:`ShardWatch` keeps one ``status`` call in flight per
shard, so that the job sees a shard restarted (a new process, perhaps a new port) or lost
for good, and says so. :func:`connect` opens the job's clients to its shards (or to a
running service named with ``--replay``) and creates its table there.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from millpond.actors.remote_errors import first_line, from_remote
from millpond.deploy.learner_actor import where
from millpond.deploy.placement import placement, placement_hint
from millpond.deploy.replay_actor import ReplayShardActor, ShardAddresses
from millpond.errors import AuthenticationError, MillpondError, PermissionDeniedError
from millpond.learner.client import ReplayClient
from millpond.service.server import ServerConfig

if TYPE_CHECKING:
    from millpond.deploy.launch_config import LaunchConfig

__all__ = ["ShardSupervisor", "ShardWatch", "connect"]

#: Seconds the driver waits for a shard's answer to ``status`` before asking again.
_STATUS_PATIENCE_S = 3.0


def connect(
    config: LaunchConfig,
    addresses: str,
    resolver: ShardAddresses | None,
    tokens: tuple[str | None, str | None],
) -> tuple[ReplayClient, ReplayClient, str]:
    """The job's clients of the service at ``addresses``: its own (with the admin token of
    ``tokens``) and the env actors' (the writer token, the least privilege the token file
    offers), and the name of the table it created there."""
    c = config
    admin_token, writer_token = tokens
    client = ReplayClient(addresses, token=admin_token, tls=c.replay.tls, resolver=resolver)
    actor_client = client
    if writer_token != admin_token:
        actor_client = ReplayClient(
            addresses, token=writer_token, tls=c.replay.tls, resolver=resolver
        )
    try:
        table = client.create_table(c.replay.table_config()).name
    except (AuthenticationError, PermissionDeniedError) as e:
        hint = (
            "give replay.token_file an 'admin' token the service accepts"
            if c.replay.token_file is None or isinstance(e, AuthenticationError)
            else "the token file's first 'admin' token lacks the admin role there"
        )
        raise type(e)(f"replay service {addresses}: {e} ({hint})") from None
    return client, actor_client, table


class ShardSupervisor:
    """The shard actors of one job: started by :meth:`start`, watched by :attr:`watch`,
    checkpointed and stopped at the end.

    Args:
        config: the job's config (its ``replay`` and ``ray`` sections).
        run_dir: the run directory; shard ``i`` stores under ``replay/shard-i``.
    """

    def __init__(self, config: LaunchConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.actors: list[Any] = []
        self.names: list[str] = []
        self.watch: ShardWatch | None = None
        self.node_refs: list[Any] = []  # each shard's node, asked as it starts

    def start(self) -> str:
        """Place and start the shards; their addresses, ``host:port,...``."""
        c = self.config
        host = "127.0.0.1" if c.ray.address is None else "0.0.0.0"
        token_file = c.replay.token_file
        nodes = self._nodes()
        prefix = f"millpond-shard-{uuid.uuid4().hex[:8]}"
        self.names = [f"{prefix}-{i}" for i in range(len(nodes))]
        for i, node in enumerate(nodes):
            server = ServerConfig(
                dir=str((self.run_dir / "replay" / f"shard-{i}").resolve()),
                host=host,
                port=0,
                max_message_mb=c.replay.max_message_mb,
                token_file=None if token_file is None else str(Path(token_file).resolve()),
                metrics_port=(
                    None
                    if c.replay.metrics_port is None
                    else c.replay.metrics_port and c.replay.metrics_port + i
                ),
            )
            # Pinned to its node: restarted there, on its directory, or not at all.
            remote = ray.remote(ReplayShardActor).options(
                name=self.names[i],  # clients look it up by name (ShardAddresses)
                num_cpus=c.replay.num_cpus,
                max_restarts=c.replay.max_restarts,
                max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                **placement(c.replay.resources, {}),
            )
            self.actors.append(remote.remote(server))
        try:
            addresses = ray.get(
                [s.address.remote() for s in self.actors], timeout=c.replay.start_timeout_s
            )
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnschedulableError):
            for shard in self.actors:  # unplaced actors would make shutdown wait for them
                ray.kill(shard)
            self.actors.clear()
            raise self._unplaced() from None
        except ray.exceptions.RayError as e:  # a shard that failed to start: its own error
            for shard in self.actors:
                ray.kill(shard)
            self.actors.clear()
            raise from_remote(e, "a replay shard failed to start") from e
        self.node_refs = [s.__ray_call__.remote(where) for s in self.actors]
        self.watch = ShardWatch(self.actors, addresses, c.replay.max_restarts)
        self.watch.poll(wait_s=5.0)  # where each serves (and its metrics endpoint)
        return ",".join(addresses)

    def _nodes(self) -> list[str]:
        """The node of each shard: where Ray reserves the shards' resources (CPUs, custom
        resources, labels) all at once, as one placement group that is then released."""
        c = self.config
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) == 1 and not c.replay.resources and not c.replay.label_selector:
            return [alive[0]["NodeID"]] * c.replay.shards  # one node: nothing to choose
        bundle = {"CPU": c.replay.num_cpus, **c.replay.resources}
        bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
        labels = dict(c.replay.label_selector)
        group = placement_group(
            [dict(bundle) for _ in range(c.replay.shards)],
            strategy="PACK",
            bundle_label_selector=[dict(labels) for _ in range(c.replay.shards)]
            if labels
            else None,
        )
        try:
            ray.get(group.ready(), timeout=c.replay.start_timeout_s)
            placed = placement_group_table(group)["bundles_to_node_id"]
            return [placed[i] for i in range(c.replay.shards)]
        except ray.exceptions.GetTimeoutError:
            raise self._unplaced() from None
        finally:
            remove_placement_group(group)

    def _unplaced(self) -> MillpondError:
        c = self.config
        needed = c.replay.shards * c.replay.num_cpus
        return MillpondError(
            f"replay shards did not start within replay.start_timeout_s="
            f"{c.replay.start_timeout_s:g} s: they need {needed:g} CPUs free in the Ray "
            f"cluster (replay.shards x replay.num_cpus){placement_hint(c.replay)}; see "
            "`ray status`"
        )

    def resolver(self) -> ShardAddresses:
        """What a client asks for a restarted shard's new port, or whether it is gone."""
        return ShardAddresses(self.names, ray.get_runtime_context().namespace)

    @property
    def lost(self) -> dict[int, str]:
        """The shards lost for good, and why."""
        return self.watch.lost if self.watch is not None else {}

    def poll(self, wait_s: float = 0.0) -> list[str]:
        """The restarts and losses seen since the last poll, a line each."""
        return self.watch.poll(wait_s) if self.watch is not None else []

    def note(self) -> str:
        """What the progress line adds while shards are lost: ``shards LIVE/COUNT``."""
        watch = self.watch
        if watch is None or not watch.lost:
            return ""
        return (
            f"  shards {watch.live}/{len(watch.shards)} (lost: {', '.join(map(str, watch.lost))})"
        )

    def checkpoint_live(self, client: ReplayClient) -> None:
        """Checkpoint the shards that are still there (the lost ones cannot be)."""
        c = self.config
        for i, address in enumerate(client.addresses):
            if i in self.lost:
                continue
            one = ReplayClient(address, token=c.replay.tokens()[0], tls=c.replay.tls)
            try:
                one.checkpoint()
            finally:
                one.close(timeout_s=5)

    def stop(self) -> None:
        """Stop the shards still there (each checkpoints its table as it stops)."""
        live = [s for i, s in enumerate(self.actors) if i not in self.lost]
        ray.get([s.stop.remote() for s in live], timeout=60)


class ShardWatch:
    """The driver's view of the shard actors it started: which restarted (a new process:
    a new pid, perhaps a new port) and which are lost for good, from one ``status`` call
    kept in flight per shard."""

    def __init__(self, shards: list[Any], addresses: list[str], max_restarts: int) -> None:
        self.shards = shards
        self.addresses = list(addresses)
        self.max_restarts = max_restarts
        self.status: list[dict[str, Any] | None] = [None] * len(shards)
        self.restarts = [0] * len(shards)
        self.lost: dict[int, str] = {}
        self._strikes = [0] * len(shards)
        self._inflight: dict[Any, int] = {}
        self._asked_at: dict[Any, float] = {}

    @property
    def live(self) -> int:
        """How many shards are not lost."""
        return len(self.shards) - len(self.lost)

    def poll(self, wait_s: float = 0.0) -> list[str]:
        """Collect the answers that came; returns a line for each restart or loss seen."""
        now = time.monotonic()
        for ref, asked in list(self._asked_at.items()):
            if now - asked > _STATUS_PATIENCE_S:  # a call Ray holds across a restart: ask anew
                self._inflight.pop(ref, None)
                self._asked_at.pop(ref)
        busy = set(self._inflight.values())
        for i, shard in enumerate(self.shards):
            if i not in self.lost and i not in busy:
                ref = shard.status.remote()
                self._inflight[ref] = i
                self._asked_at[ref] = now
        if not self._inflight:
            return []
        ready, _ = ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=wait_s)
        events = []
        for ref in ready:
            i = self._inflight.pop(ref)
            self._asked_at.pop(ref, None)
            try:
                status = ray.get(ref)
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError) as e:
                # A call under way when the process died fails so even if Ray restarts it:
                # the next call, made after, says whether the actor is gone.
                self._strikes[i] += 1
                if self._strikes[i] >= 2:
                    self.lost[i] = first_line(e)
                    events.append(
                        f"replay shard {i} ({self.addresses[i]}) is lost for good "
                        f"({self.lost[i]}); going on with {self.live} of {len(self.shards)} "
                        "shards: its stored steps are gone with it, and the env actors write "
                        "new episodes to the others"
                    )
                continue
            except ray.exceptions.RayActorError:  # being restarted: ask again
                continue
            self._strikes[i] = 0
            before = self.status[i]
            self.status[i] = status
            if before is not None and status["pid"] != before["pid"]:
                self.restarts[i] += 1
                moved = (
                    f"now at {status['address']}"
                    if status["address"] != self.addresses[i]
                    else f"at {status['address']}"
                )
                events.append(
                    f"replay shard {i} restarted on its node, on its directory "
                    f"(restart {self.restarts[i]} of replay.max_restarts="
                    f"{self.max_restarts}), {moved}"
                )
            self.addresses[i] = status["address"]
        return events

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``: the shard count, how many are live, the lost ones and why,
        the restarts, and each shard's address, metrics endpoint and node."""
        return {
            "count": len(self.shards),
            "live": self.live,
            "lost": {str(i): why for i, why in sorted(self.lost.items())},
            "restarts": sum(self.restarts),
            "shards": [
                {
                    "shard": i,
                    "address": self.addresses[i],
                    "metrics": (s or {}).get("metrics"),
                    "node_id": (s or {}).get("node_id"),
                    "ip": (s or {}).get("ip"),
                    "restarts": self.restarts[i],
                    "lost": i in self.lost,
                }
                for i, s in enumerate(self.status)
            ],
        }
