"""Helpers for millpond's tests: a checkable dict-observation env, rollouts and segmenting.

Everything here builds *independent* references: a rollout records every step's observation
and its true next observation (the real final observation at terminations and truncations,
never the reset observation) in plain TED form, so tests can compare what a table returns
with what the environment really produced, bit for bit.

Observations of :class:`CountingDictEnv` (and the :func:`pattern` rows the other tests use)
are pure functions of ``(episode, step)``, so a row read back anywhere can be checked on
its own: a torn row, a row of another episode, or a stale next observation shows at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from millpond.segments import Segment
from millpond.storage_format import SLOT_STEP, SLOT_TAIL, SlotColumn
from millpond.ted import observation_keys

__all__ = [
    "FLAG_KEYS",
    "TED_ROW_KEYS",
    "CountingDictEnv",
    "SegmentRecord",
    "chunk_segments",
    "constant_segment",
    "lane_positions",
    "make_counting_vector_env",
    "observation_keys",
    "pattern",
    "pattern_segment",
    "pixels_of",
    "reference_index",
    "replay_lanes",
    "rollout",
    "state_of",
    "stored_segments",
    "stored_steps",
]

#: The keys that make a CartPole-like TED row what it is, for bitwise row comparisons.
TED_ROW_KEYS: list[tuple[str, ...]] = [
    ("observation",),
    ("action",),
    ("next", "observation"),
    ("next", "reward"),
    ("next", "terminated"),
    ("next", "truncated"),
]

#: The per-step keys under ``"next"`` that are not observations.
FLAG_KEYS = ("reward", "done", "terminated", "truncated")


def pattern(
    episodes: torch.Tensor | np.ndarray | int,
    steps: torch.Tensor | np.ndarray | int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.uint8,
) -> torch.Tensor:
    """Rows that encode ``(episode, step)`` in every element: ``[N, *shape]`` (or ``shape``).

    Each element is ``(episode * 131 + step * 17 + position * 7) % 251``; for integer dtypes
    and rows of at least 16 bytes, the first 16 bytes then hold the episode and step as
    little-endian int64 values, so two different ``(episode, step)`` pairs never share a
    row. Vectorised over ``episodes``/``steps`` (broadcast together).
    """
    scalar = not isinstance(episodes, torch.Tensor | np.ndarray) and not isinstance(
        steps, torch.Tensor | np.ndarray
    )
    ep = torch.as_tensor(episodes, dtype=torch.int64).reshape(-1)
    st = torch.as_tensor(steps, dtype=torch.int64).reshape(-1)
    ep, st = torch.broadcast_tensors(ep, st)
    numel = int(np.prod(shape)) if len(shape) else 1
    base = ((ep * 131 + st * 17) % 251).numpy()
    vals = torch.from_numpy(_pattern_rows(numel)[base])  # numpy gathers rows ~8x faster
    out = vals.to(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not dtype.is_floating_point and dtype != torch.bool and numel * itemsize >= 16:
        # The exact (episode, step) in the first 16 bytes.
        raw = out.view(torch.uint8).reshape(len(ep), numel * itemsize)
        header = torch.stack([ep, st], dim=1).contiguous().view(torch.uint8)
        raw[:, :16] = header
        out = raw.view(dtype).reshape(len(ep), numel)
    out = out.reshape(len(ep), *shape)
    return out[0] if scalar else out


@functools.lru_cache(maxsize=8)
def _pattern_rows(numel: int) -> np.ndarray:
    """``rows[b, j] = (b + 7 j) % 251`` for every base ``b``: pattern rows, gathered not computed."""
    b = np.arange(251, dtype=np.int64)[:, None]
    j = np.arange(numel, dtype=np.int64)[None, :]
    return ((b + 7 * j) % 251).astype(np.uint8)


def pixels_of(episode: int, step: int, shape: Sequence[int]) -> np.ndarray:
    """The ``pixels`` observation of :class:`CountingDictEnv` at ``(episode, step)``."""
    return pattern(episode, step, shape, torch.uint8).numpy()


def state_of(episode: int, step: int, dim: int = 8) -> np.ndarray:
    """The ``state`` observation of :class:`CountingDictEnv`: ``[episode, step, ...]``, float32."""
    i = np.arange(dim - 2, dtype=np.float64)
    rest = np.sin(episode * 0.37 + step * 1.3 + i) * (1 + i)
    return np.concatenate([[episode, step], rest]).astype(np.float32)


class CountingDictEnv(gym.Env):
    """A gymnasium env with dict observations that encode ``(episode, step)``.

    Observations: ``{"pixels": uint8[pixel_shape], "state": float32[state_dim]}``, given by
    :func:`pixels_of` and :func:`state_of` (``episode`` counts resets since construction,
    starting at ``episode_offset``). Actions: ``float32[2]`` in ``[-1, 1]``. Reward:
    ``episode + step / 1000``. Episodes end at random: each step terminates with
    probability ``terminate_prob``, and an episode is truncated when it reaches its length
    limit, drawn at reset uniformly from ``[min_len, max_len]``.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        pixel_shape: Sequence[int] = (3, 16, 16),
        state_dim: int = 8,
        terminate_prob: float = 0.05,
        min_len: int = 3,
        max_len: int = 40,
        episode_offset: int = 0,
    ) -> None:
        super().__init__()
        self.pixel_shape = tuple(pixel_shape)
        self.state_dim = state_dim
        self.terminate_prob = terminate_prob
        self.min_len = min_len
        self.max_len = max_len
        self.observation_space = gym.spaces.Dict(
            {
                "pixels": gym.spaces.Box(0, 255, self.pixel_shape, dtype=np.uint8),
                "state": gym.spaces.Box(-np.inf, np.inf, (state_dim,), dtype=np.float32),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
        self._episode = episode_offset - 1
        self._step = 0
        self._limit = max_len

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "pixels": pixels_of(self._episode, self._step, self.pixel_shape),
            "state": state_of(self._episode, self._step, self.state_dim),
        }

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._episode += 1
        self._step = 0
        self._limit = int(self.np_random.integers(self.min_len, self.max_len + 1))
        return self._obs(), {"episode": self._episode}

    def step(self, action):
        reward = float(self._episode + self._step / 1000.0)
        self._step += 1
        terminated = bool(self.np_random.random() < self.terminate_prob)
        truncated = not terminated and self._step >= self._limit
        return self._obs(), reward, terminated, truncated, {"episode": self._episode}


def make_counting_vector_env(
    num_envs: int, *, lane_stride: int = 1_000_000, **kwargs
) -> gym.vector.SyncVectorEnv:
    """A ``SyncVectorEnv`` of :class:`CountingDictEnv` lanes whose episode numbers never meet.

    Lane ``i`` numbers its episodes from ``i * lane_stride``, so an observation identifies
    its lane, episode and step (the float32 ``state`` holds episode numbers exactly below
    2**24; the ``pixels`` header always does). ``kwargs`` go to every :class:`CountingDictEnv`.
    """
    kwargs.pop("episode_offset", None)
    return gym.vector.SyncVectorEnv(
        [
            functools.partial(CountingDictEnv, episode_offset=i * lane_stride, **kwargs)
            for i in range(num_envs)
        ]
    )


def _obs_td(obs: object) -> dict:
    if isinstance(obs, dict):
        return {k: _obs_td(v) for k, v in obs.items()}
    return torch.as_tensor(np.array(obs, copy=True))


def rollout(
    env: gym.Env,
    num_steps: int,
    *,
    seed: int,
    episode_offset: int = 0,
    policy: Callable[[object], object] | None = None,
) -> TensorDict:
    """Step ``env`` for ``num_steps`` steps and record them as a TED TensorDict ``[num_steps]``.

    Keys: ``"observation"`` (a tensor, or nested keys for dict observations), ``"action"``,
    ``("next", "observation")`` (the TRUE next observation: the real final one at
    terminations and truncations, not the one the following reset returns),
    ``("next", "reward")`` float32 ``[N, 1]``, ``("next", "done"/"terminated"/"truncated")``
    bool ``[N, 1]``, ``("collector", "traj_ids")`` (``episode_offset`` + the episode's
    index in this rollout) and ``"step_count"`` (the step within its episode), int64 ``[N]``.

    The env is reset at the start (with ``seed``) and after every episode end. Actions come
    from ``policy(obs)``, or from the action space (seeded with ``seed``).
    """
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    episode, t = episode_offset, 0
    rows: list[dict] = []
    for _ in range(num_steps):
        action = policy(obs) if policy is not None else env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        rows.append(
            {
                "observation": _obs_td(obs),
                "action": torch.as_tensor(np.array(action, copy=True)),
                "next": {
                    "observation": _obs_td(next_obs),
                    "reward": torch.tensor([reward], dtype=torch.float32),
                    "terminated": torch.tensor([bool(terminated)]),
                    "truncated": torch.tensor([bool(truncated)]),
                    "done": torch.tensor([bool(terminated or truncated)]),
                },
                "collector": {"traj_ids": torch.tensor(episode, dtype=torch.int64)},
                "step_count": torch.tensor(t, dtype=torch.int64),
            }
        )
        if terminated or truncated:
            obs, _ = env.reset()
            episode, t = episode + 1, 0
        else:
            obs, t = next_obs, t + 1
    return torch.stack([TensorDict(r, batch_size=[]) for r in rows])


def reference_index(ted: TensorDictBase) -> dict[tuple[int, int], int]:
    """``{(episode id, step): row}`` over a :func:`rollout`'s rows."""
    eps = ted["collector", "traj_ids"].tolist()
    steps = ted["step_count"].tolist()
    index = {(e, s): i for i, (e, s) in enumerate(zip(eps, steps))}
    if len(index) != len(eps):
        raise ValueError("the rollout repeats an (episode, step) pair")
    return index


def replay_lanes(
    lanes: TensorDictBase, make_env: Callable[[], gym.Env], seed: int
) -> list[TensorDict]:
    """A collector's ``lanes`` ``[P, T]`` replayed, lane ``p`` on its own env from
    ``make_env()`` reset with ``seed + p`` (the collector's seeding) and acting the lane's
    recorded actions: a :func:`rollout` per lane, the reference that does not use the loop."""

    def replay(p: int) -> TensorDict:
        recorded = iter(lanes[p]["action"])
        env = make_env()
        try:
            return rollout(
                env, lanes.shape[1], seed=seed + p, policy=lambda _: next(recorded).numpy()
            )
        finally:
            env.close()

    return [replay(p) for p in range(lanes.shape[0])]


def lane_positions(lanes: TensorDictBase) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(episode id, step): (lane, index)}`` over a collector's ``lanes`` ``[P, T]``, to
    find a stored row's step in them."""
    where = {}
    for p in range(lanes.shape[0]):
        ids = lanes[p]["collector", "traj_ids"].tolist()
        steps = lanes[p]["collector", "step_count"].tolist()
        for i, key in enumerate(zip(ids, steps)):
            where[key] = (p, i)
    return where


