"""What a finished job's summary says of ``learner.pin_cores``."""

import os


def assert_learners_hold_their_cores(summary: dict) -> None:
    """On a machine of two cores or more, each learner ran on cores of its own: none of
    them shared with the driver, a shard or an env actor (``nodes``' ``cores``)."""
    if len(os.sched_getaffinity(0)) < 2:
        return
    nodes = summary["nodes"]
    others = [nodes["driver"], *nodes["replay"], *nodes["actors"]]
    held = [set(learner["cores"]) for learner in nodes["learners"]]
    assert all(held), nodes["learners"]
    for cores in held:
        assert all(not cores & set(other["cores"]) for other in others), nodes
