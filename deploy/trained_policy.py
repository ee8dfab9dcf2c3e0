"""A run's trained policy, to act with outside the run: ``millpond.load_policy(RUN_DIR)``.

A ``millpond launch`` run directory holds the job's ``config.yaml`` and the learner's
``checkpoint.pt``. :func:`load_policy` rebuilds from them the network the run's env actors
acted with (the same factory and arguments, through
:func:`~millpond.deploy.env_fleet.actor_config`), loads the learner's weights into it, and
returns it as a :class:`TrainedPolicy`: a ``torch.nn.Module`` that maps observations to
the actions the policy takes.

Observations are the run's env's, **after its wrappers** (``env.wrappers``: e.g.
``AtariPreprocessing`` then ``FrameStackObservation`` give ``uint8[4, 84, 84]``):
:meth:`TrainedPolicy.make_env` builds that env (id, kwargs and wrappers of the run), so
its observations go to :meth:`TrainedPolicy.act` as they come.

How it acts follows the algorithm (:data:`ACTING`): PPO's categorical policy takes its
mode (``argmax`` of the logits) or, with ``deterministic=False``, samples (on ``Box``
actions, its Gaussian's mean or a draw, clipped to the bounds); DQN acts by
``argmax Q``; SAC's squashed Gaussian takes ``tanh`` of its mean (or samples), TD3's
policy is deterministic, both scaled to the env's action bounds. A new learner adds its entry there: the checkpoint entry of the network its
actors act with (the weights it publishes), and whether that policy can sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from millpond.actors.envs import make_env, observation_leaves
from millpond.actors.policies import ModulePolicy, make_policy
from millpond.deploy.env_fleet import actor_config
from millpond.deploy.launch_config import LaunchConfig, load_config
from millpond.deploy.preflight import env_spaces
from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.learner.networks import network_for

if TYPE_CHECKING:
    from millpond.deploy.evaluation import Evaluation

__all__ = ["ACTING", "TrainedPolicy", "build_policy", "load_policy"]

#: Per ``learner.algorithm``: the ``checkpoint.pt`` entry that holds the network the env
#: actors act with (the weights the learner publishes), and whether the policy can sample
#: (``False``: it acts by its mode only, as a Q-network's ``argmax``).
ACTING: dict[str, tuple[str, bool]] = {
    "ppo": ("policy", True),
    "dqn": ("q_network", False),
    "sac": ("policy", True),  # the squashed Gaussian; its mode is tanh(mean)
    "td3": ("policy", False),  # deterministic; exploration noise is the actors' alone
}


class TrainedPolicy(nn.Module):
    """The acting network of a run, with the run's config (see the module docstring).

    ``policy(observations)`` takes a batch of observations as a tensor ``[B, *obs_shape]``
    (a ``Dict`` observation space: a TensorDict ``[B]`` of its keys) and returns the
    actions ``[B, *action_shape]``; :meth:`act` does the same for the env's own
    observations (numpy, one or a batch).

    Attributes:
        config: the run's config.
        network: the acting network itself (e.g. the PPO policy's logits, DQN's ``Q(s, .)``).
        observation_space: the observations it takes (the run's env, wrappers applied).
        action_space: the actions it returns.
        deterministic: whether it acts by its mode (``argmax``) instead of sampling.
        version: the weight version it holds (``-1``: none loaded).
    """

    def __init__(
        self,
        config: LaunchConfig,
        network: nn.Module,
        observation_space: gym.Space,
        action_space: gym.Space,
        *,
        deterministic: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.network = network
        self.observation_space = observation_space
        self.action_space = action_space
        self.deterministic = deterministic
        self.version = -1
        # The actors' own acting rule (argmax / sampling, the action cast to the env's dtype).
        self._acting = ModulePolicy(
            network, observation_space, action_space, deterministic=deterministic, seed=seed
        )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int = -1) -> None:
        """Load the acting network's weights (as the learner publishes them)."""
        self._acting.load_state_dict(state_dict)
        self.version = int(version)

    @torch.no_grad()
    def forward(self, observation: torch.Tensor | TensorDict) -> torch.Tensor:
        """The actions ``[B, ...]`` for a batch of observations ``[B, ...]``."""
        if isinstance(observation, TensorDict):
            batch = observation
        else:
            batch = TensorDict({"observation": observation}, batch_size=observation.shape[:1])
        return self._acting(batch, 0)["action"]

    def act(self, observation: Any) -> np.ndarray:
        """The action for one observation as the env returns it (numpy, a number, or a dict
        of them), or the actions ``[B, ...]`` for a batch of them (e.g. from a vector env)."""
        leaves = observation_leaves(observation)
        key = next(iter(leaves))
        shape = tuple(_subspace(self.observation_space, key).shape)
        first = leaves[key]
        single = tuple(first.shape) == shape
        if not single and tuple(first.shape[1:]) != shape:
            raise InvalidDataError(
                f"observation {'.'.join(key)} has shape {list(first.shape)}; this policy takes "
                f"{self.observation_space} (one observation, or a batch of them)"
            )
        batch = TensorDict(batch_size=[1 if single else first.shape[0]])
        for k, value in leaves.items():
            batch.set(k, value.unsqueeze(0) if single else value)
        actions = self._acting(batch, 0)["action"].numpy()
        return actions[0] if single else actions

    def make_env(self, env_id: str | None = None, render_mode: str | None = None) -> gym.Env:
        """The run's env as its actors made it: ``env.id`` (or ``env_id``, which must have the
        same spaces), ``env.kwargs`` and ``env.wrappers``; ``render_mode`` e.g.
        ``"rgb_array"``."""
        c = self.config.env
        kwargs = dict(c.kwargs)
        if render_mode is not None:
            kwargs["render_mode"] = render_mode
        env = make_env(env_id or c.id, kwargs, c.wrappers)
        spaces = (env.observation_space, env.action_space)
        if spaces != (self.observation_space, self.action_space):
            env.close()
            raise InvalidConfigError(
                f"env {env_id!r}: its observation and action spaces {spaces[0]}, {spaces[1]} "
                f"(the run's wrappers applied) are not the policy's: {self.observation_space}, "
                f"{self.action_space} ({c.id})"
            )
        return env

    def evaluate(
        self,
        episodes: int = 10,
        *,
        seed: int = 0,
        env_id: str | None = None,
        video_dir: str | Path | None = None,
    ) -> Evaluation:
        """Play ``episodes`` episodes (episode ``i`` reset with seed ``seed + i``); their
        returns. See :func:`millpond.deploy.evaluation.evaluate`."""
        from millpond.deploy.evaluation import evaluate  # it uses this module's policies

        return evaluate(self, episodes, seed=seed, env_id=env_id, video_dir=video_dir)


def build_policy(
    config: LaunchConfig, *, deterministic: bool = True, seed: int | None = None
) -> TrainedPolicy:
    """The acting network of a job of ``config``, as its env actors build it (initial
    weights; :meth:`TrainedPolicy.load_weights` loads trained ones). ``seed`` seeds the
    sampling of a policy that samples (``deterministic=False``)."""
    algorithm = config.learner.algorithm
    if algorithm not in ACTING:
        raise InvalidConfigError(f"learner.algorithm: no acting network known for {algorithm!r}")
    if not deterministic and not ACTING[algorithm][1]:
        raise InvalidConfigError(
            f"deterministic=False: a {algorithm} policy acts by its argmax only"
        )
    obs_space, act_space = env_spaces(config)
    try:
        network = network_for(obs_space, config.learner.network)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"learner.network: {e}") from None
    actor = actor_config(config, config.replay.table_config().name, network)
    acting = make_policy(actor.policy, obs_space, act_space, 1, policy_kwargs=actor.policy_kwargs)
    assert isinstance(acting, ModulePolicy)  # the launch's actors always get a network
    return TrainedPolicy(
        config, acting.module, obs_space, act_space, deterministic=deterministic, seed=seed
    )


