"""Playing a trained policy: whole episodes of the run's env, their returns, optionally
their videos (``millpond eval``, ``run.eval_episodes``).

Episode ``i`` starts from ``env.reset(seed=seed + i)``, so two evaluations of the same
weights with the same seed play the same episodes (a policy that samples: also the same
``seed=`` of :func:`~millpond.deploy.trained_policy.load_policy`).
"""

from __future__ import annotations

import importlib.util
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym

from millpond.errors import InvalidConfigError

__all__ = ["Evaluation", "Player", "evaluate"]


class Player(Protocol):
    """What plays: a :class:`~millpond.deploy.trained_policy.TrainedPolicy`."""

    version: int
    config: Any  # the run's LaunchConfig

    def act(self, observation: Any) -> Any: ...

    def make_env(self, env_id: str | None = None, render_mode: str | None = None) -> gym.Env: ...


@dataclass(frozen=True)
class Evaluation:
    """The episodes of one evaluation.

    Attributes:
        returns: each episode's undiscounted return, in order.
        lengths: each episode's steps.
        version: the weight version that played.
        frames: the run's frames when the weights were taken (``None``: outside a run).
    """

    returns: tuple[float, ...]
    lengths: tuple[int, ...]
    version: int = -1
    frames: int | None = None

    @property
    def mean_return(self) -> float:
        return sum(self.returns) / len(self.returns)

    @property
    def std_return(self) -> float:
        """The population standard deviation of the returns."""
        mean = self.mean_return
        return math.sqrt(sum((r - mean) ** 2 for r in self.returns) / len(self.returns))

    def line(self) -> str:
        """``return M ± S over N episodes``."""
        n = len(self.returns)
        return (
            f"return {self.mean_return:.1f} ± {self.std_return:.1f} over {n} "
            f"episode{'s' if n != 1 else ''}"
        )

    def as_dict(self) -> dict[str, Any]:
        """Its fields, mean and std, as ``summary.json`` records it."""
        return {
            **asdict(self),
            "returns": list(self.returns),
            "lengths": list(self.lengths),
            "mean_return": self.mean_return,
            "std_return": self.std_return,
        }


def evaluate(
    policy: Player,
    episodes: int,
    *,
    seed: int = 0,
    env_id: str | None = None,
    video_dir: str | Path | None = None,
    frames: int | None = None,
    cancel: threading.Event | None = None,
) -> Evaluation | None:
    """Play ``episodes`` whole episodes with ``policy`` in the run's env (or ``env_id``,
    with the run's kwargs and wrappers); their returns.

    ``video_dir``: record every episode there with gymnasium's ``RecordVideo`` (needs the
    ``moviepy`` package). ``frames``: recorded with the result. ``cancel``: set, the
    evaluation stops between steps and returns ``None``.
    """
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise InvalidConfigError(f"episodes: {episodes!r} must be an integer >= 1")
    if video_dir is not None and importlib.util.find_spec("moviepy") is None:
        raise InvalidConfigError(
            "video: recording episodes needs the moviepy package: pip install 'millpond[video]'"
        )
    env = policy.make_env(env_id, render_mode="rgb_array" if video_dir is not None else None)
    if video_dir is not None:
        from gymnasium.wrappers import RecordVideo

        env = RecordVideo(env, str(video_dir), episode_trigger=lambda _: True, name_prefix="eval")
    try:
        return _play(policy, env, episodes, seed, frames, cancel)
    except gym.error.DependencyNotInstalled as e:  # rendering, for the video
        name = env_id or policy.config.env.id
        raise InvalidConfigError(f"video: {name} cannot render: {e}") from None
    finally:
        env.close()  # RecordVideo writes its last video here


def _play(
    policy: Player,
    env: gym.Env,
    episodes: int,
    seed: int,
    frames: int | None,
    cancel: threading.Event | None,
) -> Evaluation | None:
    returns: list[float] = []
    lengths: list[int] = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, steps, done = 0.0, 0, False
        while not done:
            if cancel is not None and cancel.is_set():
                return None
            obs, reward, terminated, truncated, _ = env.step(policy.act(obs))
            total += float(reward)
            steps += 1
            done = bool(terminated or truncated)
        returns.append(total)
        lengths.append(steps)
    return Evaluation(tuple(returns), tuple(lengths), policy.version, frames)