@dataclass
class SegmentRecord:
    """Where a segment came from: its rows in the rollout and how it ends.

    ``end`` is ``"terminated"``, ``"truncated"`` or ``"cut"`` (the chunk ended mid-episode).
    """

    episode_id: int
    first_step: int
    length: int
    rows: range
    end: str


def chunk_segments(
    ted: TensorDictBase,
    chunk_lengths: Sequence[int] | np.random.Generator,
    *,
    max_chunk: int = 30,
    with_done: bool = False,
) -> list[list[tuple[Segment, SegmentRecord]]]:
    """Cut a :func:`rollout` into chunks and each chunk into compact segments.

    A chunk is a run of consecutive rows (lengths from ``chunk_lengths``, or drawn from
    ``[1, max_chunk]`` with a generator), as an actor would send them; a segment is a
    maximal run of one episode's steps within a chunk, so it ends at an episode end or at
    the chunk's end. Its steps carry the observation keys at the root, ``"action"`` and
    ``("next", "reward"/"terminated"/"truncated")`` (plus ``("next", "done")`` when
    ``with_done``); its tail is the true next observation of its last step.
    """
    n = ted.shape[0]
    if isinstance(chunk_lengths, np.random.Generator):
        rng = chunk_lengths
        lengths: list[int] = []
        while sum(lengths) < n:
            lengths.append(int(rng.integers(1, max_chunk + 1)))
    else:
        lengths = list(chunk_lengths)
    obs_keys = observation_keys(ted)
    eps = ted["collector", "traj_ids"].tolist()
    done = ted["next", "done"].reshape(-1).tolist()
    terminated = ted["next", "terminated"].reshape(-1).tolist()
    truncated = ted["next", "truncated"].reshape(-1).tolist()
    step_count = ted["step_count"].tolist()
    flag_names = ("terminated", "truncated", "done") if with_done else ("terminated", "truncated")
    chunks: list[list[tuple[Segment, SegmentRecord]]] = []
    pos = 0
    for length in lengths:
        end = min(n, pos + length)
        if pos >= end:
            break
        chunk: list[tuple[Segment, SegmentRecord]] = []
        a = pos
        while a < end:
            b = a
            while b + 1 < end and eps[b + 1] == eps[a] and not done[b]:
                b += 1
            rows = slice(a, b + 1)
            steps: dict = {"action": ted["action"][rows], "next": {}}
            for k in obs_keys:
                _put(steps, k, ted[k][rows])
            steps["next"]["reward"] = ted["next", "reward"][rows]
            for f in flag_names:
                steps["next"][f] = ted["next", f][rows]
            tail: dict = {}
            for k in obs_keys:
                _put(tail, k, ted[("next", *k)][b])
            if terminated[b]:
                kind = "terminated"
            elif truncated[b]:
                kind = "truncated"
            else:
                kind = "cut"
            first = step_count[a]
            seg = Segment(
                TensorDict(steps, batch_size=[b + 1 - a]),
                TensorDict(tail, batch_size=[]),
                eps[a],
                first,
            )
            chunk.append((seg, SegmentRecord(eps[a], first, b + 1 - a, range(a, b + 1), kind)))
            a = b + 1
        chunks.append(chunk)
        pos = end
    return chunks


