"""Crash safety: a writer process killed with SIGKILL loses nothing it acknowledged.

A child process inserts Atari-sized segments (uint8[4, 84, 84] observations that encode
their episode and step in every byte) in a loop and prints each acknowledgement. The test
kills it with SIGKILL at a random moment (usually in the middle of the next insert), reopens
the directory and checks it against a model of the ring: every acknowledged segment that
no later insert had the right to overwrite is there and intact, nothing torn or
half-written is visible, counters moved as they should, and inserting afterwards works.
This repeats on the same directory, with a capacity that holds everything and with one
that wraps all the time.

Starting Python with torch takes seconds, so one helper process (a "zygote") imports
everything once and forks a fresh writer for each round; the writers are real processes,
and each is killed and reaped before the directory is reopened.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from millpond.service.config import TableConfig
from millpond.service.segments import Segment
from millpond.service.storage import SegmentStorage
from millpond.service.table import Table
from millpond.testing import pattern, stored_segments

OBS_SHAPE = (4, 84, 84)
MAX_LEN = 50


# --- code that runs in the child (shipped as source, see _zygote_source) ---------------------
def make_segment(ep, first, length, terminated):
    steps = torch.arange(first, first + length, dtype=torch.int64)
    eps = torch.full((length,), ep, dtype=torch.int64)
    last = torch.zeros(length, 1, dtype=torch.bool)
    last[-1] = terminated
    td = TensorDict(
        {
            "observation": pattern(eps, steps, OBS_SHAPE),
            "action": torch.stack([eps, steps], 1),
            "next": {
                "reward": steps.to(torch.float32)[:, None],
                "terminated": last,
                "truncated": torch.zeros(length, 1, dtype=torch.bool),
            },
        },
        batch_size=[length],
    )
    tail = TensorDict({"observation": pattern(ep, first + length, OBS_SHAPE)}, batch_size=[])
    return Segment(td, tail, ep, first)


def insert_loop(cmd, emit):
    """Insert blocks of 1-3 segments forever; announce each block, then acknowledge it."""
    rng = np.random.default_rng(cmd["seed"])
    table = Table.open(cmd["dir"])
    ep = cmd["first_episode"]

    def block():
        nonlocal ep
        segs = []
        for _ in range(1 if rng.random() < 0.6 else int(rng.integers(2, 4))):
            length = int(rng.integers(1, cmd["max_len"] + 1))
            first = int(rng.integers(0, 1000))
            segs.append(make_segment(ep, first, length, bool(rng.random() < 0.3)))
            ep += 1
        return segs

    if cmd.get("crash_points"):
        # SIGKILL ourselves before a random line of the insert path: a kill at every stage
        # of allocation, eviction, copy and publication, down to between two metadata writes.
        chance = np.random.default_rng(cmd["seed"] + 1)
        codes = {Table._insert_block.__code__} | {
            getattr(SegmentStorage, name).__code__
            for name in ("unpublish", "reserve", "write", "publish")
        }

        def line(frame, event, arg):
            if event == "line" and chance.random() < cmd["crash_points"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return line

        sys.settrace(lambda frame, event, arg: line if frame.f_code in codes else None)

    segs = block()
    emit({"begin": [[s.episode_id, s.first_step, s.steps.batch_size[0]] for s in segs]})
    while True:
        if len(segs) == 1:
            s = segs[0]
            table.insert(s.steps, s.tail, s.episode_id, s.first_step)
        else:
            table.insert_many(segs)
        acked = [s.episode_id for s in segs]
        segs = block()
        # One write: the ack, then the announcement of the block inserted right after it.
        emit(
            {"ack": acked},
            {"begin": [[s.episode_id, s.first_step, s.steps.batch_size[0]] for s in segs]},
        )


def stateful(cmd, emit):
    """Build state in a prioritized, a queue and a rate-limited table; checkpoint; report it."""
    root = Path(cmd["dir"])
    rng = np.random.default_rng(cmd["seed"])
    prio = Table.create(root / "prio", TableConfig.prioritized("prio", 96, alpha=0.6, seed=0))
    fifo = Table.create(root / "fifo", TableConfig.queue("fifo", 96))
    limited = Table.create(
        root / "limited",
        TableConfig.uniform("limited", 96, samples_per_insert=2.0, error_buffer=500.0, seed=0),
    )
    for i in range(8):
        seg = make_segment(i, 10 * i, int(rng.integers(1, 8)), i % 2 == 0)
        for table in (prio, fifo, limited):
            table.insert(seg.steps, seg.tail, seg.episode_id, seg.first_step)
    # Known priorities, including one high value that is lowered again afterwards.
    segs = stored_segments(prio)
    live = np.concatenate([np.arange(s[3], s[3] + s[2]) for s in segs])
    gens = np.concatenate([np.full(s[2], g) for s, g in segs.items()])
    prio.update_priorities(live, gens, rng.uniform(0.1, 3.0, len(live)))
    prio.update_priorities(live[:1], gens[:1], np.array([50.0]))
    prio.update_priorities(live[:1], gens[:1], np.array([0.5]))
    # The learner reads the first segments of the queue.
    delivered = []
    for _ in range(2):
        td = fifo.sample(6, timeout=5)
        delivered += list(zip(td["episode_id"].tolist(), td["step"].tolist()))
    for _ in range(5):
        limited.sample(int(rng.integers(1, 9)), timeout=5)
    for table in (prio, fifo, limited):
        table.checkpoint()
    emit(
        {
            "priorities": {
                "slots": live.tolist(),
                "values": np.asarray(prio.sampler.priorities)[live].tolist(),
                "max_priority": prio.sampler.max_priority,
                "mass": prio.info()["mass"],
            },
            "delivered": delivered,
            "queue_size": fifo.size,
            "limited": {k: limited.info()[k] for k in ("inserts", "samples", "size")},
            "fifo_counters": {k: fifo.info()[k] for k in ("inserts", "samples")},
        }
    )
    time.sleep(3600)  # killed here, without close()


_ZYGOTE_MAIN = """
def _main():
    torch.set_num_threads(1)

    def emit(*objs):
        data = "".join(json.dumps(o) + "\\n" for o in objs).encode()
        os.write(1, data)

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                emit({"hello": os.getpid()})
                globals()[cmd["run"]](cmd, emit)
            except BaseException as e:
                emit({"error": repr(e)})
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"reaped": pid, "status": status}), flush=True)


