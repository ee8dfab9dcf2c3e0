"""Networks for the reference learners (MLPs, the Nature-DQN CNN), usable as actor policy
factories.

Each function builds a plain ``nn.Module`` from gymnasium spaces, so the same call gives the
learner its network and the actors theirs: name it as ``"millpond.learner.networks:mlp_policy"``
(or ``mlp_q``) in an actor config, and the loop passes ``observation_space=`` and
``action_space=`` (see :mod:`millpond.actors.policies`). The parameter names of a module
built here depend only on the spaces and ``hidden``, so the state dict a learner publishes
loads into every actor's copy.

- :func:`mlp_policy` returns logits for a ``Discrete`` action space: actors sample from
  them and record ``"sample_log_prob"``, which PPO's ratio needs. For a float ``Box``
  action space it is a :class:`GaussianPolicy` (CleanRL's continuous PPO policy).
- :func:`mlp_critic` returns ``V(s)``, ``[..., 1]`` (learner side only).
- :func:`mlp_q` returns ``Q(s, ·)``, ``[..., n]``. Actors treat the output as logits, so
  run them with ``deterministic=True`` (``argmax Q``) and an
  :class:`~millpond.actors.EpsilonGreedy` schedule for exploration. With ``dueling=True``
  it is a :class:`DuelingQ` (Wang et al. 2016), as Rainbow uses.

Observations may be ``Box`` (flattened, cast to float32) or ``Discrete`` (one-hot).

For pixels, :class:`NatureCNN` is the convolutional torso of the Nature DQN (Mnih et al.
2015): three conv layers (32 8x8 filters stride 4, 64 4x4 stride 2, 64 3x3 stride 1), ReLU,
then a 512-unit fully connected layer, on ``[C, H, W]`` observations (``uint8`` scaled by
1/255, as Atari frames stacked by ``FrameStackObservation`` come: ``uint8[4, 84, 84]``).
:func:`nature_cnn_policy`, :func:`nature_cnn_q` and :func:`nature_cnn_critic` put one
linear head on it; :func:`nature_cnn_actor_critic` gives PPO a policy and a critic sharing
one torso (as CleanRL's Atari PPO does), the policy's parameter names the same as
:func:`nature_cnn_policy`'s, so its state dict loads into the actors' copies.
:func:`network_for` chooses between the two families for ``millpond launch``
(``learner.network``): ``auto`` takes the CNN for 3-D ``uint8`` ``Box`` observations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from millpond.errors import InvalidConfigError
from millpond.learner.obs_norm import ObservationNormalized, RunningMeanStd

__all__ = [
    "MLP",
    "NETWORKS",
    "CNNHead",
    "DuelingQ",
    "GaussianPolicy",
    "NatureCNN",
    "mlp_critic",
    "mlp_policy",
    "mlp_q",
    "nature_cnn_actor_critic",
    "nature_cnn_critic",
    "nature_cnn_policy",
    "nature_cnn_q",
    "network_for",
]

#: What ``learner.network`` takes.
NETWORKS = ("auto", "mlp", "nature_cnn")

_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}

#: What an :class:`MLP`'s ``init`` takes (``learner.init``).
INITS = ("orthogonal", "torch")


class MLP(nn.Module):
    """``observation -> features -> Linear/Tanh stack -> out_features``.

    Args:
        observation_space: a ``Box`` (flattened to ``prod(shape)`` floats) or a
            ``Discrete(n)`` space (one-hot over ``n``).
        out_features: width of the output layer.
        hidden: widths of the hidden layers.
        out_std: orthogonal-init gain of the output layer (CleanRL: 0.01 for policy logits,
            1.0 for values).
        activation: ``"tanh"`` (CleanRL's PPO) or ``"relu"`` (CleanRL's DQN, the SAC
            paper's and Stable-Baselines3's SAC networks) between the layers.
        init: ``"orthogonal"`` (CleanRL's PPO: orthogonal weights, gain ``sqrt(2)`` in
            the hidden layers and ``out_std`` in the output one, zero biases) or
            ``"torch"`` (``nn.Linear``'s own: weights and biases uniform in
            ``±1/sqrt(fan_in)``, as CleanRL's DQN leaves them; ``out_std`` is unused).

    ``forward`` accepts a batch of observations ``[*B, *obs_shape]`` in the env's dtype and
    returns ``[*B, out_features]``.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        out_features: int,
        hidden: Sequence[int] = (64, 64),
        out_std: float = 1.0,
        activation: str = "tanh",
        init: str = "orthogonal",
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise InvalidConfigError(
                f"activation ({activation!r}) must be one of {', '.join(_ACTIVATIONS)}"
            )
        if init not in INITS:
            raise InvalidConfigError(f"init ({init!r}) must be one of {', '.join(INITS)}")
        orthogonal = init == "orthogonal"
        if isinstance(observation_space, gym.spaces.Box):
            self.obs_shape: tuple[int, ...] = tuple(observation_space.shape)
            self.num_categories: int | None = None
            in_features = math.prod(self.obs_shape)
        elif isinstance(observation_space, gym.spaces.Discrete):
            self.obs_shape = ()
            self.num_categories = int(observation_space.n)
            self.category_start = int(observation_space.start)
            in_features = self.num_categories
        else:
            raise InvalidConfigError(
                f"MLP networks take Box or Discrete observations, not {observation_space}"
            )
        widths = [int(h) for h in hidden]
        if any(h < 1 for h in widths):
            raise InvalidConfigError(f"hidden ({tuple(hidden)!r}) must be positive widths")
        layers: list[nn.Module] = []
        width = in_features
        for h in widths:
            layers += [_layer(width, h, math.sqrt(2), orthogonal), _ACTIVATIONS[activation]()]
            width = h
        layers.append(_layer(width, out_features, out_std, orthogonal))
        self.net = nn.Sequential(*layers)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        if self.num_categories is not None:
            index = observation.long() - self.category_start
            x = nn.functional.one_hot(index, self.num_categories).float()
        else:
            batch = observation.shape[: observation.ndim - len(self.obs_shape)]
            x = observation.reshape(*batch, -1).float()
        return self.net(x)


class GaussianPolicy(nn.Module):
    """``observation -> {"mean", "std"}``, each ``[*B, *action_shape]``: a diagonal Gaussian
    over a float ``Box`` action, not squashed (CleanRL's ``ppo_continuous_action.py``).

    The mean is an :class:`MLP` (Tanh, output gain 0.01); ``log(std)`` is one learned
    parameter per action element, independent of the state, starting at 0. The actors
    sample it, clip the draw to the bounds for the env, and record the draw itself as
    ``"unclipped_action"`` beside the log-probability (:mod:`millpond.actors.policies`).
    """

    def __init__(
        self, observation_space: gym.Space, action_space: gym.Space, hidden: Sequence[int]
    ) -> None:
        super().__init__()
        if not (
            isinstance(action_space, gym.spaces.Box)
            and np.issubdtype(action_space.dtype, np.floating)
        ):
            raise InvalidConfigError(
                f"a Gaussian policy needs a float Box action space, not {action_space}"
            )
        self.action_shape = tuple(action_space.shape)
        dim = math.prod(self.action_shape)
        self.mean = MLP(observation_space, dim, hidden, out_std=0.01)
        self.log_std = nn.Parameter(torch.zeros(dim))

    def forward(self, observation: torch.Tensor) -> dict[str, torch.Tensor]:
        mean = self.mean(observation)
        std = self.log_std.exp().expand_as(mean)
        shape = (*mean.shape[:-1], *self.action_shape)
        return {"mean": mean.reshape(shape), "std": std.reshape(shape)}


def mlp_policy(
    observation_space: gym.Space,
    action_space: gym.Space,
    hidden: Sequence[int] = (64, 64),
    normalize_observations: bool = False,
) -> nn.Module:
    """Policy logits ``[..., n]`` for a ``Discrete(n)`` action space, a
    :class:`GaussianPolicy` for a float ``Box`` one (an actor factory). With
    ``normalize_observations`` it reads them through running statistics it carries
    (:class:`~millpond.learner.obs_norm.ObservationNormalized`, its ``normalizer``)."""
    if isinstance(action_space, gym.spaces.Box):
        policy: nn.Module = GaussianPolicy(observation_space, action_space, hidden)
    else:
        policy = MLP(observation_space, _num_actions(action_space), hidden, out_std=0.01)
    if normalize_observations:
        return ObservationNormalized(policy, RunningMeanStd(observation_space))
    return policy


def mlp_critic(observation_space: gym.Space, hidden: Sequence[int] = (64, 64)) -> MLP:
    """State values ``V(s)``, ``[..., 1]``."""
    return MLP(observation_space, 1, hidden, out_std=1.0)


class DuelingQ(nn.Module):
    """A dueling Q-network (Wang et al. 2016): ``Q(s, a) = V(s) + A(s, a) - mean_a A(s, a)``.

    The value and advantage streams share the hidden layers of one :class:`MLP` and have
    their own linear heads: its output layer, ``1 + n`` wide, holds ``V`` then ``A``.
    Subtracting the mean advantage makes ``V`` and ``A`` identifiable (the paper's eq. 9).
    """

    def __init__(
        self,
        observation_space: gym.Space,
        num_actions: int,
        hidden: Sequence[int] = (64, 64),
        activation: str = "tanh",
        init: str = "orthogonal",
    ) -> None:
        super().__init__()
        self.mlp = MLP(observation_space, 1 + num_actions, hidden, 1.0, activation, init)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        out = self.mlp(observation)
        value, advantage = out[..., :1], out[..., 1:]
        return value + advantage - advantage.mean(-1, keepdim=True)


def mlp_q(
    observation_space: gym.Space,
    action_space: gym.Space,
    hidden: Sequence[int] = (64, 64),
    dueling: bool = False,
    activation: str = "tanh",
    init: str = "orthogonal",
) -> MLP | DuelingQ:
    """Action values ``Q(s, ·)``, ``[..., n]`` for a ``Discrete(n)`` action space (an actor
    factory: act with ``deterministic=True`` and epsilon-greedy exploration); a
    :class:`DuelingQ` with ``dueling``; ``activation`` between the layers and ``init`` their
    initial weights (see :class:`MLP`)."""
    if dueling:
        return DuelingQ(observation_space, _num_actions(action_space), hidden, activation, init)
    return MLP(observation_space, _num_actions(action_space), hidden, 1.0, activation, init)


class NatureCNN(nn.Module):
    """The Nature-DQN torso: ``[*B, C, H, W]`` observations -> ``[*B, 512]`` features.

    Args:
        observation_space: a 3-D ``Box`` (channels first, e.g. 4 stacked 84x84 frames).
            ``uint8`` observations are scaled by 1/255, other dtypes only cast to float32.

    Layers get orthogonal weights with gain ``sqrt(2)`` and zero biases (CleanRL's Atari
    networks).
    """

    out_features = 512

    def __init__(self, observation_space: gym.Space) -> None:
        super().__init__()
        _check_cnn_input(observation_space)
        self.obs_shape: tuple[int, ...] = tuple(observation_space.shape)
        self.scale = 1 / 255 if observation_space.dtype == np.uint8 else 1.0
        channels, height, width = self.obs_shape
        gain = math.sqrt(2)
        self.convs = nn.Sequential(
            _conv(channels, 32, 8, 4, gain),
            nn.ReLU(),
            _conv(32, 64, 4, 2, gain),
            nn.ReLU(),
            _conv(64, 64, 3, 1, gain),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, channels, height, width)).shape[-1]
        self.fc = nn.Sequential(_layer(flat, self.out_features, gain), nn.ReLU())

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        batch = observation.shape[:-3]
        x = observation.reshape(-1, *self.obs_shape).float()
        if self.scale != 1.0:
            x = x * self.scale
        return self.fc(self.convs(x)).reshape(*batch, self.out_features)