def _put(d: dict, key: tuple[str, ...], value: torch.Tensor) -> None:
    for part in key[:-1]:
        d = d.setdefault(part, {})
    d[key[-1]] = value


def stored_segments(table) -> dict[tuple[int, int, int, int], int]:
    """The published segments of a table, read from its slot metadata on disk.

    Returns ``{(episode_id, first_step, length, start_slot): generation}``. Checks on the
    way that every published slot belongs to a whole segment (its L step slots then its
    tail, one generation, steps counting up), so a half-published segment fails here. A
    tail slot may instead be the first step of the segment that continues it (the same
    episode, the next step: writers' regions share that slot).
    """
    meta = np.asarray(table.storage.meta)
    gen_c, ep_c, step_c = SlotColumn.GENERATION, SlotColumn.EPISODE_ID, SlotColumn.STEP
    start_c, len_c, kind_c = SlotColumn.SEGMENT_START, SlotColumn.SEGMENT_LENGTH, SlotColumn.KIND
    out: dict[tuple[int, int, int, int], int] = {}
    heads = np.flatnonzero((meta[:, gen_c] > 0) & (meta[:, start_c] == np.arange(len(meta))))
    shared = 0
    for start in heads.tolist():
        gen, ep, first, length = (int(meta[start, c]) for c in (gen_c, ep_c, step_c, len_c))
        rows = meta[start : start + length + 1]
        assert len(rows) == length + 1, f"segment at slot {start} runs past the ring"
        tail = rows[-1]
        if tail[kind_c] == SLOT_STEP:  # shared with the segment that continues this one
            assert tail[start_c] == start + length and tail[gen_c] > gen
            assert tail[ep_c] == ep and tail[step_c] == first + length
            shared += 1
            rows = rows[:-1]
        else:
            assert tail[kind_c] == SLOT_TAIL
        assert (rows[:, gen_c] == gen).all() and (rows[:, ep_c] == ep).all()
        assert (rows[:, start_c] == start).all() and (rows[:, len_c] == length).all()
        assert (rows[:, step_c] == np.arange(first, first + len(rows))).all()
        assert (rows[:length, kind_c] == SLOT_STEP).all()
        out[(ep, first, length, start)] = gen
    n_live = int((meta[:, gen_c] > 0).sum())
    assert n_live == sum(k[2] + 1 for k in out) - shared, "published slots outside whole segments"
    return out


