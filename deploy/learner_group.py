"""The learners of a ``millpond launch`` job: their Ray actors, formed into one group, kept
busy with one ``run`` call each, restarted together, and what they report.

``learner.num_learners`` :class:`~millpond.deploy.learner_actor.LearnerActor` Ray actors
form one data-parallel ``torch.distributed`` group; rank 0 publishes the weights and speaks
for the group (its steps, version, sample age and loss), every rank drops its own stale
steps. A lost learner takes the group with it: :class:`LearnerGroup` replaces the whole
group from the last checkpoint (``learner.max_restarts`` times), since a group cannot take
a rank back.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from millpond.actors.remote_errors import first_line, from_remote
from millpond.deploy.learner_actor import LearnerActor
from millpond.deploy.placement import placement, placement_hint
from millpond.errors import MillpondError

if TYPE_CHECKING:
    from millpond.deploy.launch_config import LaunchConfig
    from millpond.deploy.resume import Resumed

__all__ = ["LearnerGroup"]


class LearnerGroup:
    """One job's learner actors, by rank, and the totals of their reports.

    Args:
        config: the job's config.
        run_dir: where ``checkpoint.pt`` is written.
        nodes: the job's record of where each part ran: the learners' entry is written
            here as they start, the driver's is read to tell where a checkpoint must go.
        say: prints a line of the job's progress.
        resumed: the job this one continues, whose steps and weight version go on.
    """

    def __init__(
        self,
        config: LaunchConfig,
        run_dir: Path,
        nodes: dict[str, Any],
        say: Callable[[str], None],
        resumed: Resumed | None = None,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.nodes = nodes
        self._say = say
        self.actors: list[Any] = []  # LearnerActor handles, by rank
        #: The cores each rank's process runs on (learner.pin_cores); None: shared.
        self.cores: tuple[tuple[int, ...], ...] | None = None
        self._spaces: tuple[Any, Any] = (None, None)  # the env's, for new learners
        self._runs: dict[Any, int] = {}  # each learner's run call in flight -> its rank
        self._connect: tuple[str, str, str | None, Any] = ("", "", None, None)
        self.lost = False  # a learner died: the others may wait in the group forever
        self.restarts = 0
        self.version: int | None = resumed.checkpoint_version if resumed else None
        self.steps = resumed.learner_steps if resumed else 0
        self.stale_steps = resumed.stale_steps if resumed else 0  # acted by too old a policy
        self.timing = {"sample_s": 0.0, "learn_s": 0.0, "publish_wait_s": 0.0}
        self._ages: deque[float] = deque(maxlen=50)
        self._age_steps: deque[float] = deque(maxlen=50)
        self._losses: deque[float] = deque(maxlen=50)
        self._publish_wait_s = 0.0  # since the last take_publish_wait()
        # The shards rank 0's client found unreachable at its last report, and the seconds
        # of its steps taken while one was, over the run.
        self.unavailable_shards: list[int] = []
        self.unavailable_s = 0.0

    @property
    def sample_age(self) -> float | None:
        """The mean sample age of rank 0's last reports: versions the policy that acted the
        sampled steps is behind the learner's (PPO: its policy lag)."""
        return sum(self._ages) / len(self._ages) if self._ages else None

    @property
    def sample_age_steps(self) -> float | None:
        """The same age in gradient steps since the acting version was published."""
        return sum(self._age_steps) / len(self._age_steps) if self._age_steps else None

    def take_publish_wait(self) -> float:
        """Seconds rank 0's publications waited for the actors (``max_policy_lag``) since
        the last call."""
        waited, self._publish_wait_s = self._publish_wait_s, 0.0
        return waited

    @property
    def loss(self) -> float | None:
        """The mean loss of rank 0's last reports."""
        return sum(self._losses) / len(self._losses) if self._losses else None

    def create(self, obs_space: Any, act_space: Any) -> None:
        """Place the learners' actors; their processes start (imports) while the caller
        goes on. :meth:`start` connects them."""
        c = self.config
        n = c.learner.num_learners
        remote = ray.remote(LearnerActor).options(
            num_cpus=c.learner.num_cpus,
            num_gpus=c.learner.num_gpus,
            max_restarts=0,  # the driver restarts the whole group (it cannot take a rank back)
            **placement(c.learner.resources, c.learner.label_selector),
        )
        self._spaces = (obs_space, act_space)
        self.actors = [
            remote.remote(
                c,
                obs_space,
                act_space,
                rank=rank,
                world_size=n,
                cores=self.cores[rank] if self.cores else None,
            )
            for rank in range(n)
        ]

    def connect(self, addresses: str, table: str, token: str | None, resolver: Any) -> None:
        """The replay service and table the learners sample, for :meth:`start`."""
        self._connect = (addresses, table, token, resolver)

    def start(self, restore: bytes | None = None, version: int | None = None) -> None:
        """Place the learners (unless :meth:`create` did), form their group (from the
        checkpoint ``restore``, if given, the weight version going on from ``version``,
        else from the service's), publish their weights."""
        c = self.config
        n = c.learner.num_learners
        if not self.actors:
            self.create(*self._spaces)
        addresses, table, token, resolver = self._connect
        connect = {"token": token, "tls": c.replay.tls, "resolver": resolver}
        try:
            described = ray.get(
                [learner.describe.remote() for learner in self.actors],
                timeout=c.learner.start_timeout_s,
            )
            master = ray.get(self.actors[0].rendezvous.remote()) if n > 1 else None
            ray.get(
                [
                    learner.start.remote(addresses, table, master, restore, version, **connect)
                    for learner in self.actors
                ],
                timeout=c.learner.start_timeout_s,
            )
        except ray.exceptions.GetTimeoutError:
            raise MillpondError(
                f"the learners did not start within learner.start_timeout_s="
                f"{c.learner.start_timeout_s:g} s: they need {n * c.learner.num_cpus:g} CPUs"
                f" and {n * c.learner.num_gpus:g} GPUs free in the Ray cluster (learner."
                f"num_learners x num_cpus / num_gpus){placement_hint(c.learner)}; see "
                "`ray status`"
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise from_remote(e, "a learner failed to start") from e
        self.nodes["learners"] = described
        # Every rank counts the version; rank 0 sends the weights the actors start with.
        self.version = ray.get([learner.publish.remote() for learner in self.actors])[0]

    def _restart(self, rank: int, error: BaseException) -> None:
        """Replace the whole group by new learners that start from the last checkpoint."""
        self.restarts += 1
        path = self.run_dir / "checkpoint.pt"
        self._say(
            f"learner {rank} died ({first_line(error)}); restarting the learners from "
            f"{path.name} (restart {self.restarts} of "
            f"{self.config.learner.max_restarts})"
        )
        for learner in self.actors:  # the survivors would wait for the lost rank forever
            with contextlib.suppress(Exception):
                ray.kill(learner, no_restart=True)
        self.actors, self._runs = [], {}
        self.start(restore=path.read_bytes())

    def poll(self, timeout_s: float = 0.2, submit: bool = True) -> None:
        """Collect the learners' finished run calls, and give each its next one."""
        if submit:
            busy = set(self._runs.values())
            for rank, learner in enumerate(self.actors):
                if rank not in busy:
                    self._runs[learner.run.remote()] = rank
        if not self._runs:
            return
        ready, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=timeout_s)
        for ref in ready:
            rank = self._runs.pop(ref)
            try:
                report = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if self.restarts < self.config.learner.max_restarts:
                    self._restart(rank, e)
                    return
                self.lost = True
                raise MillpondError(
                    f"learner {rank} died ({first_line(e)}) and learner.max_restarts="
                    f"{self.config.learner.max_restarts} are spent: the job stops, keeping the "
                    "last checkpoint.pt"
                ) from None
            except ray.exceptions.RayTaskError as e:
                raise from_remote(e, f"learner {rank}") from e
            self.stale_steps += report["dropped"]  # every rank drops its own stale steps
            if rank != 0:  # the ranks step together: rank 0 speaks for the group
                continue
            self.timing["sample_s"] += report["sample_s"]
            self.timing["learn_s"] += report["update_s"]
            self.steps += report["steps"]
            self.version = report["version"]
            self._publish_wait_s += report.get("publish_wait_s", 0.0)
            self.timing["publish_wait_s"] += report.get("publish_wait_s", 0.0)
            self.unavailable_shards = report.get("unavailable_shards", [])
            self.unavailable_s += report.get("unavailable_s", 0.0)
            if report["sample_age"] is not None:
                self._ages.append(report["sample_age"])
            if report.get("sample_age_steps") is not None:
                self._age_steps.append(report["sample_age_steps"])
            if report["loss"] is not None:
                self._losses.append(report["loss"])

    def keep_learning(self) -> bool:
        """One short :meth:`poll` while the learners are there to poll (its errors were
        reported already); whether they were."""
        if not self.actors or self.lost:
            return False
        with contextlib.suppress(MillpondError):  # the loop reported it already
            self.poll(timeout_s=0.2)
        return True

    def finish_runs(self, timeout_s: float = 30.0) -> None:
        """Collect the run calls still in flight, submitting no more."""
        deadline = time.monotonic() + timeout_s
        while self._runs and time.monotonic() < deadline:
            with contextlib.suppress(MillpondError):  # reported by the loop already
                self.poll(timeout_s=1.0, submit=False)

    def save_checkpoint(self) -> Path:
        """Rank 0 writes ``checkpoint.pt`` into the run directory on its node; when that is
        another node, the driver writes the bytes it returns here too."""
        path = (self.run_dir / "checkpoint.pt").resolve()
        learner = self.nodes.get("learners", [{}])[0]
        elsewhere = learner.get("node_id") != self.nodes.get("driver", {}).get("node_id")
        data = ray.get(self.actors[0].checkpoint.remote(str(path), elsewhere), timeout=120)
        if data is not None:
            tmp = path.with_suffix(".pt.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path

    def reports(self) -> list[dict[str, Any]]:
        """Each learner's totals, by rank."""
        return ray.get([lr.report.remote() for lr in self.actors], timeout=30)

    def close(self) -> None:
        """Ask each learner to close (its group, its client), waiting 30 s at most."""
        ray.wait([lr.close.remote() for lr in self.actors], timeout=30)

    def kill(self, learner: Any) -> None:
        """End one learner's actor for good."""
        ray.kill(learner, no_restart=True)