class CNNHead(nn.Module):
    """A linear head on a :class:`NatureCNN` torso (shared when two heads get one torso).

    Args:
        torso: the feature extractor.
        out_features: width of the output.
        out_std: orthogonal-init gain of the head (0.01 for policy logits, 1.0 for values).
    """

    def __init__(self, torso: NatureCNN, out_features: int, out_std: float = 1.0) -> None:
        super().__init__()
        self.torso = torso
        self.head = _layer(torso.out_features, out_features, out_std)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.head(self.torso(observation))


def nature_cnn_policy(observation_space: gym.Space, action_space: gym.Space) -> CNNHead:
    """Policy logits ``[..., n]`` from pixels, for a ``Discrete(n)`` action space (an actor
    factory)."""
    return CNNHead(NatureCNN(observation_space), _num_actions(action_space), out_std=0.01)


def nature_cnn_critic(observation_space: gym.Space) -> CNNHead:
    """State values ``V(s)``, ``[..., 1]``, from pixels (a torso of its own)."""
    return CNNHead(NatureCNN(observation_space), 1, out_std=1.0)


def nature_cnn_actor_critic(
    observation_space: gym.Space, action_space: gym.Space
) -> tuple[CNNHead, CNNHead]:
    """``(policy, critic)`` sharing one :class:`NatureCNN` torso; the policy has
    :func:`nature_cnn_policy`'s parameter names, so actors built by that factory load it."""
    policy = nature_cnn_policy(observation_space, action_space)
    return policy, CNNHead(policy.torso, 1, out_std=1.0)


