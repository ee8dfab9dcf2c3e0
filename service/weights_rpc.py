"""The weights RPCs of a shard: PublishWeights buffers a learner's weights (refused by size
before anything is buffered) into the :class:`WeightStore`, waiting first for the acting
actors when it carries ``max_lag``; PublishWeightsAtOnce is the same for weights sent in one
message; GetWeights answers with the newest, waiting for a version not published yet, and
records what a named actor acts with.
"""

from __future__ import annotations

from collections.abc import Iterable

from millpond.errors import InvalidDataError, ResourceExhaustedError
from millpond.protos import millpond_pb2 as pb
from millpond.protos.weights import chunks as weight_chunks
from millpond.service.metrics import ServiceMetrics
from millpond.service.rpc_edge import Cancelled, Slices, edge, timeout_s
from millpond.service.weights import WeightStore


class WeightRPCs:
    """PublishWeights and GetWeights of :class:`~millpond.service.servicer.ReplayServicer`
    (one of its bases: the store and the limit are the servicer's)."""

    weights: WeightStore
    max_weights_bytes: int
    metrics: ServiceMetrics

    @edge
    def PublishWeights(self, request_iterator, context) -> pb.PublishWeightsResponse:
        return self._publish(request_iterator, context)

    @edge
    def PublishWeightsAtOnce(
        self, request: pb.PublishWeightsRequest, context
    ) -> pb.PublishWeightsResponse:
        return self._publish([request], context)

    def _publish(
        self, requests: Iterable[pb.PublishWeightsRequest], context
    ) -> pb.PublishWeightsResponse:
        version = total = max_lag = None
        chunks: list[bytes] = []
        received = 0
        for request in requests:
            if version is None:
                version, total = request.version, request.total_size
                max_lag = request.max_lag if request.HasField("max_lag") else None
                if total < 0:
                    raise InvalidDataError(f"total_size ({total}) must be >= 0")
                if total > self.max_weights_bytes:
                    raise ResourceExhaustedError(
                        f"total_size ({total}) exceeds the largest weights this shard takes "
                        f"({self.max_weights_bytes} bytes)"
                    )
            received += len(request.chunk)
            if received > total:
                raise InvalidDataError(f"weights larger than the announced {total} bytes")
            chunks.append(request.chunk)
        if version is None:
            raise InvalidDataError("PublishWeights received no message")
        if received != total:
            raise InvalidDataError(f"weights truncated: {received} of {total} bytes")
        slices = Slices(context.time_remaining(), context)
        try:
            waited = self.weights.publish(version, b"".join(chunks), max_lag, slices.next)
        except Cancelled:
            return pb.PublishWeightsResponse()  # nobody reads it: the caller gave up
        return pb.PublishWeightsResponse(version=version, waited_s=waited)

    @edge
    def GetWeights(self, request: pb.GetWeightsRequest, context):
        try:  # in slices, as Sample waits, so that an abandoned call frees its thread
            version, blob = _wait_for_weights(
                self.weights, request, timeout_s(request.timeout_ms) or 0.0, context
            )
        except Cancelled:
            return
        size = len(blob) if blob is not None else 0
        yield pb.GetWeightsResponse(version=version, total_size=size)
        if blob is None:
            return
        for chunk in weight_chunks(blob):
            yield pb.GetWeightsResponse(chunk=chunk)


def _wait_for_weights(
    store: WeightStore, request: pb.GetWeightsRequest, timeout: float, context
) -> tuple[int, bytes | None]:
    """``(version, blob)`` of the newest weights once they are ``request.min_version`` or
    newer, waited for up to ``timeout`` seconds in :class:`Slices`; ``(version, None)`` when
    the wait ran out first: the version there is."""
    slices = Slices(timeout, context)
    while True:
        version, blob = store.get(request.min_version, slices.next(), request.actor, request.acting)
        if blob is not None or slices.over:
            return version, blob
