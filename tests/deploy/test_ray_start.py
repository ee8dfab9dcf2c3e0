"""How a job starts its own Ray: the wait for Ray's GCS a small machine needs, a user's
setting kept."""

from __future__ import annotations

from millpond.deploy import ray_start


def test_a_local_ray_waits_longer_for_its_gcs_unless_told(monkeypatch):
    monkeypatch.delenv(ray_start.GCS_PORT_WAIT_VAR, raising=False)
    ray_start.local_ray_waits_for_its_gcs()
    assert ray_start.GCS_PORT_WAIT_S == "120"
    assert ray_start.os.environ[ray_start.GCS_PORT_WAIT_VAR] == "120"  # Ray's own: 30
    monkeypatch.setenv(ray_start.GCS_PORT_WAIT_VAR, "45")
    ray_start.local_ray_waits_for_its_gcs()
    assert ray_start.os.environ[ray_start.GCS_PORT_WAIT_VAR] == "45"