def nature_cnn_q(observation_space: gym.Space, action_space: gym.Space) -> CNNHead:
    """Action values ``Q(s, ·)``, ``[..., n]``, from pixels (an actor factory: act with
    ``deterministic=True`` and epsilon-greedy exploration)."""
    return CNNHead(NatureCNN(observation_space), _num_actions(action_space), out_std=1.0)


def network_for(observation_space: gym.Space, network: str = "auto") -> str:
    """``"mlp"`` or ``"nature_cnn"``: ``network`` itself, or for ``"auto"`` the CNN exactly
    when observations are a 3-D ``uint8`` ``Box`` (stacked frames), else the MLP; the CNN
    named for observations it cannot take is refused."""
    if network not in NETWORKS:
        raise InvalidConfigError(f"network ({network!r}) must be one of {', '.join(NETWORKS)}")
    if network == "auto":
        pixels = (
            isinstance(observation_space, gym.spaces.Box)
            and len(observation_space.shape) == 3
            and observation_space.dtype == np.uint8
        )
        return "nature_cnn" if pixels else "mlp"
    if network == "nature_cnn":
        _check_cnn_input(observation_space)
    return network


def _check_cnn_input(observation_space: gym.Space) -> None:
    if not (isinstance(observation_space, gym.spaces.Box) and len(observation_space.shape) == 3):
        raise InvalidConfigError(
            f"the Nature CNN takes 3-D Box observations [C, H, W], not {observation_space}"
        )


def _conv(in_channels: int, out_channels: int, kernel: int, stride: int, std: float) -> nn.Conv2d:
    layer = nn.Conv2d(in_channels, out_channels, kernel, stride)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


def _num_actions(action_space: gym.Space) -> int:
    if not isinstance(action_space, gym.spaces.Discrete):
        raise InvalidConfigError(
            f"these networks need a Discrete action space, not {action_space} (Box actions: "
            "learner.algorithm sac or td3, or ppo with the MLP policy)"
        )
    return int(action_space.n)


def _layer(in_features: int, out_features: int, std: float, orthogonal: bool = True) -> nn.Linear:
    """A linear layer with orthogonal weights (gain ``std``) and zero bias, as in CleanRL's
    PPO, or (``orthogonal=False``) as ``nn.Linear`` makes it."""
    layer = nn.Linear(in_features, out_features)
    if orthogonal:
        nn.init.orthogonal_(layer.weight, std)
        nn.init.zeros_(layer.bias)
    return layer
