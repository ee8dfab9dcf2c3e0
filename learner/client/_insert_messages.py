"""A writer's segments as ``PackedSegments`` messages, each within the shard's message limit.

Segments written together travel as one message with one tensor per key, not one per
segment, as large as the request size allows (:meth:`MessagePacker.request_limit`): up to
:data:`REQUEST_BYTES_MAX` once the shard has said its message limit, :data:`REQUEST_BYTES`
until then. A message is numbered (its segments' sequences) only when it is queued, and
cut again into smaller ones, numbered as before, when the limit drops under it
(:meth:`MessagePacker.refit`).
"""

from __future__ import annotations

from collections.abc import Callable

from millpond.config import TableConfig
from millpond.errors import ResourceExhaustedError
from millpond.protos import codec, wire
from millpond.segments import PackedSegments, pack_columns

_MESSAGE_OVERHEAD = 64 * 1024
#: Queued segments are batched into one InsertRequest up to about this many bytes until the
#: shard says how large a message it takes: under the smallest message limit a server takes
#: (1 MiB), so batching never makes a request that a server refuses when each segment alone
#: would pass. A larger segment goes alone.
REQUEST_BYTES = 1024 * 1024 - _MESSAGE_OVERHEAD
#: Once the shard has said its message limit (the answer that opens every stream does),
#: segments written together travel in messages up to this size or that limit, whichever is
#: smaller: a collector's chunk of image observations (4 lanes x 128 steps of
#: ``uint8[4, 84, 84]``, 14.5 MB) goes as one message, which the shard decodes and stores in
#: one pass instead of one per segment. Larger messages would leave glibc's reused heap
#: (:mod:`millpond.allocator`) for fresh mappings, faulted in page by page.
REQUEST_BYTES_MAX = 16 * 1024 * 1024 - _MESSAGE_OVERHEAD
_SEQUENCE_BYTES = 11  # a sequence number's bytes, set after a message's size is taken


class Queued:
    """Consecutive segments queued as one ``pb.PackedSegments`` message: its bytes without
    the sequences (:func:`~millpond.protos.wire.encode_packed`), numbered when sent."""

    __slots__ = ("body", "count", "first", "size")

    def __init__(self, body: bytes, count: int, size: int) -> None:
        self.body = body
        self.first = 0
        self.count = count
        self.size = size + count * _SEQUENCE_BYTES

    @property
    def last(self) -> int:
        return self.first + self.count - 1

    def number(self, first: int) -> None:
        """Give the segments the sequences ``first, first + 1, ...``."""
        self.first = first


class MessagePacker:
    """Packs one writer's segments into messages, and refits queued ones to the limit.

    Args:
        max_message_bytes: the channel's message size limit.
        table_config: returns the table's config as far as the client knows it (``None``
            if unknown): its ``compression`` applies to observations on the wire, and its
            ``frame_stacks`` say how many frames a stack of a refitted message holds.
    """

    def __init__(
        self, max_message_bytes: int, table_config: Callable[[], TableConfig | None]
    ) -> None:
        self._max_message_bytes = max_message_bytes
        self._table_config = table_config
        #: The shard's message limit (0: not said yet, or a shard that does not say).
        self.shard_message_bytes = 0

    def request_limit(self) -> int:
        """The most bytes of segments one request, and one queued message, carries."""
        own = self._max_message_bytes - _MESSAGE_OVERHEAD
        shard = self.shard_message_bytes - _MESSAGE_OVERHEAD
        if shard <= 0:
            return min(REQUEST_BYTES, own)
        return min(REQUEST_BYTES_MAX, own, shard)

    def encode(self, packed: PackedSegments) -> list[Queued]:
        """``packed`` as ``PackedSegments`` messages of consecutive segments, each within
        the request size (so a shard that takes each segment alone takes them batched)."""
        limit = self.request_limit()
        row_bytes = sum(v[0].numel() * v.element_size() for v in packed.steps.values())
        tail_bytes = sum(v[0].numel() * v.element_size() for v in packed.tails.values())
        for key, v in packed.frames.items():  # L + k frames per segment
            row_bytes += v[0].numel() * v.element_size()
            tail_bytes += v[0].numel() * v.element_size() * packed.stacks[key]
        sizes = (packed.lengths * row_bytes + tail_bytes).tolist()
        messages, i, n = [], 0, len(packed)
        while i < n:
            j, size = i + 1, sizes[i]
            while j < n and size + sizes[j] <= limit:
                size += sizes[j]
                j += 1
            messages.append(self._encode_group(packed.group(i, j)))
            i = j
        return messages

    def refit(self, unacked: dict[int, Queued]) -> dict[int, Queued]:
        """``unacked`` (queued messages by their last sequence) with the messages of several
        segments that the request size no longer admits (the shard restarted with a lower
        message limit, or a shard that does not say took over) cut into messages that it
        does, numbered as before: a request the shard would refuse is never sent where each
        segment alone would pass. The same dict when nothing needs cutting."""
        limit = self.request_limit()
        if all(q.size <= limit or q.count == 1 for q in unacked.values()):
            return unacked
        fitted: dict[int, Queued] = {}
        for queued in unacked.values():
            if queued.size <= limit or queued.count == 1:
                fitted[queued.last] = queued
                continue
            first = queued.first
            for part in self.encode(self._decode(queued)):
                part.number(first)
                first += part.count
                fitted[part.last] = part
            assert first == queued.last + 1
        return fitted

    def _decode(self, queued: Queued) -> PackedSegments:
        """The segments of a queued message, as columns again (views of its bytes)."""
        view = wire.parse_packed(queued.body)
        steps, _ = codec.from_tensor_map_flat(view.steps, copy=False)
        tails, _ = codec.from_tensor_map_flat(view.tails, copy=False)
        frames: dict = {}
        stacks: dict = {}
        if view.frames.tensors:
            frames, _ = codec.from_tensor_map_flat(view.frames, copy=False)
            config = self._table_config()
            stacks = {k: config.frame_stacks[k] for k in frames} if config is not None else {}
        packed = pack_columns(
            steps,
            tails,
            view.fields.lengths,
            view.fields.episode_ids,
            view.fields.first_steps,
            frames=frames,
            priorities=view.priorities if len(view.priorities) else None,
        )
        packed.stacks = stacks
        return packed

    def _encode_group(self, packed: PackedSegments) -> Queued:
        config = self._table_config()
        compress = (
            set(packed.tails) | set(packed.frames)
            if config is not None and config.compression == "zstd"
            else set()
        )
        # Encoded by hand, straight from the tensors' memory: one copy, where protobuf's
        # message, request and serialization made four.
        body = wire.encode_packed(packed, compress)
        size = len(body)
        limit = self._max_message_bytes - _MESSAGE_OVERHEAD
        if size > limit:
            raise ResourceExhaustedError(
                f"a segment of {packed.num_steps} steps takes {size} bytes on the wire, more "
                f"than the message limit ({limit} bytes; raise max_message_mb or cut shorter "
                "segments)"
            )
        return Queued(body, len(packed), size)
