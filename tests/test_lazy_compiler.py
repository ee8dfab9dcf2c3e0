"""tensordict's compile marks wait for ``torch._dynamo`` and end the same (millpond._lazy_compiler).

Each case runs in a fresh interpreter: which modules a process has imported is the point.
"""

import json
import subprocess
import sys
import textwrap

# The marks tensordict's modules hold once torch._dynamo is loaded: the names of the
# functions Dynamo is told to put in the graph as they are, or to take as constants.
_MARKS = textwrap.dedent(
    """
    import json, sys
    import torch._dynamo
    from torch._dynamo import trace_rules
    allowed, constant = set(), set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("tensordict") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if not callable(value):
                continue
            if id(value) in trace_rules._allowed_callable_ids:
                allowed.add(f"{name}.{attr}")
            if getattr(value, "_dynamo_marked_constant", False):
                constant.add(f"{name}.{attr}")
    print(json.dumps({"allowed": sorted(allowed), "constant": sorted(constant)}))
    """
)


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_shard_an_env_actor_and_the_driver_import_without_torch_dynamo():
    loaded = _run(
        "import sys\n"
        "import millpond.deploy.replay_actor, millpond.actors.ray_actor\n"
        "import millpond.deploy.launch, millpond.learner.client, tensordict\n"
        "print('torch._dynamo' in sys.modules)"
    )
    assert loaded == "False"


def test_the_recorded_marks_are_those_of_a_plain_tensordict_import():
    plain = json.loads(_run("import tensordict\n" + _MARKS))
    lazy = json.loads(_run("import millpond.learner.client, tensordict\n" + _MARKS))
    assert plain["allowed"] and plain["constant"], "tensordict marks nothing: check the test"
    assert lazy == plain


def test_marks_apply_at_once_when_torch_dynamo_was_there_first_and_after_it_loads():
    out = _run(
        "import torch._dynamo, millpond.segments, tensordict, torch\n"
        "import torch.compiler as c\n"
        "from torch._dynamo import trace_rules\n"
        "def f(x):\n"
        "    return x\n"
        "c.allow_in_graph(f)\n"
        "print(c.allow_in_graph.__module__, id(f) in trace_rules._allowed_callable_ids)"
    )
    assert out == "torch.compiler True"
