"""Data-parallel learners: N processes in one ``torch.distributed`` group.

Each process (rank) samples its own batches from the replay service: a queue table delivers
every step once across all its clients, and the other samplers draw independently, so
the ranks train on different data without coordinating what they sample. What they
coordinate is when they train: every decision that leads to a collective call (is there a
batch on every rank, does any rank have rows left, how many minibatches) is taken together
through a small ``all_reduce``, so no rank waits in a collective that another skipped.

Gradients are averaged weighted by the rows each rank trained on, so that one averaged step
equals one step on the concatenation of the ranks' minibatches (for losses that are means
over rows). One rank (rank 0) publishes weights and writes checkpoints; the others count the
same versions without sending them.

Without an initialised group (or with a group of one) every function here is the identity
of the single-process case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

from millpond.errors import DeadlineExceededError

__all__ = [
    "BatchTurn",
    "all_true",
    "any_true",
    "average_gradients",
    "broadcast_parameters",
    "gather",
    "global_max",
    "rank",
    "world_size",
]

T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Processes in the default group; ``1`` without one."""
    dist = _dist()
    return 1 if dist is None else dist.get_world_size()


def rank() -> int:
    """This process's rank in the default group; ``0`` without one."""
    dist = _dist()
    return 0 if dist is None else dist.get_rank()


def _reduce(value: float, op: str, device: torch.device) -> float:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return float(t.item())


def all_true(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` holds on every rank."""
    return _reduce(1.0 if flag else 0.0, "MIN", torch.device(device)) > 0


def any_true(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` holds on some rank."""
    return _reduce(1.0 if flag else 0.0, "MAX", torch.device(device)) > 0


def global_max(value: float, device: torch.device | str = "cpu") -> float:
    """The largest ``value`` over the ranks."""
    return _reduce(float(value), "MAX", torch.device(device))


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (of one shape on all ranks), in rank order; ``[tensor]``
    without a group."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


@torch.no_grad()
def broadcast_parameters(modules: Iterable[nn.Module], src: int = 0) -> None:
    """Give every rank ``src``'s parameters and buffers (one starting point for all)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return
    seen: set[int] = set()
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:  # a torso shared by two modules is sent once
                seen.add(id(tensor))
                dist.broadcast(tensor.data, src=src)


@torch.no_grad()
def average_gradients(params: Iterable[nn.Parameter], weight: float) -> float:
    """Replace each parameter's gradient by the ``weight``-weighted mean over the ranks.

    ``weight`` is what this rank's gradient stands for, normally the rows of its minibatch:
    with losses that are means over rows, the result is the gradient of the mean over all
    ranks' rows together. A parameter without a gradient counts as zeros (a rank with an
    empty minibatch takes part with ``weight=0``). Returns the total weight; ``0``: every
    gradient is zero. One ``all_reduce`` of one flat buffer.
    """
    params = [p for p in params if p.requires_grad]
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return float(weight)
    if not params:
        return _reduce(float(weight), "SUM", torch.device("cpu"))
    device = params[0].device
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) * weight for p in params
    ]
    flat = torch.cat([*grads, torch.tensor([float(weight)], dtype=grads[0].dtype, device=device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    total = float(flat[-1].item())
    scale = 1.0 / total if total > 0 else 0.0
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = (flat[offset : offset + n] * scale).view_as(p).to(p.dtype)
        offset += n
    return total


class BatchTurn:
    """Takes a batch for the next update only when every rank has one.

    A rank whose sample timed out (the queue is not full enough yet, or the rate limiter
    holds it) would leave the others waiting in the update's collectives; here every rank
    learns that and raises :class:`~millpond.errors.DeadlineExceededError` together, and a
    rank that did get a batch keeps it for the next turn (a queue batch is not
    delivered twice, so dropping it would lose those steps). Any other error of a rank's
    sample (every shard unreachable, say) is raised on that rank after the agreement, the
    others raising :class:`~millpond.errors.DeadlineExceededError`: every rank takes part
    in every turn, so the group stays in step.

    Args:
        data_parallel: take part in a group; ``False``: :meth:`take` just samples.
        device: where the agreement's tensor lives (CUDA for NCCL).
    """

    def __init__(self, data_parallel: bool, device: torch.device | str = "cpu") -> None:
        self.data_parallel = data_parallel
        self.device = torch.device(device)
        self._pending: object | None = None

    def take(self, sample: Callable[[], T]) -> T:
        """A batch from ``sample()`` (or the one kept from an earlier turn)."""
        if not self.data_parallel:
            return sample()
        error: Exception | None = None
        if self._pending is None:
            try:
                self._pending = sample()
            except DeadlineExceededError:  # the turn says so to all
                pass
            except Exception as e:  # every shard down, say: raised after the turn, so that
                error = e  # the other ranks are not left waiting in it
        if not all_true(self._pending is not None, self.device):
            if error is not None:
                raise error
            raise DeadlineExceededError("waiting until every learner has a batch")
        batch, self._pending = self._pending, None
        return batch  # type: ignore[return-value]