def stored_steps(table) -> set[tuple[int, int]]:
    """``(episode_id, step)`` of every published step of a table."""
    return {
        (ep, first + i) for (ep, first, length, _) in stored_segments(table) for i in range(length)
    }


def constant_segment(episode: int, length: int = 8) -> tuple[TensorDict, TensorDict]:
    """Steps and tail of a CartPole-shaped segment, truncated at its last step, whose
    observations all hold ``episode``: for tests of delivery, not of contents."""
    steps = TensorDict(
        {
            "observation": torch.full((length, 4), float(episode)),
            "action": torch.zeros(length, dtype=torch.int64),
            ("next", "reward"): torch.ones(length),
            ("next", "terminated"): torch.zeros(length, dtype=torch.bool),
            ("next", "truncated"): torch.zeros(length, dtype=torch.bool),
        },
        batch_size=[length],
    )
    steps["next", "truncated"][-1] = True
    tail = TensorDict({"observation": torch.zeros(4)}, batch_size=[])
    return steps, tail


def pattern_segment(
    episode: int, first_step: int, length: int, obs_shape: Sequence[int], terminated: bool = True
) -> Segment:
    """A segment whose every value encodes its ``(episode, step)``: observations are
    :func:`pattern` rows, ``action`` is ``[episode, step]``, ``("next", "reward")`` the step;
    its last step terminates the episode unless ``terminated`` is false."""
    steps = torch.arange(first_step, first_step + length, dtype=torch.int64)
    eps = torch.full((length,), episode, dtype=torch.int64)
    last = torch.zeros(length, 1, dtype=torch.bool)
    last[-1] = terminated
    td = TensorDict(
        {
            "observation": pattern(eps, steps, obs_shape),
            "action": torch.stack([eps, steps], 1),
            "next": {
                "reward": steps.to(torch.float32)[:, None],
                "terminated": last,
                "truncated": torch.zeros(length, 1, dtype=torch.bool),
            },
        },
        batch_size=[length],
    )
    tail = TensorDict({"observation": pattern(episode, first_step + length, obs_shape)}, [])
    return Segment(td, tail, episode, first_step)


