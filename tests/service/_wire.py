"""Wire-level builders shared by the service tests that talk to a server with raw protos.

Test modules import it as ``tests.service._wire`` (pytest's ``--import-mode=importlib``
keeps test modules apart, so shared helpers live in a module of their own).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from millpond.protos import codec
from millpond.protos import millpond_pb2 as pb


def steps_td(obs: torch.Tensor, actions: torch.Tensor | None = None) -> TensorDict:
    """CartPole-shaped steps, one per row of ``obs``: ``action`` (zeros unless given),
    ``("next", "reward")`` ones, no episode end."""
    n = len(obs)
    return TensorDict(
        {
            "observation": obs,
            "action": torch.zeros(n, dtype=torch.int64) if actions is None else actions,
            "next": {
                "reward": torch.ones(n, 1),
                "terminated": torch.zeros(n, 1, dtype=torch.bool),
                "truncated": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        [n],
    )


def segment_proto(
    seq: int,
    obs: torch.Tensor,
    *,
    episode: int | None = None,
    first_step: int = 0,
    actions: torch.Tensor | None = None,
) -> pb.Segment:
    """A :class:`pb.Segment` of ``len(obs) - 1`` steps (:func:`steps_td`) whose tail is the
    last row of ``obs``; its episode is ``seq`` unless given."""
    return pb.Segment(
        sequence=seq,
        episode_id=seq if episode is None else episode,
        first_step=first_step,
        steps=codec.to_tensor_map(steps_td(obs[:-1], actions)),
        tail=codec.to_tensor_map(TensorDict({"observation": obs[-1]}, [])),
    )
