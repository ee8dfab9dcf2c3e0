"""Side-by-side storage benchmark: millpond's compact segment layout vs TorchRL replay buffers.

Compares, in one run and on the same pre-generated data:

* ``millpond``: a :class:`~millpond.service.table.Table` (uniform sampler; a slices table for
  slice sampling). Each chunk is cut into segments (at episode ends and the chunk end, each
  with its tail observation) by :func:`millpond.segmenting.cut_batch`, as an actor does, and
  inserted with one ``insert_many`` call.
* ``torchrl-ted``: ``ReplayBuffer(storage=LazyMemmapStorage(N))`` in TorchRL's default TED
  layout (``observation`` and ``("next", "observation")`` both stored), ``RandomSampler``;
  ``SliceSampler(slice_len=8, traj_key=("collector", "traj_ids"))`` for slices.
* ``torchrl-compact``: the same storage without ``("next", "observation")`` (what a collector
  with ``compact_obs=True`` produces) and a ``NextStateReconstructor`` transform that rebuilds
  it at sample time from the neighbouring sampled row.

for two step shapes (CartPole-like: float32[4] observations; Atari-like: uint8[4, 84, 84]).

Metrics: bytes per stored transition on disk, every file of the table or buffer directory
counted and broken down by part (and the ratio to TED), insert transitions/s,
uniform ``sample(256)`` transitions/s (next observation materialised), slice sampling
transitions/s (32 slices of 8), and how many sampled next observations are wrong: every
observation carries a unique id, so each sampled ``("next", "observation")`` is checked
against the true one, overall and at episode ends.

Run ``python benchmarks/storage.py`` (several minutes; see ``--help``), or ``--quick`` for a
small smoke run (< 60 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _common import (
    OBS,
    add_common_args,
    calibrate,
    collector_batch,
    emit_report,
    episode_layout,
    load_average,
    log,
    quiet_torchrl,
    scratch_root,
    settle,
    ted_chunk,
)
from _common import code_version as measured_code_version
from tensordict import TensorDict

from millpond.config import TableConfig
from millpond.segmenting import cut_batch, pack_batch
from millpond.segments import PackedSegments, Segment
from millpond.service.table import Table
from millpond.service.table_files import DISK_PARTS, disk_usage

SYSTEMS = ("millpond", "torchrl-ted", "torchrl-compact")
NEXT_OBS = ("next", "observation")
TRAJ = ("collector", "traj_ids")
SLICE_LEN = 8
BATCH = 256


# -- configuration ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    obs_shape: tuple[int, ...]
    obs_dtype: torch.dtype
    episode_len: tuple[int, int]  # uniform in [lo, hi]
    capacity: int  # transitions (rounded up to whole chunks)
    quick_capacity: int


SHAPES = {
    "cartpole": Shape("cartpole", (4,), torch.float32, (20, 200), 1_000_000, 32_768),
    "atari": Shape("atari", (4, 84, 84), torch.uint8, (100, 1000), 50_000, 4_096),
}


@dataclasses.dataclass
class Settings:
    lanes: int
    chunk_len: int
    insert_reps: int  # timed insert passes after the warm-up (first-fill) pass
    sample_reps: int
    sample_rep_seconds: float
    check_batches: int  # uniform batches drawn for the correctness check
    quick: bool


# -- data ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Data:
    """Experience from P lanes collected in chunks of T steps, ready for each system.

    Every observation carries a unique id (>= 1) in its first element (float) or first four
    bytes (uint8); ``next_of[id]`` is the id of the true next observation of the step whose
    observation has that id, and ``done_of[id]`` whether that step ends its episode.
    """

    shape: Shape
    num_steps: int
    ted_chunks: list[TensorDict]  # flattened [P*T] TED chunks
    compact_chunks: list[TensorDict]  # the same without ("next", "observation")
    segment_chunks: list[list[Segment]]  # millpond segments, one list per chunk
    num_segments: int
    num_episode_ends: int
    next_of: np.ndarray
    done_of: np.ndarray
    cut_seconds_per_chunk: float  # actor-side cost of cutting one chunk into segments
    batches: list[TensorDict]  # the collector chunks [P, T] (views), for pack_chunk


def encode_ids(obs: torch.Tensor, ids: np.ndarray) -> None:
    """Write ``ids`` into ``obs`` (leading dim = len(ids)) in place."""
    if obs.dtype.is_floating_point:
        obs.reshape(len(ids), -1)[:, 0] = torch.from_numpy(ids.astype(np.float32))
    else:
        b = torch.from_numpy(ids.astype("<u4").view(np.uint8).reshape(-1, 4))
        obs.reshape(len(ids), -1)[:, :4] = b


def decode_ids(obs: torch.Tensor, event_dims: int) -> np.ndarray:
    """The ids carried by ``obs`` (-1 where they are NaN); batch dims are kept."""
    batch = obs.shape[: obs.dim() - event_dims]
    flat = obs.reshape(*batch, -1)
    if obs.dtype.is_floating_point:
        x = flat[..., 0]
        return torch.where(torch.isnan(x), torch.full_like(x, -1), x).to(torch.int64).numpy()
    b = flat[..., :4].to(torch.int64)
    return (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)).numpy()


def pack_chunk(batch: TensorDict, episode_offset: int) -> PackedSegments:
    """Cut a collector chunk ``[P, T]`` into segments straight into columns
    (:func:`millpond.segmenting.pack_batch`, as an env actor does when it has no experience
    processor), its episode ids moved by ``episode_offset``.

    Not what ``insert_many`` does (it takes one ``Segment`` per cut); this measures what an
    actor that packs whole chunks gets from ``Table.insert_packed``.
    """
    packed = pack_batch(batch)
    return dataclasses.replace(packed, episode_ids=packed.episode_ids + episode_offset)


def make_data(shape: Shape, capacity: int, lanes: int, chunk_len: int, seed: int = 0) -> Data:
    rng = np.random.default_rng(seed)
    P, T = lanes, chunk_len
    n_chunks = -(-capacity // (P * T))
    S = n_chunks * T  # steps per lane
    eps = episode_layout(rng, P, S, shape.episode_len)
    traj, step_idx, term, trunc = eps.episode, eps.step, eps.terminated, eps.truncated
    # An episode of L steps uses L + 1 observation ids (its L step observations and its
    # final observation), episode after episode from id 1.
    first_id = 1 + np.concatenate([[0], np.cumsum(eps.lengths + 1)[:-1]])
    obs_id = first_id[traj] + step_idx
    next_id = obs_id + 1
    n_ids = 1 + int((eps.lengths + 1).sum())
    next_of = np.full(n_ids, -1, dtype=np.int64)
    done_of = np.zeros(n_ids, dtype=bool)
    next_of[obs_id.reshape(-1)] = next_id.reshape(-1)
    done_of[obs_id.reshape(-1)] = (term | trunc).reshape(-1)

    # Observations, chunk-major: [n_chunks, P, T, *obs].
    def chunked(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(P, n_chunks, T).transpose(1, 0, 2))

    obs_id_c, next_id_c = chunked(obs_id), chunked(next_id)
    traj_c, step_c = chunked(traj), chunked(step_idx)
    term_c, trunc_c = chunked(term), chunked(trunc)
    full = (n_chunks, P, T, *shape.obs_shape)
    gen = torch.Generator().manual_seed(seed)
    if shape.obs_dtype.is_floating_point:
        obs = torch.randn(full, generator=gen, dtype=shape.obs_dtype)
        next_obs = torch.randn(full, generator=gen, dtype=shape.obs_dtype)
    else:
        obs = torch.randint(0, 256, full, generator=gen, dtype=shape.obs_dtype)
        next_obs = torch.empty(full, dtype=shape.obs_dtype)
    # next_obs[t] must equal obs[t + 1] inside an episode: copy it from where it is stored.
    id_to_pos = np.full(n_ids, -1, dtype=np.int64)
    id_to_pos[obs_id_c.reshape(-1)] = np.arange(obs_id_c.size)
    pos = id_to_pos[next_id_c.reshape(-1)]
    flat_obs, flat_next = obs.view(-1, *shape.obs_shape), next_obs.view(-1, *shape.obs_shape)
    stored = pos >= 0
    idx = torch.from_numpy(np.flatnonzero(stored))
    flat_next[idx] = flat_obs[torch.from_numpy(pos[stored])]
    final = torch.from_numpy(np.flatnonzero(~stored))  # final observations of episodes
    if not shape.obs_dtype.is_floating_point:
        flat_next[final] = torch.randint(
            0, 256, (len(final), *shape.obs_shape), generator=gen, dtype=shape.obs_dtype
        )
    encode_ids(flat_obs, obs_id_c.reshape(-1))
    encode_ids(flat_next, next_id_c.reshape(-1))
    del flat_obs, flat_next, id_to_pos, pos, idx

    action = torch.from_numpy(rng.integers(0, 18, size=(n_chunks, P, T)))
    reward = torch.from_numpy(rng.standard_normal((n_chunks, P, T, 1)).astype(np.float32))
    term_t = torch.from_numpy(term_c).unsqueeze(-1)
    trunc_t = torch.from_numpy(trunc_c).unsqueeze(-1)

    ted_chunks, compact_chunks, segment_chunks, batches = [], [], [], []
    cut_times = []
    for c in range(n_chunks):
        batch = collector_batch(
            obs[c],
            next_obs[c],
            action[c],
            reward[c],
            term_t[c],
            trunc_t[c],
            torch.from_numpy(traj_c[c]),
            torch.from_numpy(step_c[c]),
        )
        td = ted_chunk(batch)
        ted_chunks.append(td)
        compact_chunks.append(td.exclude(NEXT_OBS))
        t0 = time.perf_counter()
        segs = cut_batch(batch)
        cut_times.append(time.perf_counter() - t0)
        segment_chunks.append(segs)
        batches.append(batch)
    return Data(
        shape=shape,
        num_steps=n_chunks * P * T,
        ted_chunks=ted_chunks,
        compact_chunks=compact_chunks,
        segment_chunks=segment_chunks,
        num_segments=sum(len(s) for s in segment_chunks),
        num_episode_ends=int((term | trunc).sum()),
        next_of=next_of,
        done_of=done_of,
        cut_seconds_per_chunk=statistics.median(cut_times),
        batches=batches,
    )


# -- systems ---------------------------------------------------------------------------------
def torchrl_usage(path: Path) -> dict[str, int]:
    """Bytes on disk (st_blocks * 512) of every file of a ``LazyMemmapStorage`` directory, by
    part: ``observation.memmap`` files (root and ``next``), the other ``.memmap`` columns
    (including ``collector/traj_ids``), and the rest (its ``meta.json`` files)."""
    usage = dict.fromkeys(DISK_PARTS, 0)
    for p in path.rglob("*"):
        if p.is_file():
            if p.name == "observation.memmap":
                part = "observations"
            elif p.suffix == ".memmap":
                part = "step fields"
            else:
                part = "table files"
            usage[part] += p.stat().st_blocks * 512
    return usage


class System:
    """One replay implementation under test: a buffer for uniform and one for slice sampling."""

    name: str

    def insert_pass(self, data: Data, pass_no: int) -> None:
        raise NotImplementedError

    def prepare_slices(self, data: Data) -> None:
        """Make the slice buffer ready (filled with ``data``)."""

    def sample_uniform(self) -> TensorDict:
        raise NotImplementedError

    def sample_slices(self) -> TensorDict:
        raise NotImplementedError

    def stored(self) -> int:
        raise NotImplementedError

    def disk_usage(self) -> dict[str, int]:
        """Bytes on disk of every file of the uniform buffer, by part (:data:`DISK_PARTS`)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Millpond(System):
    name = "millpond"

    def __init__(self, root: Path, data: Data) -> None:
        self.root = root
        # A segment of L steps takes L + 1 slots: size the ring to hold every step once.
        self.capacity = data.num_steps + data.num_segments
        self.table = Table.create(root / "uniform", TableConfig.uniform("uniform", self.capacity))
        self.slices: Table | None = None
        # Each pass gets fresh episode ids, as new experience would.
        self._episode_stride = 1 + max(s.episode_id for segs in data.segment_chunks for s in segs)
        self._passes: dict[int, list[list[Segment]]] = {}

    def segments_for(self, data: Data, pass_no: int) -> list[list[Segment]]:
        off = pass_no * self._episode_stride
        return [
            [Segment(s.steps, s.tail, s.episode_id + off, s.first_step) for s in segs]
            for segs in data.segment_chunks
        ]

    def insert_pass(self, data: Data, pass_no: int) -> None:
        insert_many = self.table.insert_many
        for segs in self._passes.pop(pass_no):
            insert_many(segs)

    def insert_pass_packed(self, data: Data, pass_no: int) -> None:
        """Like :meth:`insert_pass`, but each chunk packed by :func:`pack_chunk` (timed too)."""
        off = pass_no * self._episode_stride
        insert_packed = self.table.insert_packed
        for batch in data.batches:
            insert_packed(pack_chunk(batch, off))

    def stage(self, data: Data, pass_no: int) -> None:
        """Build the pass's Segment objects (fresh episode ids) outside the timed region."""
        self._passes[pass_no] = self.segments_for(data, pass_no)

    def prepare_slices(self, data: Data) -> None:
        self.table.destroy()  # one table at a time keeps the page cache small
        self.slices = Table.create(
            self.root / "slices", TableConfig.slices("slices", self.capacity, SLICE_LEN)
        )
        for segs in self.segments_for(data, 0):
            self.slices.insert_many(segs)

    def sample_uniform(self) -> TensorDict:
        return self.table.sample(BATCH)

    def sample_slices(self) -> TensorDict:
        assert self.slices is not None
        return self.slices.sample(BATCH // SLICE_LEN)

    def stored(self) -> int:
        return self.table.size

    def disk_usage(self) -> dict[str, int]:
        # The whole table directory: data columns, slot pointers, segment records, the
        # sampler's and the table's own files (table.info()'s figure counts data/ only).
        return disk_usage(self.table.path, self.table.spec)

    def close(self) -> None:
        for t in (self.table, self.slices):
            if t is not None:
                t.destroy()


class TorchRL(System):
    def __init__(self, root: Path, data: Data, compact: bool) -> None:
        from torchrl.data import LazyMemmapStorage, RandomSampler, ReplayBuffer, SliceSampler
        from torchrl.envs.transforms import NextStateReconstructor

        self.compact = compact
        self.name = "torchrl-compact" if compact else "torchrl-ted"
        self.dir = root / self.name
        self.dir.mkdir(parents=True)
        self.storage = LazyMemmapStorage(data.num_steps, scratch_dir=str(self.dir))
        # uint8 observations cannot hold NaN: the reconstructor needs an integer fill value.
        fill = float("nan") if data.shape.obs_dtype.is_floating_point else 0

        def transform():
            return NextStateReconstructor(fill_value=fill) if compact else None

        self.rb = ReplayBuffer(
            storage=self.storage, sampler=RandomSampler(), batch_size=BATCH, transform=transform()
        )
        # A second buffer over the same storage, with the slice sampler.
        self.rb_slices = ReplayBuffer(
            storage=self.storage,
            sampler=SliceSampler(slice_len=SLICE_LEN, traj_key=TRAJ),
            batch_size=BATCH,
            transform=transform(),
        )

    def insert_pass(self, data: Data, pass_no: int) -> None:
        extend = self.rb.extend
        for td in data.compact_chunks if self.compact else data.ted_chunks:
            extend(td)

    def sample_uniform(self) -> TensorDict:
        return self.rb.sample()

    def sample_slices(self) -> TensorDict:
        return self.rb_slices.sample()

    def stored(self) -> int:
        return len(self.rb)

    def disk_usage(self) -> dict[str, int]:
        return torchrl_usage(self.dir)

    def close(self) -> None:
        del self.rb, self.rb_slices, self.storage
        gc.collect()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- measurement -----------------------------------------------------------------------------
def interleaved_rates(
    label: str, fns: dict[str, Callable[[], object]], items: int, s: Settings
) -> dict[str, float]:
    """Median items/s of each function; repetitions alternate between the systems.

    Alternating keeps slow phases of a shared machine from landing on one system only.
    """
    calls = {name: calibrate(fn, s.sample_rep_seconds) for name, fn in fns.items()}
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(s.sample_reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            rates[name].append(items * calls[name] / (time.perf_counter() - t0))
        log(
            f"{label} rep {rep + 1}/{s.sample_reps}: "
            + " | ".join(f"{n} {r[-1]:,.0f}" for n, r in rates.items())
            + " transitions/s"
        )
    return {name: statistics.median(r) for name, r in rates.items()}


def check_next_obs(
    data: Data, samples: list[TensorDict], event_dims: int
) -> tuple[int, int, int, int]:
    """(wrong, total, wrong at episode ends, episode ends) over the sampled transitions."""
    wrong = total = wrong_end = n_end = 0
    for td in samples:
        ids = decode_ids(td.get(OBS), event_dims).reshape(-1)
        nxt = decode_ids(td.get(NEXT_OBS), event_dims).reshape(-1)
        if (ids <= 0).any() or (data.next_of[ids] < 0).any():
            raise AssertionError("a sampled observation is not one of the stored steps")
        bad = nxt != data.next_of[ids]
        end = data.done_of[ids]
        wrong += int(bad.sum())
        total += len(ids)
        wrong_end += int((bad & end).sum())
        n_end += int(end.sum())
    return wrong, total, wrong_end, n_end


def _materialised(sample: Callable[[], TensorDict]) -> Callable[[], None]:
    def fn() -> None:
        sample().get(NEXT_OBS)  # present (gathered or rebuilt) in every system's output

    return fn


def run_shape(shape: Shape, root: Path, s: Settings, names: list[str]) -> list[dict]:
    capacity = shape.quick_capacity if s.quick else shape.capacity
    log(f"[{shape.name}] generating {capacity:,} transitions ({s.lanes} lanes x {s.chunk_len})")
    t0 = time.perf_counter()
    data = make_data(shape, capacity, s.lanes, s.chunk_len)
    n = data.num_steps
    log(
        f"[{shape.name}] {n:,} steps, {len(data.ted_chunks)} chunks, "
        f"{data.num_segments:,} segments, {data.num_episode_ends:,} episode ends "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    path = root / shape.name
    path.mkdir(parents=True, exist_ok=True)
    systems: dict[str, System] = {}
    res: dict[str, dict] = {}
    try:
        for name in names:
            if name == "millpond":
                systems[name] = Millpond(path, data)
            else:
                systems[name] = TorchRL(path, data, compact=name == "torchrl-compact")
            res[name] = {
                "system": name,
                "shape": shape.name,
                "num_steps": n,
                "segments_per_step": data.num_segments / n,
                "cut_us_per_chunk": data.cut_seconds_per_chunk * 1e6,
            }

        # 1+2. Insert: a first fill (warm-up: files grow, pages fault in), then timed passes
        # over the same data that overwrite it (the steady state of a full ring).
        times: dict[str, list[float]] = {name: [] for name in systems}
        for rep in range(s.insert_reps + 1):
            what = "first fill (warm-up)" if rep == 0 else f"pass {rep}/{s.insert_reps}"
            line = []
            for name, system in systems.items():
                if isinstance(system, Millpond) and rep > 0:
                    # Supplementary: the same chunks packed in one vectorised step each and
                    # stored with insert_packed (see pack_chunk). Run first, so that the
                    # table ends up holding what insert_many stored.
                    settle()
                    t0 = time.perf_counter()
                    system.insert_pass_packed(data, 1000 + rep)
                    dt = time.perf_counter() - t0
                    res[name].setdefault("packed_times", []).append(dt)
                    line.append(f"{name} (chunk packed) {n / dt:,.0f}")
                if isinstance(system, Millpond):
                    system.stage(data, rep)
                settle()
                t0 = time.perf_counter()
                system.insert_pass(data, rep)
                dt = time.perf_counter() - t0
                if rep == 0:
                    res[name]["first_fill_tps"] = n / dt
                else:
                    times[name].append(dt)
                line.append(f"{name} {n / dt:,.0f}")
            log(f"[{shape.name}] insert {what}: " + " | ".join(line) + " transitions/s")
        for name, system in systems.items():
            res[name]["insert_tps"] = n / statistics.median(times[name])
            if "packed_times" in res[name]:
                res[name]["packed_insert_tps"] = n / statistics.median(res[name]["packed_times"])
            if system.stored() != n:
                raise AssertionError(f"{name} holds {system.stored()} transitions, expected {n}")
        settle()
        for name, system in systems.items():
            res[name]["disk_usage"] = system.disk_usage()
            res[name]["bytes"] = sum(res[name]["disk_usage"].values())
            res[name]["bytes_per_transition"] = res[name]["bytes"] / n
            log(
                f"[{shape.name}] {name}: {res[name]['bytes_per_transition']:,.1f} bytes "
                "per stored transition"
            )

        # 3. Uniform sample(256), next observation materialised.
        rates = interleaved_rates(
            f"[{shape.name}] uniform sample({BATCH})",
            {name: _materialised(sy.sample_uniform) for name, sy in systems.items()},
            BATCH,
            s,
        )
        event_dims = len(shape.obs_shape)
        for name, system in systems.items():
            res[name]["uniform_tps"] = rates[name]
            check = check_next_obs(
                data, [system.sample_uniform() for _ in range(s.check_batches)], event_dims
            )
            res[name]["uniform_check"] = check
            log(
                f"[{shape.name}] {name}: uniform next obs wrong {check[0]}/{check[1]}, "
                f"at episode ends {check[2]}/{check[3]}"
            )

        # 4. Slice sampling: 32 slices of 8 consecutive steps (256 transitions).
        for name, system in systems.items():
            t0 = time.perf_counter()
            system.prepare_slices(data)
            log(f"[{shape.name}] {name}: slice buffer ready ({time.perf_counter() - t0:.1f} s)")
        settle()
        rates = interleaved_rates(
            f"[{shape.name}] slices {BATCH // SLICE_LEN}x{SLICE_LEN}",
            {name: _materialised(sy.sample_slices) for name, sy in systems.items()},
            BATCH,
            s,
        )
        for name, system in systems.items():
            res[name]["slice_tps"] = rates[name]
            check = check_next_obs(
                data,
                [system.sample_slices() for _ in range(max(4, s.check_batches // 8))],
                event_dims,
            )
            res[name]["slice_check"] = check
            log(f"[{shape.name}] {name}: slice next obs wrong {check[0]}/{check[1]}")
    finally:
        for system in systems.values():
            system.close()
        settle()
    del data
    gc.collect()
    return list(res.values())


# -- report ----------------------------------------------------------------------------------
def _pct(wrong: int, total: int) -> str:
    return f"{100 * wrong / total:.1f}% ({wrong}/{total})" if total else "n/a"


def render(
    results: list[dict],
    s: Settings,
    argv: list[str],
    load: tuple[tuple[float, ...], tuple[float, ...]],
    code_version: str,
) -> str:
    import torchrl

    lines = []
    cpu = platform.processor() or platform.machine()
    lines.append(
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op thread(s)), "
        f"torchrl {torchrl.__version__}. "
        f"Data: {s.lanes} lanes x {s.chunk_len} steps per chunk. {load_average(load)}."
    )
    lines.append("")
    lines.append(f"millpond code: {code_version}.")
    lines.append("")
    lines.append(
        "| shape | system | stored | bytes/transition | vs TED | insert tr/s | vs TED "
        "| uniform sample(256) tr/s | vs TED | slices 32x8 tr/s | vs TED "
        "| wrong next obs (uniform) | wrong at episode ends (uniform) | wrong next obs (slices) |"
    )
    lines.append("|" + "---|" * 14)
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == shape]
        ted = next((r for r in rows if r["system"] == "torchrl-ted"), None)

        def vs(r: dict, key: str, ted: dict | None = ted) -> str:
            return f"{r[key] / ted[key]:.2f}x" if ted else "n/a"

        for r in rows:
            w, t, we, ne = r["uniform_check"]
            sw, st, _, _ = r["slice_check"]
            lines.append(
                f"| {shape} | {r['system']} | {r['num_steps']:,} "
                f"| {r['bytes_per_transition']:,.1f} | {vs(r, 'bytes_per_transition')} "
                f"| {r['insert_tps']:,.0f} | {vs(r, 'insert_tps')} "
                f"| {r['uniform_tps']:,.0f} | {vs(r, 'uniform_tps')} "
                f"| {r['slice_tps']:,.0f} | {vs(r, 'slice_tps')} "
                f"| {_pct(w, t)} | {_pct(we, ne)} | {_pct(sw, st)} |"
            )
    lines.append("")
    lines.append(
        "Bytes on disk per stored transition, by part (every file of the table or buffer "
        "directory, st_blocks x 512):"
    )
    lines.append("")
    lines.append("| shape | system | " + " | ".join(DISK_PARTS) + " | total | vs TED |")
    lines.append("|" + "---|" * (len(DISK_PARTS) + 4))
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == shape]
        ted = next((r for r in rows if r["system"] == "torchrl-ted"), None)
        for r in rows:
            parts = " | ".join(f"{r['disk_usage'][p] / r['num_steps']:,.1f}" for p in DISK_PARTS)
            ratio = (
                f"{r['bytes_per_transition'] / ted['bytes_per_transition']:.3f}x" if ted else "n/a"
            )
            lines.append(
                f"| {shape} | {r['system']} | {parts} "
                f"| {r['bytes_per_transition']:,.1f} | {ratio} |"
            )
    lines.append("")
    lines.append("Insert: first fill (warm-up pass, not in the table above), transitions/s:")
    lines.append("")
    for r in results:
        lines.append(f"- {r['shape']} / {r['system']}: {r['first_fill_tps']:,.0f}")
    packed = [r for r in results if "packed_insert_tps" in r]
    if packed:
        lines.append("")
        lines.append(
            "Supplementary, millpond only: each chunk cut and packed into columns in one "
            "vectorised step (`pack_chunk` in this script) and stored with "
            "`Table.insert_packed`, packing included in the timing:"
        )
        lines.append("")
        for r in packed:
            ted = next(
                (x for x in results if x["shape"] == r["shape"] and x["system"] == "torchrl-ted"),
                None,
            )
            ratio = f" ({r['packed_insert_tps'] / ted['insert_tps']:.2f}x TED)" if ted else ""
            lines.append(
                f"- {r['shape']}: {r['packed_insert_tps']:,.0f} transitions/s{ratio}, vs "
                f"{r['insert_tps']:,.0f} with insert_many"
            )
    seen = {}
    for r in results:
        seen[r["shape"]] = r
    lines.append("")
    for shape, r in seen.items():
        lines.append(
            f"- {shape}: {r['segments_per_step']:.4f} segments per step (millpond stores "
            f"{r['segments_per_step'] * 100:.2f}% extra observation slots); cutting a "
            f"{s.lanes}x{s.chunk_len} chunk into segments costs the actor "
            f"{r['cut_us_per_chunk']:,.0f} us (not in the insert figures)."
        )
    lines.append("")
    lines.append("Command: `python " + " ".join(["benchmarks/storage.py", *argv]) + "`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, "small smoke run (< 60 s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--lanes", type=int, default=8, help="env lanes P per chunk")
    ap.add_argument("--chunk-len", type=int, default=128, help="steps T per chunk")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for every system (default 1: on a small shared machine, "
        "2 threads let any other load stall each parallel copy)",
    )
    ap.add_argument(
        "--reps", type=int, help="timed repetitions (default: 3 insert / 7 sample; quick 1 / 2)"
    )
    args = ap.parse_args(argv)
    shapes = [SHAPES[x] for x in args.shapes.split(",") if x]
    systems = [x for x in args.systems.split(",") if x]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    quick = args.quick
    s = Settings(
        lanes=args.lanes,
        chunk_len=args.chunk_len,
        insert_reps=args.reps or (1 if quick else 3),
        sample_reps=args.reps or (2 if quick else 7),
        sample_rep_seconds=0.1 if quick else 0.4,
        check_batches=8 if quick else 400,
        quick=quick,
    )
    quiet_torchrl()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    code_version = measured_code_version(
        ["service", "millpond"]
    )  # now: the modules measured were imported at start
    t0 = time.perf_counter()
    with scratch_root(args.dir, "millpond-bench-") as root:
        results = []
        for shape in shapes:
            results += run_shape(shape, root, s, systems)
    report = render(results, s, argv, (load_before, os.getloadavg()), code_version)
    emit_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