def actor_chunks(
    lanes: int,
    chunk_len: int,
    episode_lengths: tuple[int, int],
    seed: int = 0,
    obs_shape: Sequence[int] = (4,),
) -> Iterator[list[Segment]]:
    """Inserts as an env actor of ``lanes`` lanes sends them, endlessly: each lane's next
    ``chunk_len`` steps cut at its episode ends into :func:`pattern_segment` segments, with
    the writer's sequence numbers; episode lengths uniform in ``episode_lengths``."""
    rng = np.random.default_rng(seed)
    lo, hi = episode_lengths
    lane = [[k * 1_000_000, 0, int(rng.integers(lo, hi + 1))] for k in range(lanes)]
    seq = 0
    while True:
        batch = []
        for state in lane:
            left = chunk_len
            while left:
                episode, step, length = state
                n = min(left, length - step)
                seq += 1
                segment = pattern_segment(
                    episode, step, n, obs_shape, terminated=step + n == length
                )
                segment.sequence = seq
                batch.append(segment)
                left -= n
                state[:] = (
                    [episode + 1, 0, int(rng.integers(lo, hi + 1))]
                    if step + n == length
                    else [episode, step + n, length]
                )
        yield batch


def ring_ages(table, inserted: Mapping[tuple[int, int], int], total: int) -> np.ndarray:
    """The age of every step a table holds, in steps inserted since it (0: the newest), from
    ``inserted``: each stored segment's ``(episode, first step)`` to the count of steps
    inserted before it; ``total`` steps were inserted in all. A FIFO ring holding ``S``
    steps holds exactly those of age < ``S``."""
    return np.concatenate(
        [
            total - 1 - (inserted[(episode, first)] + np.arange(n))
            for (episode, first, n, _start) in stored_segments(table)
        ]
    )


def sample_in_parts(table, n: int, **kwargs) -> TensorDictBase:
    """``n`` rows of ``table.sample`` drawn in batches the table allows (at most its capacity
    in steps, ``slice_len`` steps a row), concatenated: many draws for a statistic."""
    most = max(1, table.config.capacity // (table.config.slice_len or 1))
    parts = []
    while n > 0:
        parts.append(table.sample(min(n, most), **kwargs))
        n -= len(parts[-1])
    return torch.cat(parts, 0)


def scrape_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a shard's Prometheus endpoint on ``port``: ``{(name, sorted labels):
    value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
