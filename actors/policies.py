"""Policies that act in the collection loop: the policy contract, exploration, weight loading.

The loop hands a policy the current observations of its ``P`` lanes as a TensorDict ``[P]``
(the observation keys as the batch stores them: ``"observation"`` for a non-dict
observation space, the space's own keys for a ``Dict`` space) and gets back a dict of
tensors ``[P, ...]``: ``"action"`` and, when the policy provides them, ``"sample_log_prob"``
and ``"state_value"``. What acts is named by the ``policy`` argument:

**The policy contract.** ``policy`` is ``None`` (a :class:`RandomPolicy` that samples the
env's action space), an ``nn.Module``, a callable factory, or a ``"package.module:function"``
string naming one. A factory is called as ``factory(**policy_kwargs)``, plus
``observation_space=`` and ``action_space=`` (the single-lane spaces) when its signature
names those parameters, and returns an ``nn.Module``:

- a :class:`tensordict.nn.TensorDictModuleBase` reads the observation keys from the
  TensorDict ``[P]`` and writes ``"action"`` (or ``"logits"``, see below), optionally
  ``"sample_log_prob"`` (``"action_log_prob"``, TorchRL's current name, is taken too) and
  ``"state_value"``. Probabilistic modules sample under ``InteractionType.RANDOM`` and take
  their mode under ``InteractionType.DETERMINISTIC`` (``deterministic=True``);
- any other module is called with one argument: the observation tensor ``[P, ...]`` (in
  the env's dtype; convert inside the module) or, for a ``Dict`` space, the TensorDict
  ``[P]`` of observations. It returns a tensor, or a mapping / TensorDict. A tensor is
  logits ``[P, n]`` for a ``Discrete(n)`` action space and the action itself otherwise.
  A mapping holds ``"action"``, ``"logits"``, or (``Box`` action spaces) ``"loc"`` and
  ``"scale"``, and optionally ``"sample_log_prob"`` and ``"state_value"``.

Logits (from either kind of module) act through a categorical distribution: sampled with
the policy's seeded generator, or ``argmax`` with ``deterministic=True``; the log-probability
of the chosen action is recorded as ``"sample_log_prob"``. (A probabilistic TensorDict
module samples with torch's global generator: seed it with ``torch.manual_seed``.) The
module is moved to the CPU and runs under ``torch.no_grad()``.

``"loc"`` and ``"scale"`` (``[P, *action_shape]``, from e.g.
:func:`millpond.learner.box_networks.mlp_sac_actor`) are a tanh-squashed Gaussian over a
float ``Box`` with finite bounds (SAC's policy, :mod:`millpond.box_actions`): the policy
draws ``u = loc + scale * noise`` with its seeded generator (``u = loc`` with
``deterministic``, for evaluation), acts ``tanh(u)`` rescaled to ``[low, high]``, and
records the log-probability of ``tanh(u)`` in ``[-1, 1]``.

``"mean"`` and ``"std"`` (from :func:`millpond.learner.networks.mlp_policy` on a ``Box``
space) are an unsquashed Gaussian (continuous PPO's, as CleanRL's
``ppo_continuous_action.py``): the policy draws ``u = mean + std * noise`` (``u = mean``
with ``deterministic``), the env takes ``u`` clipped to ``[low, high]`` (recorded as
``"action"``), and the draw itself is recorded as ``"unclipped_action"`` with its
log-probability ``"sample_log_prob"``: the density of the draw, the one PPO's ratio
recomputes (the clipping being part of the env). Actions are cast to the action space's dtype before the env sees
them, and what is recorded is exactly what the env received.

**Exploration.** :class:`EpsilonGreedy` (``Discrete`` action spaces) replaces each lane's
action with a uniform random one with probability ``epsilon(frames)``, linear from
``eps_start`` to ``eps_end`` over ``decay_frames`` collected steps. When the policy's
logits are known, ``"sample_log_prob"`` is the behaviour policy's: ``log((1 - eps) * pi(a)
+ eps / n)``, with ``pi`` the greedy one-hot choice when ``deterministic``; otherwise no
log-probability is recorded. Without exploration, it is the log-probability of the action
under the policy's distribution (also for the mode, with ``deterministic``).

:class:`GaussianNoise` (``Box`` action spaces: TD3, DDPG) adds ``sigma * N(0, 1)`` to
each action element in ``[-1, 1]`` units (``sigma`` times half the element's range in the
env's units) and clips the result to the bounds, as Stable-Baselines3's
``NormalActionNoise`` does; :class:`OrnsteinUhlenbeckNoise` (DDPG's) adds a temporally
correlated process instead, one per lane, reset when its lane begins an episode
(:mod:`millpond.actors.action_noise`). ``deterministic`` policies such as
:func:`millpond.learner.box_networks.mlp_td3_actor` explore that way. No log-probability is
recorded for noisy actions.

**Weights.** :meth:`ModulePolicy.load_state_dict` loads new weights and ``version`` is
the version that acts (``-1`` until weights were loaded from a source).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType, TensorDictModuleBase, set_interaction_type
from torch import nn

from millpond.box_actions import BoxScale, gaussian_log_prob, squashed_gaussian
from millpond.errors import InvalidConfigError, InvalidDataError

from .action_noise import ActionNoise, GaussianNoise, LaneNoise, OrnsteinUhlenbeckNoise

__all__ = [
    "ActorPolicy",
    "EpsilonGreedy",
    "GaussianNoise",
    "ModulePolicy",
    "OrnsteinUhlenbeckNoise",
    "PolicySpec",
    "RandomPolicy",
    "load_factory",
    "make_policy",
]

#: What ``policy=`` accepts: ``None`` (random), a module, a factory, or ``"pkg.mod:fn"``.
PolicySpec = str | Callable[..., nn.Module] | nn.Module | None

_LOG_PROB_KEYS = ("sample_log_prob", "action_log_prob")


@dataclass(frozen=True)
class EpsilonGreedy:
    """Epsilon-greedy exploration with a linear schedule, for ``Discrete`` action spaces.

    Attributes:
        eps_start: epsilon at frame 0.
        eps_end: epsilon from ``decay_frames`` on.
        decay_frames: collected steps (frames, all lanes together) over which epsilon
            moves linearly from ``eps_start`` to ``eps_end``.
    """

    eps_start: float = 1.0
    eps_end: float = 0.05
    decay_frames: int = 10_000

    def __post_init__(self) -> None:
        for name in ("eps_start", "eps_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise InvalidConfigError(f"{name} ({value!r}) must be a number in [0, 1]")
        if (
            isinstance(self.decay_frames, bool)
            or not isinstance(self.decay_frames, int)
            or self.decay_frames < 0
        ):
            raise InvalidConfigError(
                f"decay_frames ({self.decay_frames!r}) must be a non-negative integer"
            )

    def epsilon(self, frames: int) -> float:
        """Epsilon after ``frames`` collected steps."""
        if frames >= self.decay_frames:
            return float(self.eps_end)
        frac = frames / self.decay_frames
        return float(self.eps_start + (self.eps_end - self.eps_start) * frac)


class ActorPolicy:
    """What the loop calls: ``policy(observations [P], frames) -> {key: tensor [P, ...]}``.

    The result holds ``"action"`` (in the action space's dtype) and optionally
    ``"sample_log_prob"`` and ``"state_value"``. ``version`` is the weight version that acts.
    Implements :class:`millpond.roles.Policy`.
    """

    version: int = -1
    #: ``False`` for policies that ignore the observations (the loop then hands them an
    #: empty TensorDict instead of building one each step).
    reads_observations: bool = True

    def __call__(self, observation: TensorDictBase, frames: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        raise InvalidConfigError(f"{type(self).__name__} has no weights to load")

    def reset_lanes(self, lanes: np.ndarray) -> None:
        """The lanes of the bool mask ``lanes`` ``[P]`` begin new episodes: a policy that
        keeps state per lane (Ornstein-Uhlenbeck noise) resets theirs. The loop calls it."""


class RandomPolicy(ActorPolicy):
    """Samples each lane's action from the env's single action space (seeded)."""

    reads_observations = False

    def __init__(self, action_space: gym.Space, num_envs: int, seed: int | None = None) -> None:
        self.action_space = gym.vector.utils.batch_space(action_space, num_envs)
        self.action_space.seed(seed)
        self.num_envs = num_envs

    def __call__(self, observation: TensorDictBase, frames: int) -> dict[str, torch.Tensor]:
        action = torch.from_numpy(np.array(self.action_space.sample(), copy=True))
        return {"action": action}


class ModulePolicy(ActorPolicy):
    """A torch module acting under the policy contract (see the module docstring).

    Args:
        module: an ``nn.Module`` or a ``TensorDictModuleBase``.
        observation_space: the single-lane observation space.
        action_space: the single-lane action space.
        deterministic: take the distribution's mode instead of sampling.
        epsilon: epsilon-greedy exploration (``Discrete`` action spaces only).
        noise: Gaussian or Ornstein-Uhlenbeck exploration noise (float ``Box`` action
            spaces only; :mod:`millpond.actors.action_noise`).
        seed: seeds the generator used for categorical sampling and exploration.
    """

    def __init__(
        self,
        module: nn.Module,
        observation_space: gym.Space,
        action_space: gym.Space,
        *,
        deterministic: bool = False,
        epsilon: EpsilonGreedy | None = None,
        noise: ActionNoise | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise InvalidConfigError(
                f"the policy factory returned {type(module).__name__}, expected a torch nn.Module"
            )
        self.module = module.to("cpu")
        self.action_space = action_space
        self.deterministic = bool(deterministic)
        self.epsilon = epsilon
        self.version = -1
        self._dict_obs = isinstance(observation_space, gym.spaces.Dict)
        self._discrete = isinstance(action_space, gym.spaces.Discrete)
        if epsilon is not None and not self._discrete:
            raise InvalidConfigError(
                f"epsilon-greedy needs a Discrete action space, the env has {action_space}"
            )
        self._generator = torch.Generator()
        self._generator.manual_seed(
            seed if seed is not None else int(torch.randint(2**62, (1,)).item())
        )
        self._box: BoxScale | None = None  # the bounds, for squashed Gaussians (on first use)
        self._bounds: tuple[torch.Tensor, torch.Tensor] | None = None  # for clipped ones
        self.noise = noise
        self._noise: LaneNoise | None = None
        if noise is not None:
            try:
                self._box = BoxScale(action_space)
            except InvalidConfigError as e:
                kind = "Gaussian" if isinstance(noise, GaussianNoise) else "Ornstein-Uhlenbeck"
                raise InvalidConfigError(f"{kind} exploration noise: {e}") from None
            self._noise = LaneNoise(noise, self._box, self._generator)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.module.load_state_dict(dict(state_dict))

    def reset_lanes(self, lanes: np.ndarray) -> None:
        if self._noise is not None:
            self._noise.reset(lanes)

    def __call__(self, observation: TensorDictBase, frames: int) -> dict[str, torch.Tensor]:
        num = observation.batch_size[0]
        with torch.no_grad():
            out = self._forward(observation)
            action, logits = out.get("action"), out.get("logits")
            log_prob = next((out[k] for k in _LOG_PROB_KEYS if out.get(k) is not None), None)
            start = int(self.action_space.start) if self._discrete else 0
            unclipped = None
            if action is None and out.get("loc") is not None:
                action, log_prob = self._squashed_gaussian(out, num)
            elif action is None and out.get("mean") is not None:
                action, unclipped, log_prob = self._gaussian(out, num)
            if action is None:
                if logits is None:
                    raise InvalidDataError(
                        "the policy returned neither 'action' nor 'logits' (keys: "
                        f"{sorted(map(str, out.keys()))})"
                    )
                if not self._discrete:
                    raise InvalidDataError(
                        f"the policy returned logits, but the action space is {self.action_space}"
                        " (logits need a Discrete action space)"
                    )
                if self.deterministic:
                    index = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits.float(), -1).reshape(-1, logits.shape[-1])
                    index = torch.multinomial(probs, 1, generator=self._generator)
                    index = index.reshape(logits.shape[:-1])
                action = index + start
                log_prob = None
            if self.epsilon is not None:
                eps = self.epsilon.epsilon(frames)
                n = int(self.action_space.n)
                explore = torch.rand(num, generator=self._generator) < eps
                random = torch.randint(n, (num,), generator=self._generator) + start
                action = torch.where(explore, random.to(action.dtype), action.reshape(num))
                log_prob = None
                if logits is not None:
                    pi = torch.softmax(logits.float(), -1).reshape(num, n)
                    if self.deterministic:  # the greedy action, with probability 1
                        pi = nn.functional.one_hot(pi.argmax(-1), n).float()
                    taken = pi.gather(-1, (action - start).long().unsqueeze(-1)).squeeze(-1)
                    log_prob = torch.log((1 - eps) * taken + eps / n)
            elif self._noise is not None:
                action, log_prob, unclipped = self._noise(action, num), None, None
            elif log_prob is None and logits is not None:
                lp = torch.log_softmax(logits.float(), -1).reshape(num, -1)
                log_prob = lp.gather(-1, (action.reshape(num) - start).long().unsqueeze(-1))
                log_prob = log_prob.squeeze(-1)
            result = {"action": self._cast_action(action, num)}
            if unclipped is not None:
                result["unclipped_action"] = unclipped
            if log_prob is not None:
                result["sample_log_prob"] = log_prob.detach().reshape(num).to(torch.float32)
            value = out.get("state_value")
            if value is not None:
                result["state_value"] = value.detach()
        return result

    def _squashed_gaussian(
        self, out: TensorDictBase | Mapping[str, Any], num: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(action in the env's units, log-probability)`` of a tanh-squashed Gaussian."""
        if self._box is None:
            try:
                self._box = BoxScale(self.action_space)
            except InvalidConfigError as e:
                raise InvalidDataError(f"the policy returned 'loc' and 'scale', but {e}") from None
        box = self._box
        if out.get("scale") is None:
            raise InvalidDataError("the policy returned 'loc' without 'scale'")
        loc = out["loc"].float().reshape(num, box.dim)
        scale = out["scale"].float().reshape(num, box.dim)
        noise = None
        if not self.deterministic:
            noise = torch.randn(loc.shape, generator=self._generator)
        unit, log_prob = squashed_gaussian(loc, scale, noise)
        return box.to_env(unit), log_prob

    def _gaussian(
        self, out: TensorDictBase | Mapping[str, Any], num: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(action clipped to the bounds, the draw, its log-probability)`` of an unsquashed
        Gaussian (PPO's policy on ``Box`` actions)."""
        if self._discrete or not isinstance(self.action_space, gym.spaces.Box):
            raise InvalidDataError(
                f"the policy returned 'mean' and 'std', but the action space is {self.action_space}"
            )
        if out.get("std") is None:
            raise InvalidDataError("the policy returned 'mean' without 'std'")
        shape = (num, *self.action_space.shape)
        mean = out["mean"].float().reshape(num, -1)
        std = out["std"].float().reshape(num, -1)
        draw = mean
        if not self.deterministic:
            draw = mean + std * torch.randn(mean.shape, generator=self._generator)
        log_prob = gaussian_log_prob(mean, std, draw)
        if self._bounds is None:
            self._bounds = tuple(  # type: ignore[assignment]
                torch.as_tensor(np.asarray(b, np.float32).reshape(-1))
                for b in (self.action_space.low, self.action_space.high)
            )
        low, high = self._bounds  # type: ignore[misc]
        return torch.clamp(draw, low, high), draw.reshape(shape), log_prob

    def action_values(self, observation: TensorDictBase) -> torch.Tensor:
        """The module's value of each action for a TensorDict ``[N]`` of observations,
        ``[N, n]``: ``Q(s, .)`` for a Q-network (its ``"action_value"``, else its logits, the
        tensor a plain module returns). For Ape-X priorities (:mod:`millpond.actors.apex`)."""
        with torch.no_grad():
            out = self._forward(observation)
        values = out.get("action_value")
        if values is None:
            values = out.get("logits")
        if values is None or not self._discrete:
            raise InvalidDataError(
                "action values need a Discrete action space and a module that returns them "
                f"('action_value' or logits); the action space is {self.action_space}"
            )
        return values.detach().reshape(observation.batch_size[0], -1)

    def _forward(self, observation: TensorDictBase) -> TensorDictBase | Mapping[str, Any]:
        if isinstance(self.module, TensorDictModuleBase):
            mode = InteractionType.DETERMINISTIC if self.deterministic else InteractionType.RANDOM
            with set_interaction_type(mode):
                return self.module(observation.clone(False))
        x = observation if self._dict_obs else observation["observation"]
        out = self.module(x)
        if isinstance(out, torch.Tensor):
            return {"logits": out} if self._discrete else {"action": out}
        if isinstance(out, Mapping | TensorDictBase):
            return out
        raise InvalidDataError(
            f"the policy module returned {type(out).__name__}; expected a tensor (logits or "
            "action), a mapping or a TensorDict with 'action' or 'logits'"
        )

    def _cast_action(self, action: torch.Tensor, num: int) -> torch.Tensor:
        """The action as the env receives it: the action space's dtype and shape."""
        shape = (num, *self.action_space.shape)
        if action.shape != shape:
            try:
                action = action.reshape(shape)
            except RuntimeError:
                raise InvalidDataError(
                    f"the policy's action has shape {list(action.shape)}, expected {list(shape)}"
                ) from None
        dtype = self.action_space.dtype
        array = action.detach().cpu().numpy()
        if dtype is not None:
            array = array.astype(dtype, copy=False)
        return torch.from_numpy(np.array(array, copy=True))


def load_factory(spec: str, what: str = "policy factory") -> Callable[..., Any]:
    """The callable named by ``"package.module:function"`` (``function`` may be dotted).

    ``what`` names the thing in error messages (e.g. ``"processor"``); every error is an
    :class:`~millpond.errors.InvalidConfigError`.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidConfigError(f"{what} {spec!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidConfigError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidConfigError(f"{what} {spec!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidConfigError(f"{what} {spec!r} is not callable")
    return obj


def make_policy(
    policy: PolicySpec,
    observation_space: gym.Space,
    action_space: gym.Space,
    num_envs: int,
    *,
    policy_kwargs: Mapping[str, Any] | None = None,
    deterministic: bool = False,
    epsilon: EpsilonGreedy | None = None,
    noise: ActionNoise | None = None,
    seed: int | None = None,
) -> ActorPolicy:
    """The :class:`ActorPolicy` for ``policy`` (see the module docstring for the contract)."""
    if policy is None:
        if epsilon is not None or noise is not None:
            raise InvalidConfigError("exploration needs a policy; the random policy has none")
        return RandomPolicy(action_space, num_envs, seed)
    if isinstance(policy, ActorPolicy):
        return policy
    if not isinstance(policy, nn.Module):
        factory = load_factory(policy) if isinstance(policy, str) else policy
        if not callable(factory):
            raise InvalidConfigError(
                f"policy ({policy!r}) must be None, an nn.Module, a factory or 'pkg.mod:function'"
            )
        kwargs = dict(policy_kwargs or {})
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}
        for name, space in (
            ("observation_space", observation_space),
            ("action_space", action_space),
        ):
            if name in params and name not in kwargs:
                kwargs[name] = space
        policy = factory(**kwargs)
    return ModulePolicy(
        policy,  # type: ignore[arg-type]
        observation_space,
        action_space,
        deterministic=deterministic,
        epsilon=epsilon,
        noise=noise,
        seed=seed,
    )
