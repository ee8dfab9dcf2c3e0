"""Sampled batches on the wire, one section per form: how the shard encodes each and how a
client decodes it.

* TED (:func:`encode_sample`): the batch's keys, with ``("next", obs)`` sent only for the
  rows whose next observation is not the following row's (``next_rows``).
* Slots (:func:`encode_slot_sample`): the step keys and each distinct observation slot once,
  with the int32 rows that rebuild ``obs`` and ``("next", obs)``; :func:`decode_sample`
  reads both this and the TED form. Its hand-framed twin is
  :func:`millpond.protos.wire.encode_slot_sample`.
* Colocated (:func:`encode_colocated`): the step keys and which observation slots a reader
  on the shard's host reads from the table's files; :func:`decode_colocated` reads them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.colocated import ColocatedReader
from millpond.errors import InvalidDataError
from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb
from millpond.sample_format import ColocatedSample, SlotSample, expand_observations
from millpond.spec import Key, format_key

# -- TED ---------------------------------------------------------------------------------


def encode_sample(
    td: TensorDictBase, observation_keys: Iterable[Key], compress: bool = False
) -> pb.SampleResponse:
    """A sampled TED batch, sending ``("next", obs)`` only where the next row does not hold it.

    Rows are taken flat (a ``[B, K]`` slice batch is ``B*K`` rows). For slices and queue
    batches most next observations are the following row's observation and are not sent.
    """
    obs_keys = list(observation_keys)
    batch = list(td.batch_size)
    n = int(np.prod(batch)) if batch else 1
    same = torch.ones(n, dtype=torch.bool)
    same[-1] = False
    for key in obs_keys:
        # bitwise, so that NaN payloads and -0.0 survive
        now = _wide_rows(td.get(key), n)
        nxt = _wide_rows(td.get(("next", *key)), n)
        if now.shape[1] == 0:
            continue
        same[:-1] &= (nxt[:-1] == now[1:]).all(dim=1)
    next_rows = torch.nonzero(~same).squeeze(-1)
    next_obs = {}
    for key in obs_keys:
        value = td.get(("next", *key))
        feature = value.shape[len(batch) :]
        rows = _wide_rows(value, n).index_select(0, next_rows)
        next_obs[key] = rows.view(value.dtype).reshape(len(next_rows), *feature)
    compress_keys = set(obs_keys) if compress else set()
    response = pb.SampleResponse(next_rows=next_rows.tolist())
    codec.to_tensor_map(
        td,
        compress_keys=compress_keys,
        exclude={("next", *k) for k in obs_keys},
        out=response.batch,
    )
    codec.to_tensor_map(
        next_obs,
        batch_size=[len(next_rows)],
        compress_keys=compress_keys,
        out=response.next_observations,
    )
    return response


def decode_sample(msg: pb.SampleResponse) -> TensorDict:
    """Rebuild the TED batch of :func:`encode_sample` or :func:`encode_slot_sample`,
    ``("next", obs)`` included."""
    if msg.HasField("slot_observations"):
        return _decode_slot_sample(msg)
    flat, batch = codec.from_tensor_map_flat(msg.batch)
    next_obs, next_batch = codec.from_tensor_map_flat(msg.next_observations)
    n = int(np.prod(batch)) if batch else 1
    rows = torch.tensor(list(msg.next_rows), dtype=torch.int64)
    if len(rows) != (next_batch[0] if next_batch else 0) or (
        len(rows) and (rows.min() < 0 or rows.max() >= n)
    ):
        raise InvalidDataError("sample: next_rows do not match the next observations")
    if not bool((rows == n - 1).any()) and n > 0:
        raise InvalidDataError("sample: the last row's next observation is missing")
    for key, values in next_obs.items():
        if key not in flat:
            raise InvalidDataError(f"sample: next observation {format_key(key)} has no observation")
        now = flat[key]
        feature = now.shape[len(batch) :]
        if values.dtype != now.dtype or values.shape[1:] != feature:
            raise InvalidDataError(
                f"sample: next observation {format_key(key)} is {values.dtype}"
                f"{list(values.shape[1:])}, the observation {now.dtype}{list(feature)}"
            )
        nxt = torch.empty((n, *feature), dtype=now.dtype)
        nxt[:-1] = now.reshape(n, *feature)[1:]
        if len(rows):
            _wide_rows(nxt, n).index_copy_(0, rows, _wide_rows(values, len(rows)))
        flat[("next", *key)] = nxt.reshape(*batch, *feature)
    return codec.nest(flat, batch)


def _wide_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """The bytes of ``t`` (``n`` rows) as ``[n, k]`` of the widest integer type dividing a row.

    For bitwise row work (compare, gather, scatter): torch's indexing kernels move one
    element at a time, so on image rows an int64 view is 4-8x faster than the uint8 one.
    """
    raw = t.reshape(n, -1)
    if raw.dtype.itemsize == 0 or raw.shape[1] == 0:
        return raw
    raw = raw.contiguous()
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    width = raw.shape[1]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if width % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


# -- slots -------------------------------------------------------------------------------


def encode_slot_sample(sample: SlotSample, compress: bool = False) -> pb.SampleResponse:
    """A sampled batch as the shard read it: the step keys, each distinct observation slot
    once (zstd-compressed if ``compress``), and the int32 rows that rebuild ``obs`` and
    ``("next", obs)``. Nothing is compared or expanded here: the shard knows which slots
    follow one another."""
    response = pb.SampleResponse()
    codec.to_tensor_map(sample.ted, out=response.batch)
    part = response.slot_observations
    codec.to_tensor_map(
        sample.observations,
        batch_size=[_distinct(sample)],
        compress_keys=set(sample.observations) if compress else set(),
        out=part.observations,
    )
    codec.fill_tensor(part.rows, ("rows",), sample.rows, False)
    codec.fill_tensor(part.next_rows, ("next_rows",), sample.next_rows, False)
    return response


def _distinct(sample: SlotSample) -> int:
    """U: every distinct slot is some step's row, so one past the largest row."""
    if sample.rows.numel() == 0:
        return 0
    return int(torch.maximum(sample.rows.max(), sample.next_rows.max())) + 1


