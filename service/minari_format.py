"""A table's episodes as a Minari dataset, and a Minari dataset's episodes into a table.

A Minari episode of N steps holds N + 1 observations, N actions, rewards, terminations
and truncations: the segment layout's steps plus the final tail, so one millpond episode
becomes one Minari episode and back, values and dtypes kept (Minari's JPEG encoding of
images is off: it is lossy).

Episode rules (export):

- An episode stored in several segments is joined in step order.
- An episode whose stored steps do not start at step 0 (its beginning was evicted from the
  ring), or that is not one unbroken run of steps (a gap, a step that ends the episode
  before its last one, a next observation that is not the following step's observation),
  is **dropped**: a Minari episode starts at a reset. The summary counts them.
- An episode still open (its last stored step neither terminated nor truncated) is
  exported as **truncated** at its last stored step. The summary counts them.
- Step keys other than ``action`` and ``("next", "reward")`` have no place in a Minari
  episode and are left out (named in the summary); ``infos`` are empty.

Minari is imported only here, and only when called: ``pip install 'millpond[datasets]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.errors import InvalidConfigError, InvalidDataError
from millpond.segments import flatten
from millpond.service.export import EXPORT_CHUNK_ROWS, export_ted, import_ted, pack_export
from millpond.spec import Key, format_key
from millpond.ted import observation_keys, rows_differ

if TYPE_CHECKING:
    from millpond.service.table import Table

__all__ = [
    "MinariExportSummary",
    "export_minari",
    "import_minari",
    "load_minari",
    "minari_root",
    "minari_ted",
]

_ACTION: Key = ("action",)
_REWARD: Key = ("next", "reward")
_FLAGS = ("done", "terminated", "truncated")
#: TED keys that the exporter derives itself, not step data of the table.
_DERIVED = {("episode_id",), ("step",), ("collector", "traj_ids"), *((f,) for f in _FLAGS)}


@dataclasses.dataclass(frozen=True)
class MinariExportSummary:
    """What :func:`export_minari` wrote.

    Attributes:
        path: the dataset's directory (``ROOT/DATASET_ID``).
        episodes: Minari episodes written.
        steps: their steps.
        dropped_partial: episodes left out: their beginning was evicted, or their stored
            steps are not one unbroken run from step 0.
        dropped_steps: the stored steps of those episodes.
        truncated_open: episodes still open, written as truncated at their last stored step.
        left_out_keys: step keys of the table that a Minari episode has no place for.
    """

    path: Path
    episodes: int
    steps: int
    dropped_partial: int
    dropped_steps: int
    truncated_open: int
    left_out_keys: tuple[str, ...]


def minari_root(root: str | os.PathLike | None = None) -> Path:
    """Where Minari datasets live: ``root``, else ``$MINARI_DATASETS_PATH``, else
    ``~/.minari/datasets`` (Minari's own rule)."""
    # absolute: Minari joins a relative data path onto itself when it sizes a dataset
    if root is not None:
        return Path(root).absolute()
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env).absolute() if env else Path.home() / ".minari" / "datasets"


