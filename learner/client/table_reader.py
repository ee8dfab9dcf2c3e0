"""A consistent snapshot of a table read from a running service (the ReadTable RPC).

:meth:`ReplayClient.read_table <millpond.learner.client.ReplayClient.read_table>` opens one
ReadTable stream per shard, all at once, so that every shard pins its snapshot at about the
same instant: the segments it had published then, each read whole while inserts go on.
Iterating a :class:`TableReader` yields them as :class:`~millpond.segments.PackedSegments`,
shard after shard, each shard's oldest first, with their episode ids and first steps. What
inserts overwrote before it was read is left out and counted
(:attr:`TableReader.overwritten_segments`): a ring evicts its oldest segments first, so each
episode's steps that do arrive are still one unbroken run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from millpond.config import TableConfig
from millpond.errors import MillpondError
from millpond.learner.client._errors import from_rpc_error
from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb
from millpond.protos.tables import config_from_proto
from millpond.segments import PackedSegments, pack_columns

__all__ = ["TableReader"]

#: What a shard's end message counts, summed into the reader's attributes of those names.
_END_COUNTS = ("overwritten_segments", "overwritten_steps", "cut_segments", "cut_steps")


class TableReader:
    """The snapshot of one table on every shard of a client; iterate it once for its segments.

    Attributes:
        table: the table's name.
        config: the table's config as the first shard that holds data reports it (its spec
            included), else shard 0's.
        segments, steps: what the shards pinned, summed (what the iteration yields, less
            what is overwritten before it is read).
        shards: per shard, ``{"address", "segments", "steps"}`` as pinned, and after the
            iteration ``"overwritten_segments"``, ``"overwritten_steps"``,
            ``"cut_segments"`` and ``"cut_steps"``.
        overwritten_segments, overwritten_steps: overwritten by inserts before they were
            read, and so left out, summed over the shards (known once the iteration ends).
        cut_segments, cut_steps: left out because an earlier segment of their episode was
            overwritten after another one of it was read, so that each episode's steps stay
            one unbroken run (likewise).

    Use it as a context manager, or :meth:`close` it: the streams of a reader not read to
    the end are cancelled, so that the shards stop reading.
    """

    def __init__(self, shards: Sequence[Any], table: str, metadata: Any, max_bytes: int) -> None:
        self.table = table
        self._max_bytes = max_bytes
        request = pb.ReadTableRequest(table=table, max_message_bytes=max_bytes)
        self._calls: list[tuple[Any, Any]] = []
        try:
            for shard in shards:  # every stream opens (and pins) before any is read
                self._calls.append((shard, shard.stub.ReadTable(request, metadata=metadata)))
            headers = [self._next(shard, call) for shard, call in self._calls]
        except BaseException:
            self.close()
            raise
        self.shards: list[dict[str, Any]] = []
        for (shard, _), message in zip(self._calls, headers, strict=True):
            if message is None or not message.HasField("snapshot"):
                self.close()
                raise MillpondError(f"shard {shard.address}: ReadTable sent no snapshot first")
            self.shards.append(
                {
                    "address": shard.address,
                    "segments": int(message.snapshot.segments),
                    "steps": int(message.snapshot.steps),
                }
            )
        configs = [config_from_proto(m.snapshot.config) for m in headers]
        self.config: TableConfig = next((c for c in configs if c.spec is not None), configs[0])
        self.segments = sum(s["segments"] for s in self.shards)
        self.steps = sum(s["steps"] for s in self.shards)
        self.overwritten_segments = 0
        self.overwritten_steps = 0
        self.cut_segments = 0
        self.cut_steps = 0
        self._started = False

    def __iter__(self) -> Iterator[PackedSegments]:
        if self._started:
            raise MillpondError("a TableReader is read once: call read_table again")
        self._started = True
        try:
            for (shard, call), info in zip(self._calls, self.shards, strict=True):
                while True:
                    message = self._next(shard, call)
                    if message is None:
                        raise MillpondError(
                            f"shard {shard.address}: the ReadTable stream of table "
                            f"{self.table!r} ended before its end message"
                        )
                    if message.HasField("segments"):
                        yield self._decode(message.segments)
                    elif message.HasField("end"):
                        for name in _END_COUNTS:
                            value = int(getattr(message.end, name))
                            info[name] = value
                            setattr(self, name, getattr(self, name) + value)
                        break
        finally:
            self.close()

    def _decode(self, msg: pb.PackedSegments) -> PackedSegments:
        budget = codec.Budget(self._max_bytes, "the client's message limit")
        steps, _ = codec.from_tensor_map_flat(msg.steps, budget, what="steps")
        tails, _ = codec.from_tensor_map_flat(msg.tails, budget, what="tails")
        return pack_columns(
            steps,
            tails,
            np.asarray(msg.lengths, dtype=np.int64),
            np.asarray(msg.episode_ids, dtype=np.int64),
            np.asarray(msg.first_steps, dtype=np.int64),
        )

    @staticmethod
    def _next(shard: Any, call: Any) -> pb.ReadTableResponse | None:
        """The stream's next message (``None`` at its end), errors as millpond's."""
        try:
            return next(call)
        except StopIteration:
            return None
        except grpc.RpcError as err:
            error = from_rpc_error(err, shard.address)
            if not str(error).startswith(f"shard {shard.address}"):
                error = type(error)(f"shard {shard.address}: {error}")
            raise error from err

    def close(self) -> None:
        """Cancel the streams not read to their end (the shards stop reading)."""
        for _, call in self._calls:
            call.cancel()

    def __enter__(self) -> TableReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
