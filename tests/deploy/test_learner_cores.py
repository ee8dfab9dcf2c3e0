"""learner.pin_cores: the plan of cores, the refusals, and threads really moved.

Each test that changes an affinity does so in a process of its own, so that the test
process keeps every core.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from millpond.deploy.launch_config import LaunchConfig, load_config
from millpond.deploy.learner_cores import CorePlan, job_plan, pin_processes, plan_cores
from millpond.errors import InvalidConfigError

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's"
)


def test_each_learner_gets_its_own_block_of_the_last_cores():
    assert plan_cores([0, 1], 1, 1) == CorePlan(learners=((1,),), rest=(0,))
    assert plan_cores([3, 0, 2, 1, 5, 4, 7, 6], 2, 2) == CorePlan(
        learners=((4, 5), (6, 7)), rest=(0, 1, 2, 3)
    )
    # cores this process may run on need not be contiguous (a cpuset, taskset)
    assert plan_cores([2, 5, 9], 1, 1) == CorePlan(learners=((9,),), rest=(2, 5))


def test_no_plan_leaves_the_rest_of_the_job_without_a_core():
    assert plan_cores([0], 1, 1) is None
    assert plan_cores([0, 1], 2, 1) is None
    assert plan_cores([0, 1, 2, 3], 1, 4) is None


def test_false_and_a_cluster_share_the_cores_and_true_on_a_cluster_is_refused():
    assert job_plan(False, 1, 1, local=True) is None
    assert job_plan("auto", 1, 1, local=False) is None
    with pytest.raises(InvalidConfigError, match=r"learner\.pin_cores: true .*cluster"):
        job_plan(True, 1, 1, local=False)


def test_the_config_takes_auto_true_or_false_only(tmp_path):
    assert LaunchConfig().learner.pin_cores == "auto"
    path = tmp_path / "job.yaml"
    path.write_text("learner:\n  pin_cores: false\n")
    assert load_config(path).learner.pin_cores is False
    path.write_text("learner:\n  pin_cores: sometimes\n")
    with pytest.raises(InvalidConfigError, match=r"learner\.pin_cores: 'sometimes'"):
        load_config(path)


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@linux_only
def test_true_on_a_machine_of_too_few_cores_is_refused_and_auto_shares():
    out = _run(
        """
        import os
        from millpond.deploy.learner_cores import job_plan
        from millpond.errors import InvalidConfigError
        first = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {first})  # a process that may run on one core only
        print(job_plan("auto", 1, 1, local=True))
        try:
            job_plan(True, 1, 1, local=True)
        except InvalidConfigError as e:
            print(e)
        """
    )
    auto, refused = out.splitlines()
    assert auto == "None"
    assert "learner.pin_cores" in refused and "would hold all 1 cores" in refused


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move between")
def test_pinning_a_process_moves_every_thread_and_threads_started_later_inherit_it():
    out = _run(
        """
        import os, threading
        from millpond.deploy.learner_cores import pin_this_process, pin_this_thread

        def allowed(tid):
            with open(f"/proc/self/task/{tid}/status") as f:
                line = next(l for l in f if l.startswith("Cpus_allowed_list"))
            return line.split(":")[1].strip()

        stop = threading.Event()
        early = threading.Thread(target=stop.wait)  # started before the pin
        early.start()
        last = max(os.sched_getaffinity(0))
        pin_this_process([last])
        late = threading.Thread(target=stop.wait)  # started after it
        late.start()
        print(sorted({allowed(t) for t in os.listdir("/proc/self/task")}))
        before = pin_this_thread(None)  # None: left as it is
        print(sorted(before))
        stop.set()
        """
    )
    threads, kept = out.splitlines()
    last = max(os.sched_getaffinity(0))
    assert threads == str([str(last)])
    assert kept == str([last])


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move between")
def test_pinning_other_processes_moves_each_of_their_threads_and_passes_over_ended_ones():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    try:
        assert child.stdout.readline().strip() == "up"  # both its threads run
        last = max(os.sched_getaffinity(0))
        assert pin_processes([child.pid, ended.pid], [last]) == 1
        tasks = os.listdir(f"/proc/{child.pid}/task")
        assert len(tasks) == 2
        assert all(os.sched_getaffinity(int(t)) == {last} for t in tasks)
        assert len(os.sched_getaffinity(0)) >= 2  # this process is left as it was
    finally:
        child.kill()
        child.wait()


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move between")
def test_a_job_pins_the_processes_started_since_its_plan_and_gives_its_thread_back():
    out = _run(
        """
        import os, subprocess, sys
        from millpond.deploy.learner_cores import JobCores

        def sleeper():
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

        own = sleeper()  # the program's own child, there before the job's plan
        cores = JobCores()
        cores.plan_own_ray("auto", 1, 1, local=True)
        jobs, learner = sleeper(), sleeper()  # started for the job: Ray's, a learner
        moved = cores.pin_the_rest({learner.pid})
        print(moved, cores.plan.rest)
        for p in (own, jobs, learner):
            print(sorted(os.sched_getaffinity(p.pid)))
        print(sorted(os.sched_getaffinity(0)))
        cores.unpin()
        print(sorted(os.sched_getaffinity(0)))
        for p in (own, jobs, learner):
            p.kill()
        """
    )
    every = sorted(os.sched_getaffinity(0))
    rest = every[:-1]
    lines = out.splitlines()
    assert lines[0] == f"1 {tuple(rest)}"
    assert lines[1:] == [str(every), str(rest), str(every), str(rest), str(every)]