def export_minari(
    table: Table,
    dataset_id: str,
    *,
    root: str | os.PathLike | None = None,
    env: str | None = None,
    description: str | None = None,
) -> MinariExportSummary:
    """Write ``table``'s episodes as the Minari dataset ``dataset_id`` under ``root`` (see
    :func:`minari_root`), following the module's episode rules.

    ``env`` (a gymnasium id) gives the dataset its observation and action spaces and lets
    ``dataset.recover_environment()`` make it; without it the spaces are Boxes (Dict for
    several observation keys) of the stored dtypes and shapes, unbounded. The table is read
    under its lock, a consistent snapshot; nothing is modified. Refused, with nothing
    written, where the dataset exists or no episode is complete enough to export.
    """
    minari = _import_minari()
    _check_dataset_id(dataset_id)
    base = minari_root(root)
    path = base / dataset_id
    if path.exists():
        raise InvalidConfigError(f"Minari dataset {dataset_id!r} exists at {path}")
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".millpond-export-", dir=base) as tmp:
        td = export_ted(table, Path(tmp) / "rows", order="episode")
        n = td.batch_size[0]
        if n == 0:
            raise InvalidDataError(f"table {table.name!r} holds no steps to export")
        obs_keys = observation_keys(td)
        if _ACTION not in flatten(td) or _REWARD not in flatten(td):
            raise InvalidDataError(
                f"table {table.name!r} has no 'action' or ('next', 'reward') key: a Minari "
                "episode needs both"
            )
        kept = {*obs_keys, *(("next", *k) for k in obs_keys), _ACTION, _REWARD, *_DERIVED}
        kept |= {("next", f) for f in _FLAGS}
        left_out = sorted(format_key(k) for k in flatten(td) if k not in kept)
        spans, dropped, dropped_steps, open_ = _episodes(td, obs_keys)
        if not spans:
            raise InvalidDataError(
                f"table {table.name!r} holds no complete episode (from step 0) to export: "
                f"{dropped} episode(s) had lost their beginning"
            )
        obs_space, act_space = _spaces(td, obs_keys)
        if env is not None:
            _check_env(env, obs_space, act_space)
        _np(td[_REWARD][:1])  # refused before anything is written, as the spaces' dtypes
        buffers = _episode_buffers(minari, td, obs_keys, spans)
        with _datasets_path(base), warnings.catch_warnings(), _removed_on_error(path):
            warnings.simplefilter("ignore", UserWarning)  # unset author, code link, ...
            minari.create_dataset_from_buffers(
                dataset_id,
                buffers,
                env=env,
                observation_space=obs_space if env is None else None,
                action_space=act_space if env is None else None,
                algorithm_name="millpond export",
                description=description or f"millpond table {table.name!r}",
                data_format="hdf5",
                jpeg_encoding=False,
            )
    return MinariExportSummary(
        path=path,
        episodes=len(spans),
        steps=sum(b - a for a, b, _ in spans),
        dropped_partial=dropped,
        dropped_steps=dropped_steps,
        truncated_open=open_,
        left_out_keys=tuple(left_out),
    )


def load_minari(dataset_id: str, *, root: str | os.PathLike | None = None) -> Any:
    """Open the Minari dataset ``dataset_id`` under ``root`` (see :func:`minari_root`)."""
    minari = _import_minari()
    path = minari_root(root) / dataset_id / "data"
    if not path.is_dir():
        raise InvalidConfigError(f"no Minari dataset {dataset_id!r} in {minari_root(root)}")
    try:
        return minari.MinariDataset(path)
    except Exception as e:  # Minari raises whatever its storage meets
        raise InvalidDataError(f"cannot open Minari dataset {dataset_id!r}: {e}") from None


def minari_ted(dataset: Any) -> TensorDict:
    """Every episode of the Minari ``dataset`` as TED rows, with ``episode_id`` (the
    episode's rank) and ``step``, what :func:`~millpond.service.export.pack_export` stores."""
    parts = []
    for rank, episode in enumerate(dataset.iterate_episodes()):
        parts.append(_episode_ted(episode, rank))
    if not parts:
        raise InvalidDataError("the Minari dataset holds no episodes")
    return torch.cat(parts)


def import_minari(
    table: Table,
    dataset: Any,
    *,
    source: str,
    timeout: float | None = None,
) -> tuple[int, int, int]:
    """Store every episode of the Minari ``dataset`` into ``table``, its terminations and
    truncations as the steps' flags, episodes numbered in the extend source ``source``'s
    id range; returns ``(episodes, steps, segments)``.

    Refused whole where the steps would not fit the table at once (see
    :func:`~millpond.service.export.import_ted`).
    """
    packed = pack_export(minari_ted(dataset), source=source)
    steps = import_ted(table, packed, timeout=timeout)
    return len(np.unique(packed.episode_ids)), steps, len(packed)


