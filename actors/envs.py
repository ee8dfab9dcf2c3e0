"""The loop's vector envs: building them, reading their autoreset mode, observations as tensors.

An env is a gymnasium id (built with ``gymnasium.make_vec``, sync or async), a ready
``VectorEnv``, or a callable returning one. Observations become tensors keyed as TorchRL's
gym wrappers key them: ``("observation",)`` for a non-dict space, the space's own (possibly
nested) keys for a ``Dict`` space.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from millpond.errors import InvalidConfigError, MillpondError
from millpond.spec import Key

__all__ = [
    "EnvSpec",
    "autoreset_mode_of",
    "check_observation_space",
    "make_vector_env",
    "observation_leaves",
    "parse_autoreset_mode",
]

#: What ``env=`` accepts: an env id, a ``VectorEnv``, or a callable returning one.
EnvSpec = str | gym.vector.VectorEnv | Callable[[], gym.vector.VectorEnv]


def parse_autoreset_mode(mode: object) -> AutoresetMode | None:
    """An :class:`AutoresetMode` from itself or a name (``"same_step"``, ``"SameStep"``, ...)."""
    if isinstance(mode, AutoresetMode):
        return mode
    if isinstance(mode, str):
        name = mode.replace("_", "").replace("-", "").lower()
        for m in AutoresetMode:
            if m.value.lower() == name:
                return m
    return None


def autoreset_mode_of(env: gym.vector.VectorEnv) -> AutoresetMode:
    """The env's ``metadata["autoreset_mode"]`` (NEXT_STEP when absent); DISABLED is refused."""
    mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    parsed = parse_autoreset_mode(mode)
    if parsed is None:
        raise InvalidConfigError(f"the vector env has an unknown autoreset mode {mode!r}")
    if parsed == AutoresetMode.DISABLED:
        raise InvalidConfigError(
            "the vector env's autoreset mode is DISABLED; the loop needs NEXT_STEP or "
            "SAME_STEP (e.g. gymnasium.make_vec(..., vector_kwargs={'autoreset_mode': "
            "'same_step'}))"
        )
    return parsed


def check_observation_space(space: gym.Space) -> None:
    """Raise unless ``space`` is Box, Discrete, MultiDiscrete, MultiBinary or a Dict of them."""
    if isinstance(space, gym.spaces.Dict):
        for sub in space.spaces.values():
            check_observation_space(sub)
    elif not isinstance(
        space,
        gym.spaces.Box | gym.spaces.Discrete | gym.spaces.MultiDiscrete | gym.spaces.MultiBinary,
    ):
        raise InvalidConfigError(
            f"observation space {space} is not supported: use Box, Discrete, MultiDiscrete, "
            "MultiBinary or a Dict of them"
        )


def observation_leaves(obs: Any, num_envs: int | None = None) -> dict[Key, torch.Tensor]:
    """Observation leaves as tensors (own copies), keyed ``("observation",)`` or by dict key.

    With ``num_envs``, each leaf must be batched: ``num_envs`` rows first.
    """
    out: dict[Key, torch.Tensor] = {}

    def visit(value: Any, key: Key) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, (*key, str(k)))
        else:
            out[key or ("observation",)] = torch.from_numpy(np.array(value, copy=True))

    visit(obs, ())
    if num_envs is not None:
        for key, value in out.items():
            if value.ndim == 0 or value.shape[0] != num_envs:
                raise MillpondError(
                    f"observation {key} has shape {list(value.shape)}, expected "
                    f"{num_envs} lanes first"
                )
    return out


def make_vector_env(
    env: EnvSpec,
    num_envs: int | None = None,
    vectorization_mode: str = "sync",
    autoreset_mode: str | AutoresetMode | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
) -> tuple[gym.vector.VectorEnv, bool]:
    """The vector env for ``env``, and whether the caller owns it (built it, must close it).

    An id is built with ``gymnasium.make_vec(env, num_envs, vectorization_mode,
    vector_kwargs={"autoreset_mode": ...}, **env_kwargs)``; a ``VectorEnv`` is used as it
    is (not owned); a callable is called.
    """
    if isinstance(env, gym.vector.VectorEnv):
        return env, False
    if isinstance(env, str):
        if num_envs is None:
            raise InvalidConfigError(f"num_envs is needed to build env {env!r}")
        if vectorization_mode not in ("sync", "async"):
            raise InvalidConfigError(
                f"vectorization_mode ({vectorization_mode!r}) must be 'sync' or 'async'"
            )
        vector_kwargs = {}
        if autoreset_mode is not None:
            mode = parse_autoreset_mode(autoreset_mode)
            if mode is None or mode == AutoresetMode.DISABLED:
                raise InvalidConfigError(
                    f"autoreset_mode ({autoreset_mode!r}) must be 'same_step' or 'next_step'"
                )
            vector_kwargs["autoreset_mode"] = mode
        made = gym.make_vec(
            env,
            num_envs=num_envs,
            vectorization_mode=vectorization_mode,
            vector_kwargs=vector_kwargs,
            **dict(env_kwargs or {}),
        )
        return made, True
    if callable(env):
        made = env()
        if not isinstance(made, gym.vector.VectorEnv):
            raise InvalidConfigError(
                f"the env factory returned {type(made).__name__}, expected a gymnasium VectorEnv"
            )
        return made, True
    raise InvalidConfigError(
        f"env ({env!r}) must be an env id, a gymnasium VectorEnv or a callable returning one"
    )