def _decode_slot_sample(msg: pb.SampleResponse) -> TensorDict:
    """The new form: observations indexed straight out of the received bytes."""
    flat, batch = codec.from_tensor_map_flat(msg.batch)
    if msg.next_rows or msg.next_observations.tensors:
        raise InvalidDataError("sample: next_rows and slot_observations both set")
    part = msg.slot_observations
    obs_batch = list(part.observations.batch_size)
    if len(obs_batch) != 1 or obs_batch[0] < 0:
        raise InvalidDataError(
            f"sample: slot observations must have batch size [U], received {obs_batch}"
        )
    distinct = obs_batch[0]
    observations: dict[Key, torch.Tensor] = {}
    for t in part.observations.tensors:
        key, value = codec.proto_to_tensor(t, copy=False)
        if key in observations or key in flat:
            raise InvalidDataError(f"sample: observation {format_key(key)} appears twice")
        if value.shape[:1] != (distinct,):
            raise InvalidDataError(
                f"sample: observation {format_key(key)} has shape {list(value.shape)}, "
                f"expected {distinct} rows"
            )
        observations[key] = value
    index = []
    for name, t in (("rows", part.rows), ("next_rows", part.next_rows)):
        _, rows = codec.proto_to_tensor(t)
        if rows.dtype != torch.int32 or list(rows.shape) != batch:
            raise InvalidDataError(
                f"sample: {name} is {rows.dtype}{list(rows.shape)}, expected int32{batch}"
            )
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= distinct):
            raise InvalidDataError(f"sample: {name} point outside the {distinct} observations")
        index.append(rows)
    td = codec.nest(flat, batch)
    return expand_observations(td, observations, index[0], index[1])


# -- colocated ---------------------------------------------------------------------------


def encode_colocated(sample: ColocatedSample, storage_token: str) -> pb.SampleResponse:
    """The step keys, and which observation slots a reader on the shard's host reads (from
    the table's files whose token is ``storage_token``)."""
    response = pb.SampleResponse()
    codec.to_tensor_map(sample.ted, out=response.batch)
    part = response.colocated_rows
    for name, field, t in (
        ("slots", part.slots, sample.slots),
        ("generations", part.generations, sample.generations),
        ("rows", part.rows, sample.rows),
        ("next_rows", part.next_rows, sample.next_rows),
    ):
        field.CopyFrom(codec.tensor_to_proto((name,), t))
    part.storage_token = storage_token
    return response


def decode_colocated(
    msg: pb.SampleResponse, reader: ColocatedReader
) -> tuple[TensorDict, np.ndarray]:
    """The TED batch of a colocated answer, its observations read through ``reader``, and
    the indices (along the batch's first dimension) of the rows to draw again: those that
    read a slot overwritten meanwhile."""
    flat, batch = codec.from_tensor_map_flat(msg.batch)
    part = msg.colocated_rows
    tensors = []
    for name, t, dtype, shape in (
        ("slots", part.slots, torch.int64, None),
        ("generations", part.generations, torch.int64, None),
        ("rows", part.rows, torch.int32, batch),
        ("next_rows", part.next_rows, torch.int32, batch),
    ):
        _, value = codec.proto_to_tensor(t)
        if value.dtype != dtype or (shape is not None and list(value.shape) != shape):
            expected = f"{dtype}{shape}" if shape is not None else f"{dtype}[U]"
            raise InvalidDataError(
                f"sample: colocated {name} is {value.dtype}{list(value.shape)}, expected {expected}"
            )
        tensors.append(value)
    slots, generations, rows, next_rows = tensors
    distinct = len(slots)
    if slots.dim() != 1 or generations.shape != slots.shape:
        raise InvalidDataError("sample: colocated slots and generations differ in shape")
    for name, r in (("rows", rows), ("next_rows", next_rows)):
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= distinct):
            raise InvalidDataError(f"sample: colocated {name} point outside the {distinct} slots")
    obs, nxt, stale = reader.read(slots, generations, rows, next_rows)
    td = codec.nest(flat, batch)
    for key, value in obs.items():
        td.set(key, value)
        td.set(("next", *key), nxt[key])
    bad = (stale[rows.long()] | stale[next_rows.long()]).numpy()
    if bad.ndim > 1:
        bad = bad.reshape(bad.shape[0], -1).any(axis=1)
    return td, np.flatnonzero(bad)
