"""Colocated sampling on the client: which shards' tables are read from their files, and
the batches read so.

A shard reports, per table, its host identity, the table's storage directory and the token
written in it (``TableInfo``). :class:`Colocation` decides from that whether this client
asks a shard for the slots only (``SampleRequest.colocated``) and reads the observation rows
itself (:class:`~millpond.colocated.ColocatedReader`), and keeps the opened readers.
:func:`~millpond.protos.samples.decode_colocated` turns such an answer into the TED batch
the wire would have sent, with the rows whose slots were overwritten while they were read
marked for a redraw.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from millpond.colocated import ColocatedReader, host_id
from millpond.errors import ColocationError, MillpondError
from millpond.learner.client._channels import TLS, open_channel
from millpond.learner.client._masses import ShardMasses
from millpond.learner.client._shards import ShardHandle
from millpond.protos import millpond_pb2_grpc as pb_grpc

#: A table whose files could not be opened is tried again after this many seconds (or as
#: soon as its shard reports another storage token).
RETRY_OPEN_S = 30.0

_QUEUE = (
    "it is a queue table: a delivered queue segment may be overwritten at once, so its "
    "rows travel with the answer"
)


class Colocation:
    """Colocated reads of one client.

    Args:
        mode: ``None``: read a table's files where its shard is on this host and they open,
            else use the wire; ``True``: always, or :class:`ColocationError` saying why not;
            ``False``: never.
        masses: the client's table infos (where each shard's tables are stored).
    """

    def __init__(
        self,
        mode: bool | None,
        masses: ShardMasses,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLS = None,
    ) -> None:
        self.mode = mode
        self._masses = masses
        # A colocated answer is small: the default's extra thread per streaming call (to
        # drive it) would cost as much as the call itself.
        self._options = [*options, ("SingleThreadedUnaryStream", 1)]
        self._tls = tls
        self._channels: dict[int, tuple[str, grpc.Channel, pb_grpc.ReplayStub]] = {}
        self._lock = threading.Lock()
        self._host: str | None = None
        self._readers: dict[tuple[int, str], ColocatedReader] = {}
        # (shard index, table) -> (storage token, when, why it could not be opened)
        self._refused: dict[tuple[int, str], tuple[str, float, str]] = {}

    def stub(self, shard: ShardHandle) -> pb_grpc.ReplayStub:
        """A stub of ``shard`` for colocated Sample calls, on a channel of its own whose
        streaming calls run on the calling thread."""
        with self._lock:
            found = self._channels.get(shard.index)
            if found is None or found[0] != shard.address:
                channel = open_channel(shard.address, self._options, self._tls)
                found = (shard.address, channel, pb_grpc.ReplayStub(channel))
                self._channels[shard.index] = found
            return found[2]

    def close(self) -> None:
        """Close the channels of :meth:`stub` (the readers' maps go with them)."""
        with self._lock:
            channels, self._channels = self._channels, {}
            self._readers = {}
        for _, channel, _ in channels.values():
            channel.close()

    def read_shards(self, table: str) -> list[int]:
        """The shards whose ``table`` has an open reader, in order."""
        with self._lock:
            return sorted(index for index, name in self._readers if name == table)

    def wanted(self, shard: ShardHandle, table: str) -> bool:
        """Whether to ask ``shard`` for ``table``'s slots only (and read the rows here).

        Raises :class:`ColocationError` (naming the shard, the table and why) when the mode
        is ``True`` and the table cannot be read on this host.
        """
        if self.mode is False:
            return False
        reason = self._why_not(shard, table)
        if reason is None:
            return True
        if self.mode:
            raise ColocationError(
                f"colocated=True: shard {shard.address}, table {table!r} cannot be read from "
                f"its files on this host: {reason}"
            )
        return False

    def reader(self, shard: ShardHandle, table: str, token: str) -> ColocatedReader | None:
        """The reader of the files of ``table`` whose storage token is ``token`` (what the
        shard's answer names); ``None`` where they cannot be opened (the mode is not
        ``True``: then it raises :class:`ColocationError`)."""
        key = (shard.index, table)
        with self._lock:
            found = self._readers.get(key)
        if found is not None and found.token == token:
            return found
        info = self._masses.infos.get(key)
        if info is None or info["storage_token"] != token or info["config"].spec is None:
            # The table was made anew (or its spec has come since): read where it is now.
            with contextlib.suppress(MillpondError):
                self._masses.refresh(table, [shard])
        reason = self._why_not(shard, table)
        if reason is None:
            with self._lock:
                found = self._readers.get(key)
            if found is not None and found.token == token:
                return found
            reason = f"the shard sampled files of storage token {token!r}, now gone"
        if self.mode:
            raise ColocationError(
                f"colocated=True: shard {shard.address}, table {table!r} cannot be read from "
                f"its files on this host: {reason}"
            )
        return None

    def _why_not(self, shard: ShardHandle, table: str) -> str | None:
        """Why ``table`` of ``shard`` cannot be read here (``None``: it can, and its reader
        is open, or its spec is not known yet: nothing is stored to read)."""
        key = (shard.index, table)
        info: dict[str, Any] | None = self._masses.infos.get(key)
        if info is None:
            return "the shard has not reported the table"
        config = info["config"]
        if config.sampler == "queue":
            return _QUEUE
        token = info["storage_token"]
        if not token:
            return "the shard offers no colocated reads (its table directory takes no token)"
        if self._host is None:
            self._host = host_id()
        if info["host_id"] != self._host:
            return f"the shard runs on another host ({info['host_id']!r}, this is {self._host!r})"
        if config.spec is None:
            return None
        with self._lock:
            reader = self._readers.get(key)
            if reader is not None and reader.token == token:
                return None
            refused = self._refused.get(key)
            now = time.monotonic()
            if refused is not None and refused[0] == token and now - refused[1] < RETRY_OPEN_S:
                return refused[2]
            try:
                reader = ColocatedReader(
                    info["storage_dir"], token, config.capacity, config.spec, config.frame_stacks
                )
            except ColocationError as e:
                self._refused[key] = (token, now, str(e))
                return str(e)
            self._readers[key] = reader
            self._refused.pop(key, None)
        return None
