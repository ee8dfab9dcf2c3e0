"""The Sample RPC of a shard: a batch's size bounded before it is drawn, drawn in the form
the request asks for (:mod:`.sample_forms`), encoded (:mod:`millpond.protos.samples`) and
held to the message limit before it is sent, and given back when nobody receives it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from millpond.checks import check_batch_size
from millpond.errors import InvalidDataError, ResourceExhaustedError
from millpond.protos import millpond_pb2 as pb
from millpond.protos import samples, wire
from millpond.sample_format import ColocatedSample, SlotSample
from millpond.service.draws import check_batch_fits
from millpond.service.metrics import ServiceMetrics
from millpond.service.rpc_edge import Cancelled, edge, in_slices, timeout_s
from millpond.service.sample_forms import COLOCATED, SLOTS, TED, SampleForm

# Bytes every sampled row carries besides the spec's keys, at the least: its slot,
# generation, episode id and step (int64 each) and the done/terminated/truncated flags.
_SAMPLED_ROW_BYTES = 36
# What a colocated answer adds per row instead of its observations: its two row indices
# (int32 each).
_COLOCATED_ROW_BYTES = 8


class SampleRPC:
    """The Sample RPC of :class:`~millpond.service.servicer.ReplayServicer` (one of its
    bases: the tables, their locations, the limits and the metrics are the servicer's)."""

    max_message_bytes: int
    slot_samples: bool
    framed_samples: bool
    metrics: ServiceMetrics

    @edge
    def Sample(self, request: pb.SampleRequest, context):
        table = self._table(request.table)
        check_batch_size(request.batch_size)
        if request.num_batches < 0:
            raise InvalidDataError(f"num_batches ({request.num_batches}) must be >= 0")
        timeout = timeout_s(request.timeout_ms)
        queue = table.config.sampler == "queue"
        self._check_batch_size(table, request.batch_size, colocated=request.colocated and not queue)
        if request.redraw and queue:
            raise InvalidDataError(
                f"table {table.name!r} is a queue: its batches are never redrawn (redraw is "
                "for rows a colocated reader found overwritten)"
            )
        # A queue's delivered segments may be overwritten at once: its rows go on the wire.
        form: SampleForm = SLOTS if self.slot_samples else TED
        if request.colocated and not queue:
            form = COLOCATED
        counted = not request.redraw
        sent = 0
        while request.num_batches == 0 or sent < request.num_batches:
            started = time.monotonic()
            sampled = self._sample_one(table, request.batch_size, timeout, context, form, counted)
            if sampled is None:
                return
            assert table.spec is not None
            compress = table.config.compression == "zstd"
            if isinstance(sampled, ColocatedSample):
                batch = sampled.ted
                response = samples.encode_colocated(sampled, self._location(table)[1])
                size = _size_bound(batch, [sampled.slots, sampled.generations, sampled.rows])
            elif isinstance(sampled, SlotSample):
                batch = sampled.ted
                leaves = [*sampled.observations.values(), sampled.rows, sampled.next_rows]
                if (
                    self.framed_samples
                    and _size_bound(batch, leaves) <= self.max_message_bytes
                    and context.is_active()
                ):
                    # Framed by hand: the gathered rows are copied once, into the response
                    # (server.py sends these bytes as they are).
                    framed = wire.encode_slot_sample(sampled, table.sampler.mass, compress)
                    self.metrics.sampled(
                        table.name, time.monotonic() - started, batch.numel(), len(framed)
                    )
                    yield from _given_back_unless_sent(framed, table, batch, counted, context)
                    sent += 1
                    continue
                response = samples.encode_slot_sample(sampled, compress=compress)
                size = _size_bound(batch, leaves)
            else:
                batch = sampled
                response = samples.encode_sample(
                    batch, table.spec.observation_keys, compress=compress
                )
                size = _size_bound(batch)
            response.mass = table.sampler.mass
            # upb's ByteSize serializes the whole message (a second copy of every byte, ~10 ms
            # for an Atari batch): take it only when a cheap upper bound does not settle it.
            if size > self.max_message_bytes:
                size = response.ByteSize()
            if size > self.max_message_bytes or not context.is_active():
                if counted:  # nobody receives it: not counted, a queue's not lost
                    table.give_back(batch)
                if size > self.max_message_bytes:
                    raise ResourceExhaustedError(
                        f"a batch of {len(batch)} steps takes {size} bytes, more than the "
                        f"message limit ({self.max_message_bytes}); sample fewer at a time"
                    )
                return
            self.metrics.sampled(table.name, time.monotonic() - started, batch.numel(), size)
            yield from _given_back_unless_sent(response, table, batch, counted, context)
            sent += 1

    def _check_batch_size(self, table, batch_size: int, colocated: bool = False) -> None:
        """Refuse a batch that can never be sent, before sampling allocates it.

        Its steps must fit the table (more than its capacity is never a useful batch, and
        is what would be allocated) and their least bytes on the wire (from the spec) the
        message limit. Rows of uniform and prioritized batches carry their next observation
        too; consecutive rows of slices and queue batches carry each other's; a
        ``colocated`` answer carries no observation, only the slots to read them from.
        """
        config = table.config
        k = config.slice_len or 1
        steps, what = check_batch_fits(config, batch_size)
        spec = table.spec
        if spec is None:  # nothing stored yet: the message limit is checked on each batch
            return
        obs, row = spec.observation_bytes, spec.slot_bytes + _SAMPLED_ROW_BYTES
        if colocated:
            least = steps * (spec.step_bytes + _SAMPLED_ROW_BYTES + _COLOCATED_ROW_BYTES)
        elif config.sampler in ("uniform", "prioritized"):
            least = steps * (row + obs)
        else:
            least = steps * row + (batch_size if k > 1 else 1) * obs
        if least > self.max_message_bytes:
            per_step = -(-least // steps)
            raise ResourceExhaustedError(
                f"{what} takes at least {least} bytes ({per_step} per step), more than the "
                f"message limit ({self.max_message_bytes} bytes): batch_size must be at most "
                f"{max(1, batch_size * self.max_message_bytes // least)}"
            )

    @staticmethod
    def _sample_one(
        table, batch_size: int, timeout: float | None, context, form: SampleForm, counted: bool
    ):
        """One batch in ``form``, or ``None`` when the call was cancelled while it waited."""
        try:
            return in_slices(
                lambda wait: table.sample_as(form, batch_size, timeout=wait, counted=counted),
                timeout,
                context,
            )
        except Cancelled:
            return None


def _size_bound(batch, extra: Sequence[torch.Tensor] = ()) -> int:
    """An upper bound on the bytes of the SampleResponse that encodes ``batch``.

    The tensors' bytes (every leaf, ``("next", obs)`` whole, so more than is sent), zstd's
    worst case for incompressible data (+1/256, +64 per tensor), and generous room for keys,
    dtypes, shapes, ``next_rows`` varints and the other fields.
    """
    leaves = [*batch.values(include_nested=True, leaves_only=True), *extra]
    data = sum(t.numel() * t.element_size() for t in leaves)
    return data + data // 256 + 1024 * (len(leaves) + 1) + 11 * batch.numel()


_DEADLINE_SLACK_S = 0.5


def _given_back_unless_sent(response, table, batch, counted: bool, context):
    """Yield ``response``; if the call's deadline passes before gRPC has sent it (a slow
    link still carrying it), gRPC closes the generator here and the batch's steps are given
    back: nobody received them.

    Only a passed deadline gives back. A client that cancels (an iterator closed) may do so
    just after this answer arrived, and gRPC reports that send as failed too: its steps
    stay counted (the client drew them), as an answer a closed iterator never read is.
    """
    try:
        yield response
    except GeneratorExit:
        # The client's own deadline cancels the call a moment before the shard's (the
        # deadline reaches the shard one transit later): "passed" allows for that.
        remaining = context.time_remaining()
        if counted and remaining is not None and remaining <= _DEADLINE_SLACK_S:
            table.give_back(batch)
        raise
