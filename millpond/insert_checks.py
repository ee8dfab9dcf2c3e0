"""What an insert must satisfy against its table's spec, one rule for both sides.

A writer checks its segments in the caller's thread (so that bad data raises at once, before
anything is queued) and the table that stores them checks them again; both call
:func:`check_insert`, so the two agree on what passes and say it in the same words.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.frame_stacks import compact_stacks, stack_examples
from millpond.segments import PackedSegments
from millpond.spec import OBSERVATION, STEP, Key, TableSpec

__all__ = ["check_insert", "infer_spec"]

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
