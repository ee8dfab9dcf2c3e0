"""How a job starts its own Ray: the wait for Ray's GCS a small machine needs, a user's
setting kept, and a start whose raylet missed Ray's registration wait made again."""

from __future__ import annotations

import os
import time

from millpond.deploy import ray_start


def test_a_local_ray_waits_longer_for_its_gcs_unless_told(monkeypatch):
    monkeypatch.delenv(ray_start.GCS_PORT_WAIT_VAR, raising=False)
    ray_start.local_ray_waits_for_its_gcs()
    assert ray_start.GCS_PORT_WAIT_S == "120"
    assert ray_start.os.environ[ray_start.GCS_PORT_WAIT_VAR] == "120"  # Ray's own: 30
    monkeypatch.setenv(ray_start.GCS_PORT_WAIT_VAR, "45")
    ray_start.local_ray_waits_for_its_gcs()
    assert ray_start.os.environ[ray_start.GCS_PORT_WAIT_VAR] == "45"


def test_the_processes_below_this_one_are_found_and_stopped():
    import subprocess
    import sys

    # a child that starts a grandchild, both sleeping
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)",
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while len(ray_start.descendants(os.getpid()) - {child.pid}) < 1:
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.05)
        below = ray_start.descendants(os.getpid())
        assert child.pid in below and len(below) == 2
        assert ray_start.stop_processes(below) == 2
        # the child reaped here (no zombie left below), the grandchild by init
        deadline = time.monotonic() + 10
        while ray_start.descendants(os.getpid()):
            assert time.monotonic() < deadline, ray_start.descendants(os.getpid())
            time.sleep(0.05)
    finally:
        child.kill()


# A local start whose raylet misses Ray's registration wait: here the GCS answers "not
# registered" for the first start's whole 30 s (Ray's real wait, fixed in its code).
_MISSED_REGISTRATION = """
import os, sys, time
import ray
import ray._private.services as services
from millpond.deploy import ray_start

real_get_node = services.get_node
refused_until = []

def get_node(*args, **kwargs):
    if not refused_until:
        refused_until.append(time.monotonic() + 31)
    if time.monotonic() < refused_until[0]:
        raise RuntimeError("not registered (test)")
    return real_get_node(*args, **kwargs)

services.get_node = get_node
ray_start.init_ray(None, num_cpus=1, log_to_driver=False)
assert ray.get(ray.remote(lambda: 7).remote()) == 7
print("processes", len(ray_start.descendants(os.getpid())), flush=True)
ray.shutdown()
"""


def test_a_local_start_whose_raylet_misses_its_registration_is_stopped_and_made_again():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _MISSED_REGISTRATION], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "did not start" in result.stderr and "starting it again" in result.stderr
    # the first start's processes are gone: as many below the driver as one instance has
    counted = int(result.stdout.split("processes")[1].split()[0])
    alone = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, ray; from millpond.deploy import ray_start; "
            "ray.init(address='local', num_cpus=1, include_dashboard=False, log_to_driver=False); "
            "print(len(ray_start.descendants(os.getpid())))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert counted == int(alone.stdout.split()[-1]), (counted, alone.stdout)
