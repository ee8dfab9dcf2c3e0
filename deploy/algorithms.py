"""The learner algorithms of ``millpond launch`` and the action spaces each one takes, checked
before anything of the job starts.

DQN acts on ``Discrete`` actions, SAC and TD3 on float ``Box`` actions with finite bounds
(their policies squash into them), PPO on either (a float ``Box``: its Gaussian's draws
are clipped to the bounds, which may be infinite). :func:`check_action_space` refuses a
mismatch naming both the algorithm and the env's space; the launcher checks it before Ray
starts, on the env made as every lane makes it (:func:`millpond.deploy.preflight.env_spaces`,
so wrappers count). :func:`check_sections` refuses a table, or a key of another section,
that does not fit the algorithm, naming the key. Light on purpose: gymnasium and numpy only,
imported when used, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from millpond.errors import InvalidConfigError

if TYPE_CHECKING:
    import gymnasium as gym

__all__ = ["ALGORITHMS", "check_action_space", "check_sections"]

#: What ``learner.algorithm`` takes, and the action spaces each can act in.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "ppo": ("Discrete", "Box"),
    "dqn": ("Discrete",),
    "sac": ("Box",),
    "td3": ("Box",),
}

#: The algorithms that squash their actions into the bounds, which must then be finite.
_SQUASHING = ("sac", "td3")


def check_action_space(algorithm: str, space: gym.Space, env_id: str) -> None:
    """Raise :class:`InvalidConfigError` unless ``algorithm`` can act in ``space``."""
    import numpy as np  # deferred, as gymnasium: the launcher imports this module first

    wants = ALGORITHMS.get(algorithm)
    if wants is None:
        return  # an unknown algorithm is the config check's to name
    fits = _fits(space, wants)
    squashed = fits and isinstance(space, _kind("Box")) and algorithm in _SQUASHING
    if squashed and not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        raise InvalidConfigError(
            f"learner.algorithm: {algorithm} squashes its actions into the bounds of the action "
            f"space, and env {env_id!r} has infinite ones ({space}); wrap the env, e.g. "
            "gymnasium.wrappers:RescaleAction"
        )
    if not fits:
        others = sorted(a for a, kinds in ALGORITHMS.items() if _fits(space, kinds))
        hint = f" (for this space: {' or '.join(others)})" if others else ""
        raise InvalidConfigError(
            f"learner.algorithm: {algorithm} needs a {' or '.join(wants)} action space, and env "
            f"{env_id!r} has {space}{hint}"
        )


def check_sections(config: Any) -> None:
    """Raise :class:`InvalidConfigError` naming the key unless the table and the keys that
    belong to one algorithm (exploration noise, Ape-X and learner priorities, observation
    normalisation) fit ``learner.algorithm``.

    ``config`` is a :class:`~millpond.deploy.launch_config.LaunchConfig`, typed ``Any``
    because that module calls this one (naming its class here would close an import
    circle)."""
    from millpond.config import SLICE_SAMPLERS  # deferred, as gymnasium (it loads torch)

    table = config.replay.table_config()
    learner, actors = config.learner, config.actors
    algorithm = learner.algorithm
    wants = ("queue",) if algorithm == "ppo" else ("uniform", "prioritized")
    if algorithm == "dqn" and learner.dqn.n_step > 1:
        wants = SLICE_SAMPLERS
    if table.sampler not in wants:
        raise InvalidConfigError(
            f"replay.table.sampler: {algorithm} needs a {' or '.join(wants)} table, got "
            f"{table.sampler!r}"
        )
    if algorithm == "dqn" and table.has_slices and table.strict_length:
        raise InvalidConfigError(
            "replay.table.strict_length: n-step DQN needs false, so that every stored step "
            "(the last n_step - 1 of each episode included) begins an n-step target"
        )
    if actors.exploration_noise is not None and algorithm != "td3":
        raise InvalidConfigError(
            "actors.exploration_noise: exploration noise (Gaussian or Ornstein-Uhlenbeck) is "
            f"for td3's deterministic policy (here {algorithm})"
        )
    if actors.apex_priorities and (algorithm != "dqn" or not table.has_priorities):
        raise InvalidConfigError(
            "actors.apex_priorities: Ape-X priorities are for DQN on a prioritized table "
            f"(here {algorithm} on a {table.sampler!r} table)"
        )
    section = getattr(learner, algorithm)
    if algorithm != "ppo" and section.prioritized != table.has_priorities:
        raise InvalidConfigError(
            f"learner.{algorithm}.prioritized must be true exactly when replay.table.sampler "
            f"is 'prioritized' or 'prioritized_slices' (it is {section.prioritized}, the "
            f"table {table.sampler!r})"
        )
    if learner.ppo.normalize_observations and algorithm != "ppo":
        raise InvalidConfigError(
            "learner.ppo.normalize_observations: observation normalisation is for ppo "
            f"(here {algorithm})"
        )


def _fits(space: gym.Space, kinds: tuple[str, ...]) -> bool:
    """Whether ``space`` is one of ``kinds`` (a ``Box`` only with a float dtype)."""
    import numpy as np

    if not isinstance(space, tuple(_kind(k) for k in kinds)):
        return False
    return not isinstance(space, _kind("Box")) or bool(np.issubdtype(space.dtype, np.floating))


def _kind(name: str) -> type:
    import gymnasium as gym

    return getattr(gym.spaces, name)
