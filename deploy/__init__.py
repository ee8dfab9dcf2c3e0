"""millpond.deploy — running millpond: the job runner and what it stands on.

:mod:`.launch` is ``millpond launch CONFIG`` (replay shards, env actors and a learner on a
local Ray instance or a cluster, to a frame budget), read from :mod:`.launch_config`; the
shards run as Ray actors (:mod:`.replay_actor`), progress and the run directory come from
:mod:`.run_report`, and :mod:`.storage_demo` is ``millpond demo``. ``configs/`` holds the
example job configs; ``container/``, ``cluster/`` and ``kuberay/`` the files to run a job
on a Ray cluster. It is the top floor: it may import every other package, and none
imports it.
"""
