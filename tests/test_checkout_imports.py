"""A checkout on sys.path imports whole (Ray's `--working-dir .` puts it there)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Drop any editable-install finder so that only sys.path can resolve millpond, as on a Ray
# worker whose working directory is a copy of the checkout and whose millpond is a
# regular install (or none).
_PROBE = """
import sys
sys.meta_path[:] = [
    f for f in sys.meta_path
    if "editable" not in (getattr(f, "__module__", "") + getattr(f, "__name__", "")).lower()
]
sys.path.insert(0, sys.argv[1])
for name in list(sys.modules):
    if name == "millpond" or name.startswith("millpond."):
        del sys.modules[name]
import millpond
import millpond.actors.ray_actor
import millpond.deploy.launch
import millpond.learner.client
import millpond.service.shard
for module in (millpond.service.shard, millpond.learner.client, millpond.actors.ray_actor,
               millpond.deploy.launch):
    print(module.__file__)
print(millpond.ReplayClient.__module__)
"""


def test_checkout_root_on_sys_path_imports_every_subpackage(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ROOT)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    *files, client_module = result.stdout.split()
    assert [Path(f).relative_to(ROOT).parts[0] for f in files] == [
        "service",
        "learner",
        "actors",
        "deploy",
    ]
    assert client_module == "millpond.learner.client.replay_client"