# -- export internals -----------------------------------------------------------------------
def _episodes(
    td: TensorDictBase, obs_keys: list[Key]
) -> tuple[list[tuple[int, int, bool]], int, int, int]:
    """The row spans ``(start, stop, open)`` of the complete episodes of ``td`` (rows in
    episode order), and the episodes and steps dropped, and the open episodes kept."""
    n = td.batch_size[0]
    ids = td["episode_id"].reshape(n).numpy()
    steps = td["step"].reshape(n).numpy()
    done = td["next", "done"].reshape(n).numpy()
    ended = td["next", "terminated"].reshape(n).numpy() | td["next", "truncated"].reshape(n).numpy()
    chained = np.ones(n, dtype=bool)  # row r: its next observation is row r + 1's observation
    chained[-1] = False
    for i in range(0, n - 1, EXPORT_CHUNK_ROWS):  # a chunk at a time: tables of images
        j = min(i + EXPORT_CHUNK_ROWS, n - 1)
        for k in obs_keys:
            chained[i:j] &= ~rows_differ(td[("next", *k)][i:j], td[k][i + 1 : j + 1]).numpy()
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    stops = np.r_[starts[1:], n]
    spans, dropped, dropped_steps, open_ = [], 0, 0, 0
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        whole = (
            steps[a] == 0
            and bool((np.diff(steps[a:b]) == 1).all())
            and bool(chained[a : b - 1].all())
            and not bool(done[a : b - 1].any())
        )
        if not whole:
            dropped, dropped_steps = dropped + 1, dropped_steps + (b - a)
            continue
        is_open = not bool(ended[b - 1])
        open_ += is_open
        spans.append((a, b, is_open))
    return spans, dropped, dropped_steps, open_


def _episode_buffers(
    minari: Any, td: TensorDictBase, obs_keys: list[Key], spans: list[tuple[int, int, bool]]
) -> Iterator[Any]:
    for i, (a, b, is_open) in enumerate(spans):
        rows = td[a:b]
        obs = {k: np.concatenate([_np(rows[k]), _np(rows[("next", *k)][-1:])]) for k in obs_keys}
        truncations = _np(rows["next", "truncated"]).reshape(-1).copy()
        if is_open:
            truncations[-1] = True
        yield minari.data_collector.EpisodeBuffer(
            id=i,
            observations=_nest(obs, obs_keys),
            actions=_np(rows[_ACTION]),
            rewards=_np(rows[_REWARD]).reshape(b - a, *_reward_shape(rows[_REWARD])),
            terminations=_np(rows["next", "terminated"]).reshape(-1).copy(),
            truncations=truncations,
            infos={},
        )


def _reward_shape(reward: torch.Tensor) -> tuple[int, ...]:
    """A reward's shape per step in Minari: ``[]`` for millpond's ``[1]``."""
    shape = tuple(reward.shape[1:])
    return () if shape == (1,) else shape


def _nest(obs: dict[Key, np.ndarray], obs_keys: list[Key]) -> Any:
    """One array for a lone ``observation`` key, else a dict (nested as the keys are) with
    the common ``observation`` prefix dropped."""
    if obs_keys == [("observation",)]:
        return obs[("observation",)]
    strip = all(k[0] == "observation" and len(k) > 1 for k in obs_keys)
    out: dict[str, Any] = {}
    for k, v in obs.items():
        parts = k[1:] if strip else k
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


def _spaces(td: TensorDictBase, obs_keys: list[Key]) -> tuple[Any, Any]:
    import gymnasium as gym

    def box(t: torch.Tensor) -> gym.spaces.Box:
        dtype = _np(t[:1]).dtype
        if dtype == np.bool_:
            return gym.spaces.Box(False, True, tuple(t.shape[1:]), dtype)
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            return gym.spaces.Box(info.min, info.max, tuple(t.shape[1:]), dtype)
        return gym.spaces.Box(-np.inf, np.inf, tuple(t.shape[1:]), dtype)

    def as_space(tree: Any) -> Any:
        if isinstance(tree, dict):
            return gym.spaces.Dict({k: as_space(v) for k, v in tree.items()})
        return tree

    boxes = _nest({k: box(td[k]) for k in obs_keys}, obs_keys)
    return as_space(boxes), box(td[_ACTION])