_main()
"""


def _zygote_source() -> str:
    header = textwrap.dedent(
        f"""
        import json, os, signal, sys, time
        from pathlib import Path
        import numpy as np
        import torch
        from tensordict import TensorDict
        from millpond.service.config import TableConfig
        from millpond.service.segments import Segment
        from millpond.service.storage import SegmentStorage
        from millpond.service.table import Table
        from millpond.testing import pattern, stored_segments
        OBS_SHAPE = {OBS_SHAPE!r}
        """
    )
    funcs = [inspect.getsource(f) for f in (make_segment, insert_loop, stateful)]
    return "\n\n".join([header, *funcs, _ZYGOTE_MAIN])


class Zygote:
    """A child Python that forks one worker per :meth:`start`, for killing and reaping."""

    def __init__(self, folder: Path) -> None:
        script = folder / "zygote.py"
        script.write_text(_zygote_source())
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert "ready" in self.next(60)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put({"eof": True})

    def next(self, timeout: float = 20) -> dict:
        msg = self.lines.get(timeout=timeout)
        assert "error" not in msg and "eof" not in msg, msg
        return msg

    def start(self, **cmd) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.next()["hello"]

    def kill(self, pid: int) -> list[dict]:
        """SIGKILL the worker and wait until it is reaped; returns the messages seen meanwhile."""
        os.kill(pid, signal.SIGKILL)
        seen = []
        while True:
            msg = self.next()
            if msg.get("reaped") == pid:
                assert os.WIFSIGNALED(msg["status"]) and os.WTERMSIG(msg["status"]) == 9, msg
                return seen
            seen.append(msg)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


# --- a model of the ring ----------------------------------------------------------------------
# A segment is (episode, first step, length, start slot).
Seg = tuple[int, int, int, int]


class Ring:
    """Where blocks go and which segments they evict: oldest-first, wrapping to slot 0."""

    def __init__(self, capacity: int, segments: set[Seg], cursor: int) -> None:
        self.capacity = capacity
        self.segments = set(segments)
        self.cursor = cursor

    def place(self, block: list[list[int]]) -> tuple[set[Seg], set[Seg]]:
        """The segments ``block`` ([episode, first, length] each) would write, and evict."""
        n = sum(length + 1 for _, _, length in block)
        start = 0 if self.cursor + n > self.capacity else self.cursor
        victims = {s for s in self.segments if s[3] < start + n and start < s[3] + s[2] + 1}
        new, pos = set(), start
        for ep, first, length in block:
            new.add((ep, first, length, pos))
            pos += length + 1
        return new, victims

    def insert(self, block: list[list[int]]) -> None:
        new, victims = self.place(block)
        self.segments = (self.segments - victims) | new
        self.cursor = max(s[3] + s[2] + 1 for s in new)


def check_intact(table: Table, segments) -> None:
    """Every slot of every segment holds exactly its (episode, step) row."""
    obs, action = table.storage.columns[("observation",)], table.storage.columns[("action",)]
    for ep, first, length, start in segments:
        slots = torch.arange(start, start + length + 1)
        steps = torch.arange(first, first + length + 1)
        assert torch.equal(obs[slots], pattern(ep, steps, OBS_SHAPE)), f"torn episode {ep}"
        want = torch.stack([torch.full((length,), ep), steps[:-1]], 1)
        assert torch.equal(action[slots[:-1]], want), f"torn action of episode {ep}"


def check_samples(table: Table, n: int = 256) -> None:
    td = table.sample(n, timeout=5)
    assert torch.equal(td["observation"], pattern(td["episode_id"], td["step"], OBS_SHAPE))
    nxt = pattern(td["episode_id"], td["step"] + 1, OBS_SHAPE)
    assert torch.equal(td["next", "observation"], nxt)


@pytest.mark.parametrize(
    "capacity, rounds, crash_points",
    [(16384, 5, 0.0), (400, 5, 0.0), (400, 6, 1 / 600)],
    ids=["large", "small-wrapping", "small-crash-points"],
)
def test_sigkill_during_inserts_loses_no_acknowledged_segment(
    tmp_path, zygote, capacity, rounds, crash_points
):
    rng = np.random.default_rng(capacity + rounds)
    path = tmp_path / "table"
    Table.create(path, TableConfig.uniform("t", capacity, seed=0)).close()
    ring = Ring(capacity, set(), 0)
    inserts = 0
    mid_copy = 0
    for r in range(rounds):
        pid = zygote.start(
            run="insert_loop",
            dir=str(path),
            seed=int(rng.integers(2**31)),
            first_episode=(r + 1) * 100_000,
            max_len=MAX_LEN,
            crash_points=crash_points,
        )
        acked_blocks: list[list[list[int]]] = []
        pending: list[list[int]] | None = None

        def follow(msg: dict) -> None:
            nonlocal pending
            if "begin" in msg:
                pending = msg["begin"]
            else:
                assert pending is not None and msg["ack"] == [s[0] for s in pending]
                acked_blocks.append(pending)
                pending = None

        if crash_points:
            # The child kills itself at a random line of the insert path (or we do, late).
            while True:
                msg = zygote.next()
                if msg.get("reaped") == pid:
                    assert os.WIFSIGNALED(msg["status"]), msg
                    break
                follow(msg)
                if len(acked_blocks) == 200:
                    for msg in zygote.kill(pid):
                        follow(msg)
                    break
        else:
            kill_after = int(rng.integers(1, 25))
            while len(acked_blocks) < kill_after:
                follow(zygote.next())
            time.sleep(float(rng.uniform(0, 0.003)))
            for msg in zygote.kill(pid):
                follow(msg)

        # What the ring must hold: everything acknowledged that no acknowledged block evicted,
        # less what the interrupted block (if any) may have claimed, plus what it may have
        # published.
        for block in acked_blocks:
            ring.insert(block)
        in_flight, may_lose = ring.place(pending) if pending else (set(), set())
        if pending:
            obs = np.memmap(
                path / "data" / "columns" / "observation.bin", dtype=np.uint8, mode="r"
            ).reshape(capacity, -1)
            slots = np.concatenate([np.arange(s[3], s[3] + s[2] + 1) for s in in_flight])
            eps = np.concatenate([np.full(s[2] + 1, s[0]) for s in in_flight])
            steps = np.concatenate([np.arange(s[1], s[1] + s[2] + 1) for s in in_flight])
            want = pattern(eps, steps, OBS_SHAPE).numpy().reshape(len(slots), -1)
            written = int((obs[slots] == want).all(axis=1).sum())
            mid_copy += 0 < written < len(slots)

        table = Table.open(path)
        stored = stored_segments(table)
        present = set(stored)
        must = ring.segments - may_lose
        assert must <= present, f"round {r}: lost acknowledged segments {sorted(must - present)}"
        assert present <= ring.segments | in_flight, (
            f"round {r}: segments that were never written {sorted(present - ring.segments - in_flight)}"
        )
        check_intact(table, present)
        assert table.size == sum(s[2] for s in present)
        newest = max(present, key=stored.get)
        assert table.storage.cursor == newest[3] + newest[2] + 1
        assert table.info()["next_generation"] > max(stored.values())
        # Inserted steps were counted as they were published (the counter file is a memmap).
        acked_steps = sum(s[2] for b in acked_blocks for s in b)
        grown = table.info()["inserts"] - inserts
        assert acked_steps <= grown <= acked_steps + sum(s[2] for s in in_flight)
        check_samples(table)

        # The table works on: one more segment, at the place the ring model expects.
        ring = Ring(capacity, present, table.storage.cursor)
        block = [[r, 5000, int(rng.integers(1, MAX_LEN + 1))]]
        seg = make_segment(*block[0], False)
        table.insert(seg.steps, seg.tail, seg.episode_id, seg.first_step)
        ring.insert(block)
        assert set(stored_segments(table)) == ring.segments
        check_intact(table, ring.segments - present)
        check_samples(table)
        inserts = table.info()["inserts"]
        table.close()
    print(f"{mid_copy} of {rounds} kills interrupted a copy")


def test_checkpoint_then_sigkill_restores_priorities_queue_and_counters(tmp_path, zygote):
    pid = zygote.start(run="stateful", dir=str(tmp_path), seed=3)
    state = zygote.next()
    zygote.kill(pid)

    # Priorities of the stored steps are restored, and so is the sampling mass.
    prio = Table.open(tmp_path / "prio")
    p = state["priorities"]
    slots = np.array(p["slots"])
    np.testing.assert_array_equal(np.asarray(prio.sampler.priorities)[slots], p["values"])
    assert prio.info()["mass"] == pytest.approx(p["mass"], rel=1e-12)
    assert prio.size == len(slots)
    td = prio.sample(64)
    # P(i) and the weights follow the restored priorities.
    pa = np.asarray(p["values"]) ** 0.6
    by_slot = dict(zip(p["slots"], pa / pa.sum()))
    probs = np.array([by_slot[s] for s in td["index", "slot"].tolist()])
    pmin = pa.min() / pa.sum()
    np.testing.assert_allclose(td["weight"].numpy(), (probs / pmin) ** -0.4, rtol=1e-5)
    prio.close()

    # The queue resumes after the last delivered segment: nothing is delivered twice.
    fifo = Table.open(tmp_path / "fifo")
    assert fifo.size == state["queue_size"]
    assert {k: fifo.info()[k] for k in ("inserts", "samples")} == state["fifo_counters"]
    rest = fifo.sample(fifo.size)
    got = list(zip(rest["episode_id"].tolist(), rest["step"].tolist()))
    delivered = [tuple(x) for x in state["delivered"]]
    assert not set(got) & set(delivered)
    assert len(got) + len(delivered) == fifo.info()["inserts"]
    assert got == sorted(got)  # episode i holds steps 10 i ..., inserted in that order
    fifo.close()

    # Rate-limiter counters are restored.
    limited = Table.open(tmp_path / "limited")
    assert {k: limited.info()[k] for k in ("inserts", "samples", "size")} == state["limited"]
    limited.close()


@pytest.mark.xfail(
    reason="PrioritizedSampler.max_priority is not persisted: after a restart it is rebuilt as "
    "max(1, largest stored priority), so new steps get less than before the restart",
    strict=True,
)
def test_new_steps_after_restart_get_the_max_priority_seen_before(tmp_path, zygote):
    """New steps get the largest priority ever set, also after the shard restarted."""
    pid = zygote.start(run="stateful", dir=str(tmp_path), seed=3)
    state = zygote.next()
    zygote.kill(pid)
    prio = Table.open(tmp_path / "prio")
    seg = make_segment(99, 0, 3, False)
    gen = prio.insert(seg.steps, seg.tail, 99, 0)
    (start,) = [k[3] for k, g in stored_segments(prio).items() if g == gen[0]]
    new = np.arange(start, start + 3)
    np.testing.assert_array_equal(
        np.asarray(prio.sampler.priorities)[new], state["priorities"]["max_priority"]
    )
    prio.close()
