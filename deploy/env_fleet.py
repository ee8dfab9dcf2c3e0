"""The env actors of a ``millpond launch`` job: the env they step, the actor config that
the job's config and the learner's network make, and the fleet driven from a background
thread.

The env actors build the learner's policy network (``mlp`` or ``nature_cnn``, a policy
head for PPO, a Q head for DQN, SAC's squashed Gaussian or TD3's deterministic policy) so that the weights the
learner publishes load into theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from millpond.actors.apex import ApexPriorities
from millpond.actors.envs import make_env
from millpond.actors.fleet import ActorFleet, FleetStatus
from millpond.actors.policies import EpsilonGreedy
from millpond.actors.ray_actor import ActorConfig
from millpond.learner.networks import network_for

if TYPE_CHECKING:
    from millpond.deploy.launch_config import LaunchConfig
    from millpond.learner.client import ReplayClient

__all__ = ["EnvFleet", "actor_config", "fleet_options", "network_of"]

#: Seconds an env actor's run call collects for (whole chunks, at least one) before it
#: reports: a call a chunk made the driver's and the actor's Ray round trips ~5% of a
#: CartPole DQN job's frames/s on 2 cores; the progress line comes every 2 s.
ACTOR_CALL_S = 0.25


def network_of(config: LaunchConfig) -> str:
    """The learner's network family (``mlp`` / ``nature_cnn``), from one env made."""
    c = config
    probe = make_env(c.env.id, c.env.kwargs, c.env.wrappers)
    try:
        return network_for(probe.observation_space, c.learner.network)
    finally:
        probe.close()


def actor_config(config: LaunchConfig, table: str, network: str) -> ActorConfig:
    """What each env actor runs: the job's env, table and actor settings, and the policy
    network of the learner's family ``network``."""
    c = config
    epsilon = None
    if c.actors.epsilon_start is not None:
        epsilon = EpsilonGreedy(
            c.actors.epsilon_start, c.actors.epsilon_end, c.actors.epsilon_decay_frames
        )
    head = {"ppo": "policy", "dqn": "q", "sac": "sac_actor", "td3": "td3_actor"}[
        c.learner.algorithm
    ]
    module = "box_networks" if c.learner.algorithm in ("sac", "td3") else "networks"
    if network == "nature_cnn":
        factory, kwargs = f"nature_cnn_{head}", {}
    else:
        factory, kwargs = f"mlp_{head}", {"hidden": tuple(c.learner.hidden_sizes)}
        if c.learner.dueling:
            kwargs["dueling"] = True
        if c.learner.activation != "tanh":
            kwargs["activation"] = c.learner.activation
        if c.learner.algorithm == "ppo" and c.learner.ppo.normalize_observations:
            kwargs["normalize_observations"] = True
    return ActorConfig(
        env=c.env.id,
        table=table,
        num_envs=c.actors.num_envs,
        chunk_len=c.actors.chunk_len,
        vectorization_mode=c.env.vectorization_mode,
        # SAME_STEP (no step lost to a reset) where the env ids' lanes are vectorised by
        # gymnasium; a registered vector env resets in its own mode
        autoreset_mode=(None if c.env.vectorization_mode == "vector_entry_point" else "same_step"),
        env_kwargs=dict(c.env.kwargs),
        env_wrappers=tuple(c.env.wrappers),
        policy=f"millpond.learner.{module}:{factory}",
        policy_kwargs=kwargs,
        deterministic=c.actors.deterministic,
        epsilon=epsilon,
        noise=c.actors.action_noise(),
        weight_sync_every=c.actors.weight_sync_every,
        max_in_flight=c.actors.max_in_flight,
        processors=tuple(c.actors.processors) or None,
        priorities=(
            ApexPriorities(c.learner.dqn.gamma, c.learner.dqn.n_step, c.learner.dqn.priority_eps)
            if c.actors.apex_priorities
            else None
        ),
        seed=c.run.seed,
    )


def fleet_options(config: LaunchConfig) -> dict[str, Any]:
    """The :class:`~millpond.actors.ActorFleet` settings of the job's config: its actors,
    their placement and restarts, and ``run.return_window`` as the episodes the fleet's
    mean return averages over."""
    c = config
    return {
        "num_actors": c.actors.num_actors,
        "num_cpus": c.actors.num_cpus,
        "resources": dict(c.actors.resources),
        "label_selector": dict(c.actors.label_selector) or None,
        "max_restarts": c.actors.max_restarts,
        "window": c.run.return_window,
        "seconds_per_call": ACTOR_CALL_S,
    }


class EnvFleet:
    """The job's :class:`~millpond.actors.ActorFleet` and the thread that drives it.

    The actors are created here, so that their processes start (imports, envs, writers)
    while the learners do; they act only from their first run call, made by the thread
    :meth:`start` starts once the learners have published the weights they start with.

    Args:
        client: the replay service the actors write to.
        config: the job's config (its ``actors`` section).
        actor: what each actor runs (:func:`actor_config`).
        first_index: the first actor's index (a resumed job numbers its actors on).
        frames: the frames collected before (a resumed job's).
        episodes: the episodes ended before (a resumed job's).
    """

    def __init__(
        self,
        client: ReplayClient,
        config: LaunchConfig,
        actor: ActorConfig,
        *,
        first_index: int,
        frames: int,
        episodes: int,
    ) -> None:
        c = config
        self.fleet = ActorFleet(
            client,
            actor,
            **fleet_options(c),
            first_index=first_index,
            frames=frames,
            episodes=episodes,
        )
        self.error: BaseException | None = None  # what stopped the driving thread
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def actors(self) -> list[Any]:
        """The actors' Ray handles."""
        return self.fleet.actors

    @property
    def status(self) -> FleetStatus:
        """What the actors have collected so far."""
        return self.fleet.status

    def start(self) -> None:
        """Drive the fleet from a background thread until :meth:`halt`."""
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        try:
            while not self._halt.is_set():
                self.fleet.poll(timeout_s=0.5)
        except BaseException as e:  # surfaced by the job's loop
            self.error = e
            self._halt.set()

    def halt(self) -> None:
        """Stop driving the fleet (the actors stay up)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def stop(self, meanwhile: Callable[[], bool]) -> Any:
        """Stop the env actors (flushed and closed) while ``meanwhile`` goes on (the
        learners sampling: it returns whether there are any); the fleet's final status.

        A PPO queue that is full when the job stops holds the actors' last segments back
        until something samples: with the learners idle, the actors' close waited out its
        timeouts (5 s for their runs, 5 s for their flush) and dropped those steps. Short
        waits still bound a table whose rate limiter holds inserts back for another reason.
        """
        outcome: dict[str, Any] = {}

        def stop() -> None:
            try:
                outcome["final"] = self.fleet.stop(timeout_s=5)
            except BaseException as e:  # raised below, in this thread
                outcome["error"] = e

        stopper = threading.Thread(target=stop, name="millpond-fleet-stop", daemon=True)
        stopper.start()
        while stopper.is_alive():
            if not meanwhile():
                stopper.join(0.2)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("final")