def _check_env(env: str, obs_space: Any, act_space: Any) -> None:
    """Refuse an env whose spaces do not describe the table's data (shapes, Dict keys)."""
    import gymnasium as gym

    try:
        made = gym.make(env)
    except Exception as e:  # gymnasium raises its own errors for unknown or broken ids
        raise InvalidConfigError(f"cannot make gymnasium env {env!r}: {e}") from None
    try:
        spaces = made.observation_space, made.action_space
    finally:
        made.close()

    def fits(space: Any, stored: Any) -> bool:
        if isinstance(stored, gym.spaces.Dict):
            return (
                isinstance(space, gym.spaces.Dict)
                and set(space.spaces) == set(stored.spaces)
                and all(fits(space[k], stored[k]) for k in stored.spaces)
            )
        return space.shape == stored.shape

    for what, space, stored in zip(
        ("observation", "action"), spaces, (obs_space, act_space), strict=True
    ):
        if not fits(space, stored):
            raise InvalidConfigError(
                f"--env {env}: its {what} space {space} does not fit the table's {what}s ({stored})"
            )


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise InvalidDataError("Minari (numpy) has no bfloat16: export the table as TED instead")
    return t.contiguous().numpy()


@contextlib.contextmanager
def _removed_on_error(path: Path) -> Iterator[None]:
    """A dataset that failed half way is removed: Minari would refuse its id from then on."""
    try:
        yield
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


@contextlib.contextmanager
def _datasets_path(root: Path) -> Iterator[None]:
    """Minari places a new dataset under ``$MINARI_DATASETS_PATH`` and takes no directory
    argument: set it for the call, as the caller asked, and restore it."""
    before = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    try:
        yield
    finally:
        if before is None:
            del os.environ["MINARI_DATASETS_PATH"]
        else:
            os.environ["MINARI_DATASETS_PATH"] = before


def _check_dataset_id(dataset_id: str) -> None:
    from minari.dataset.minari_dataset import parse_dataset_id

    try:
        parse_dataset_id(dataset_id)
    except ValueError:
        raise InvalidConfigError(
            f"bad Minari dataset id {dataset_id!r}: expected [NAMESPACE/]NAME-vVERSION, "
            "e.g. millpond/cartpole-v0"
        ) from None


# -- import internals -----------------------------------------------------------------------
def _episode_ted(episode: Any, rank: int) -> TensorDict:
    """One Minari episode as TED rows ``[N]``."""
    n = len(episode.rewards)
    if n == 0:
        raise InvalidDataError(f"Minari episode {episode.id} has no steps")
    obs = _obs_tree(episode.observations, n + 1, episode.id)
    if not isinstance(episode.actions, np.ndarray):
        raise InvalidDataError(
            f"Minari episode {episode.id}: actions of a Dict or Tuple space are not supported"
        )
    terminated = torch.from_numpy(np.asarray(episode.terminations, dtype=bool).reshape(n, 1))
    truncated = torch.from_numpy(np.asarray(episode.truncations, dtype=bool).reshape(n, 1))
    reward = torch.from_numpy(np.ascontiguousarray(episode.rewards))
    if reward.dim() == 1:
        reward = reward.reshape(n, 1)
    td = TensorDict(
        {
            "observation": obs[:-1],
            "action": torch.from_numpy(np.ascontiguousarray(episode.actions)),
            "next": {
                "observation": obs[1:],
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
                "done": terminated | truncated,
            },
            "episode_id": torch.full((n,), rank, dtype=torch.int64),
            "step": torch.arange(n, dtype=torch.int64),
        },
        batch_size=[n],
    )
    return td


def _obs_tree(observations: Any, rows: int, episode: int) -> torch.Tensor | TensorDict:
    def tensor(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: tensor(x) for k, x in v.items()}
        if not isinstance(v, np.ndarray):
            raise InvalidDataError(
                f"Minari episode {episode}: observations of a Tuple or Text space are not supported"
            )
        return torch.from_numpy(np.ascontiguousarray(v))

    tree = tensor(observations)
    out = TensorDict(tree, batch_size=[rows]) if isinstance(tree, dict) else tree
    if out.shape[0] != rows:
        raise InvalidDataError(
            f"Minari episode {episode}: {out.shape[0]} observations for {rows - 1} steps"
        )
    return out


def _import_minari() -> Any:
    try:
        import minari
        import minari.data_collector
    except ImportError as e:
        raise ImportError(
            "Minari datasets need minari (with h5py): pip install 'millpond[datasets]'"
        ) from e
    return minari