def load_policy(
    run_dir: str | Path, *, deterministic: bool = True, seed: int | None = None
) -> TrainedPolicy:
    """The trained policy of a ``millpond launch`` run directory: its ``config.yaml`` and
    the learner's ``checkpoint.pt`` (see the module docstring). It takes the run's env's
    observations after the run's wrappers, as :meth:`TrainedPolicy.make_env` gives them.

    Args:
        run_dir: the run directory.
        deterministic: act by the policy's mode (``argmax``); ``False`` samples (PPO).
        seed: seeds the sampling.

    Raises :class:`~millpond.errors.InvalidConfigError` naming what the directory lacks.
    """
    run = Path(run_dir)
    config_path, checkpoint_path = run / "config.yaml", run / "checkpoint.pt"
    for path in (config_path, checkpoint_path):
        if not path.is_file():
            raise InvalidConfigError(
                f"{run}: no {path.name} (not the directory of a millpond launch run that "
                "started its learner)"
            )
    config = load_config(config_path)
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    algorithm = config.learner.algorithm
    if state.get("algorithm") != algorithm:
        raise InvalidDataError(
            f"{checkpoint_path}: a {state.get('algorithm')!r} checkpoint, but config.yaml "
            f"says learner.algorithm {algorithm!r}"
        )
    policy = build_policy(config, deterministic=deterministic, seed=seed)
    entry = ACTING[algorithm][0]
    if entry not in state:
        raise InvalidDataError(f"{checkpoint_path}: no {entry!r} network in it")
    policy.load_weights(state[entry], state.get("version", -1))
    return policy


def _subspace(space: gym.Space, key: tuple[str, ...]) -> gym.Space:
    """The space of one observation leaf (``("observation",)``: the space itself)."""
    if not isinstance(space, gym.spaces.Dict):
        return space
    for part in key:
        space = space[part]
    return space
