"""What an insert must satisfy against its table (its spec, its sampler), one rule for both sides.

A writer checks its segments in the caller's thread (so that bad data raises at once, before
anything is queued) and the table that stores them checks them again; both call
:func:`check_insert` and :func:`check_insert_priorities`, so the two agree on what passes
and say it in the same words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from millpond.config import PRIORITIZED_SAMPLERS
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.frame_stacks import compact_stacks, stack_examples
from millpond.segments import PackedSegments, check_priorities
from millpond.spec import OBSERVATION, STEP, Key, TableSpec

__all__ = ["check_insert", "check_insert_priorities", "infer_spec"]


#: ``infer(steps, tails)``: the spec to check against when none is known yet.
Infer = Callable[[Mapping[Key, torch.Tensor], Mapping[Key, torch.Tensor]], TableSpec]


def infer_spec(steps: Mapping[Key, torch.Tensor], tails: Mapping[Key, torch.Tensor]) -> TableSpec:
    """The spec a first insert sets (:meth:`TableSpec.from_example`); a spec that cannot be
    is the data's fault, so :class:`InvalidDataError` says why."""
    try:
        return TableSpec.from_example(steps, tails)
    except InvalidConfigError as e:
        raise InvalidDataError(str(e)) from None


def check_insert(
    packed: PackedSegments,
    frame_stacks: Mapping[Key, int],
    spec: TableSpec | None,
    infer: Infer = infer_spec,
) -> tuple[PackedSegments, TableSpec]:
    """``packed`` checked against ``spec``, with its frame-stacked keys cut to frames.

    Keys of ``frame_stacks`` sent as whole stacks are checked to overlap and cut to frames
    (each frame travels and is stored once); frames of other keys are refused. With ``spec``
    ``None`` (not known yet) the spec is taken from ``packed`` by ``infer(steps, tails)``, its
    columns with each stacked key's first stack; a table passes one that also sets it.

    Returns ``(packed, spec)``: the segments as they go on, and the spec they passed.
    Raises :class:`InvalidDataError` naming what does not fit.
    """
    packed = compact_stacks(packed, frame_stacks)
    if any(key not in packed.stacks for key in packed.frames):
        raise InvalidDataError("frames are sent only for the table's frame-stacked keys")
    stacks = stack_examples(packed)
    tails, steps = {**packed.tails, **stacks}, {**packed.steps, **stacks}
    if spec is None:  # unknown: the first segment sets it
        spec = infer(steps, tails)
    spec.check(tails, (OBSERVATION,), "tail")
    spec.check(steps, (OBSERVATION, STEP), "steps")
    return packed, spec


def check_insert_priorities(packed: PackedSegments, table: str, sampler: str) -> PackedSegments:
    """``packed`` with its initial priorities checked (one finite number >= 0 per step,
    :func:`~millpond.segments.check_priorities`), or refused when the table's sampler keeps
    no priorities: they would be dropped, and what millpond is sent is stored exactly or
    refused by name."""
    if packed.priorities is None:
        return packed
    if sampler not in PRIORITIZED_SAMPLERS:
        raise InvalidDataError(
            f"table {table!r} has a {sampler!r} sampler, which keeps no priorities: send its "
            "steps without priorities (only prioritized tables take them)"
        )
    return dataclasses.replace(
        packed, priorities=check_priorities(packed.priorities, packed.num_steps)
    )
