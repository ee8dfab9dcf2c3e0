"""move_last: a joined draw's late rows go to its end, every other row kept once."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond.learner.client._late_rows import move_last


@pytest.mark.parametrize(
    "late",
    [[0], [9], [0, 1, 2], [7, 8, 9], [1, 4, 8], [0, 2, 4, 6, 8], list(range(10)), []],
)
def test_late_rows_go_last_and_every_other_row_stays_once(late):
    ids = torch.arange(10)
    td = TensorDict({"id": ids.clone(), "obs": ids.float()[:, None].repeat(1, 3)}, [10])
    rows = np.array(late, dtype=np.int64)
    moved = move_last(td, rows)
    k = len(late)
    assert moved.tolist() == list(range(10 - k, 10))
    clean = sorted(set(range(10)) - set(late))
    kept = td["id"][: 10 - k].tolist()
    assert sorted(kept) == clean  # each row not late exactly once, before the late ones
    assert torch.equal(td["obs"][:, 0].long(), td["id"])  # rows moved whole
    # rows that were already placed before the tail did not move
    assert all(td["id"][i] == i for i in clean if i < 10 - k)


def test_slices_move_by_their_first_dimension():
    td = TensorDict({"id": torch.arange(12).reshape(4, 3)}, [4, 3])
    move_last(td, np.array([1]))
    assert td["id"][:3, 0].tolist() == [0, 9, 6] and td["id"][1].tolist() == [9, 10, 11]
