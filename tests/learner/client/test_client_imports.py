"""Loading the client library loads none of the reference learners beside it."""

import json
import subprocess
import sys

REFERENCE_LEARNERS = (
    "millpond.learner.ppo",
    "millpond.learner.dqn",
    "millpond.learner.distributed",
    "millpond.learner.networks",
    "millpond.learner.estimators",
    "millpond.learner._common",
)


def _loaded_after(statement: str) -> list[str]:
    """The reference learner modules a fresh interpreter holds after ``statement``."""
    code = (
        "import json, sys\n"
        f"{statement}\n"
        f"print(json.dumps([m for m in {REFERENCE_LEARNERS!r} if m in sys.modules]))\n"
    )
    # A fresh interpreter inherits the environment (PYTHONPATH included), so it imports
    # the same millpond as this one.
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_importing_the_client_loads_no_reference_learner():
    assert _loaded_after("import millpond.learner.client") == []


def test_the_client_names_of_millpond_learner_load_no_reference_learner():
    assert _loaded_after("from millpond.learner import ReplayClient, Writer") == []


def test_a_reference_learner_is_still_one_import_away():
    assert "millpond.learner.ppo" in _loaded_after("from millpond.learner import PPOLearner")
