"""One shard's Sample calls: asked, answered, and colocated rows read and drawn again.

:class:`ShardCalls` is the part of :class:`~._split.SplitSampler` that speaks to one shard:
a call of one batch (:meth:`~ShardCalls._open` asks, :meth:`~ShardCalls._answer` receives,
turning gRPC's errors into millpond's), and the colocated reads, whose rows found overwritten
are replaced by the shard's fresh, uncounted draws, now or, for a joined call, while its other
parts are handed out (:mod:`._late_rows`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from tensordict import TensorDict

from millpond.colocated import ColocatedReader
from millpond.errors import DeadlineExceededError, MillpondError, ShardBusyError
from millpond.learner.client._calls import CallSet, Cancelled
from millpond.learner.client._colocated import Colocation
from millpond.learner.client._errors import from_rpc_error, is_connect_failure, is_own_deadline
from millpond.learner.client._late_rows import LateRows, move_last
from millpond.learner.client._masses import ShardMasses
from millpond.learner.client._shards import ShardHandle, ShardSet
from millpond.protos import millpond_pb2 as pb
from millpond.protos import wire
from millpond.protos.samples import decode_colocated, decode_sample

T = TypeVar("T")

#: Extra seconds a Sample call's deadline allows beyond the wait the server is asked to
#: honour (so that the server's own rate-limiter timeout arrives as such): ``sample`` with
#: ``timeout_s=T`` ends within ``T`` plus this, an answer still on the wire then included.
SAMPLE_SLACK_S = 1.0
#: A shard that refuses a Sample as busy is asked again after this, doubling up to the max.
BUSY_BACKOFF_INITIAL_S = 0.05
BUSY_BACKOFF_MAX_S = 1.0
#: Rows a colocated reader found overwritten are drawn and read again this many times at
#: most; what is still overwritten then comes on the wire.
COLOCATED_REDRAWS = 3


def from_shard(td: TensorDict, shard: ShardHandle) -> TensorDict:
    """``td`` with ``("index", "shard")``: the shard each row was drawn from."""
    td.set(("index", "shard"), torch.full_like(td.get(("index", "slot")), shard.index))
    return td


class ShardDown(Exception):
    def __init__(self, shard: ShardHandle, error: MillpondError) -> None:
        super().__init__(str(error))
        self.shard = shard
        self.error = error


class ShardCalls:
    """Sample calls to one shard at a time, colocated reads included (a base of
    :class:`~._split.SplitSampler`, which sets the shards, masses and colocation)."""

    _set: ShardSet
    _masses: ShardMasses
    _colocation: Colocation

    def _sample_once(
        self, shard: ShardHandle, table: str, n: int, wait: float | None, calls: CallSet
    ) -> TensorDict:
        colocated = self._colocation.wanted(shard, table)
        response = self._call(shard, table, n, wait, calls, colocated=colocated)
        if response.HasField("colocated_rows"):
            td, _ = self._read_colocated(shard, table, response, wait, calls)
            return td
        return from_shard(decode_sample(response), shard)

    def _read_colocated(
        self,
        shard: ShardHandle,
        table: str,
        response: pb.SampleResponse,
        wait: float | None,
        calls: CallSet,
        *,
        defer: bool = False,
    ) -> tuple[TensorDict, LateRows | None]:
        """The batch of a colocated answer, its rows read from the table's files; rows
        that read a slot overwritten meanwhile are replaced by fresh draws of the shard
        (not counted again), read from the files up to :data:`COLOCATED_REDRAWS` times, then
        sent on the wire. Without a reader (the files are gone), every row is drawn anew on
        the wire.

        ``defer``: the replacements are asked for at once but received and written in by
        the returned :class:`LateRows` (``None`` where no row is late), which moves the
        rows to replace to the batch's end: a joined call hands out its other batches
        meanwhile, rather than wait on the shard first (it is often busy then, storing the
        insert that overwrote them).
        """
        reader = self._colocation.reader(shard, table, response.colocated_rows.storage_token)
        if reader is None:
            n = int(response.batch.batch_size[0]) if response.batch.batch_size else 0
            redrawn = while_busy(lambda w: self._call(shard, table, n, w, calls, redraw=True), wait)
            return from_shard(decode_sample(redrawn), shard), None
        td, stale = decode_colocated(response, reader)
        td = from_shard(td, shard)
        if not len(stale):
            return td, None
        if not defer:
            self._redraw(shard, table, td, stale, reader, wait, calls, None)
            return td, None
        late = move_last(td, stale)
        call = self._open(shard, table, len(late), wait, calls, colocated=True, redraw=True)
        return td, LateRows(
            int(late[0]),
            lambda: self._redraw(shard, table, td, late, reader, wait, calls, call),
        )

    def _redraw(
        self,
        shard: ShardHandle,
        table: str,
        td: TensorDict,
        stale: np.ndarray,
        reader: ColocatedReader,
        wait: float | None,
        calls: CallSet,
        asked: Any,
    ) -> None:
        """Replace the rows ``stale`` of ``td`` (along its first dimension) by fresh draws,
        the first of them already ``asked`` (a call :meth:`_open` made) if not ``None``."""
        for attempt in range(COLOCATED_REDRAWS + 1):
            if not len(stale):
                break
            colocated = attempt < COLOCATED_REDRAWS
            k = len(stale)
            again = None
            if asked is not None:
                with contextlib.suppress(ShardBusyError):  # then asked again below
                    again = self._answer(shard, table, k, wait, calls, asked)
                asked = None
            if again is None:
                # Busy: asked again, not given up (the whole part would then be drawn and
                # counted a second time).
                again = while_busy(
                    lambda w, k=k, c=colocated: self._call(
                        shard, table, k, w, calls, colocated=c, redraw=True
                    ),
                    wait,
                )
            if again.HasField("colocated_rows"):
                part, part_stale = decode_colocated(again, reader)
            else:
                part, part_stale = decode_sample(again), np.zeros(0, dtype=np.int64)
            td[torch.from_numpy(stale)] = from_shard(part, shard)
            stale = stale[part_stale]
        if len(stale):  # the wire's rows are never stale: only a shard ignoring redraws
            raise MillpondError(
                f"shard {shard.address}: table {table!r}: sampled rows were overwritten "
                f"while they were read, {COLOCATED_REDRAWS + 1} times in a row"
            )

    def _call(
        self,
        shard: ShardHandle,
        table: str,
        n: int,
        wait: float | None,
        calls: CallSet,
        **how: bool,
    ) -> pb.SampleResponse:
        """One Sample call of one batch of ``n`` (``how``: :meth:`_open`'s ``colocated`` and
        ``redraw``), asked and answered; notes the shard's state and mass."""
        return self._answer(
            shard, table, n, wait, calls, self._open(shard, table, n, wait, calls, **how)
        )

    def _open(
        self,
        shard: ShardHandle,
        table: str,
        n: int,
        wait: float | None,
        calls: CallSet,
        *,
        colocated: bool = False,
        redraw: bool = False,
    ) -> Any:
        """A Sample call of one batch of ``n``, asked now and received by :meth:`_answer`."""
        request = pb.SampleRequest(
            table=table,
            batch_size=n,
            num_batches=1,
            timeout_ms=0 if wait is None else max(1, int(wait * 1000)),
            colocated=colocated,
            redraw=redraw,
        )
        deadline = None if wait is None else wait + SAMPLE_SLACK_S
        if calls.cancelled:
            raise Cancelled
        if colocated:
            call = self._colocation.stub(shard).Sample(
                request, timeout=deadline, metadata=self._set.metadata
            )
        else:  # bytes, parsed below: the observations stay views of them (protos/wire.py)
            call = shard.raw_sample(request, timeout=deadline, metadata=self._set.metadata)
        if not calls.add(call):
            raise Cancelled
        return call

    def _answer(
        self,
        shard: ShardHandle,
        table: str,
        n: int,
        wait: float | None,
        calls: CallSet,
        call: Any,
    ) -> pb.SampleResponse:
        """The batch of a call :meth:`_open` asked; notes the shard's state and mass."""
        deadline = None if wait is None else wait + SAMPLE_SLACK_S
        try:
            responses = list(call)
        except grpc.RpcError as err:
            if calls.cancelled:
                raise Cancelled from None
            if deadline is not None and is_own_deadline(err):
                raise DeadlineExceededError(self._late(shard, table, n, deadline)) from err
            error = from_rpc_error(err, shard.address)
            if is_connect_failure(err):
                self._set.note_down(shard, error)
                raise ShardDown(shard, error) from err
            raise error from err
        finally:
            calls.discard(call)
        self._set.note_up(shard)
        if len(responses) != 1:
            raise MillpondError(
                f"shard {shard.address}: expected one sample batch, received {len(responses)}"
            )
        response = responses[0]
        if isinstance(response, bytes):
            response = wire.parse_sample_response(response)
        self._masses.set_mass(shard, table, response.mass)
        return response

    def _late(self, shard: ShardHandle, table: str, n: int, seconds: float) -> str:
        """What a Sample answer that did not arrive within its deadline says: the shard, and
        how large the answer was (as far as the table's spec tells)."""
        config = self._masses.configs.get(table)
        spec = None if config is None else config.spec
        if spec is None:
            size = "of a size the client does not know yet"
        else:  # each row carries its slot and its next observation
            rows = n * (config.slice_len or 1)
            size = f"about {rows * (spec.slot_bytes + spec.observation_bytes) / 2**20:.1f} MiB"
        return (
            f"shard {shard.address}: the sample of {n} rows of table {table!r} ({size}) did "
            f"not arrive within {seconds:.3g} s: the link carries less than that in this time, "
            "or the shard did not answer; ask for fewer rows or give a longer timeout_s"
        )


def while_busy(attempt: Callable[[float | None], T], wait: float | None) -> T:
    """``attempt(wait left)``, asked again with backoff while the shard refuses it as busy
    and the wait lasts."""
    deadline = None if wait is None else time.monotonic() + wait
    backoff = BUSY_BACKOFF_INITIAL_S
    while True:
        try:
            return attempt(wait)
        except ShardBusyError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= backoff:
                raise
            time.sleep(backoff)
            backoff = min(BUSY_BACKOFF_MAX_S, backoff * 2)
            wait = None if deadline is None else deadline - time.monotonic()
