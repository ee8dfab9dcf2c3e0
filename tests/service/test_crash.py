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

import contextlib
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

from millpond.config import TableConfig
from millpond.service.storage import SegmentStorage
from millpond.service.table import Table
from millpond.testing import pattern, pattern_segment, stored_segments, stored_steps

OBS_SHAPE = (4, 84, 84)
MAX_LEN = 50


# --- code that runs in the child (shipped as source, see _zygote_source) ---------------------
def make_segment(ep, first, length, terminated):
    return pattern_segment(ep, first, length, OBS_SHAPE, terminated)


def insert_loop(cmd, emit):
    """Insert blocks of 1-3 segments forever; announce each block, then acknowledge it.

    With ``cmd["writer"]``, segments carry sequence numbers from ``cmd["first_sequence"]``
    on, and inserts name the writer (idempotent re-sends).
    """
    rng = np.random.default_rng(cmd["seed"])
    table = Table.open(cmd["dir"])
    ep = cmd["first_episode"]
    writer, sequence = cmd.get("writer"), cmd.get("first_sequence", 1)

    def block():
        nonlocal ep, sequence
        segs = []
        for _ in range(1 if rng.random() < 0.6 else int(rng.integers(2, 4))):
            length = int(rng.integers(1, cmd["max_len"] + 1))
            first = int(rng.integers(0, 1000))
            segs.append(make_segment(ep, first, length, bool(rng.random() < 0.3)))
            if writer:
                segs[-1].sequence = sequence
                sequence += 1
            ep += 1
        return segs

    if cmd.get("kill_at"):
        # SIGKILL ourselves before line event ``index`` (negative: from the end) of one call
        # of ``function``, in insert number ``after + 1``: a kill at a chosen stage of
        # allocation, copy or publication, e.g. between two metadata writes.
        function, index, after = cmd["kill_at"]
        owner = Table if function == "_insert_block" else SegmentStorage
        code = getattr(owner, function).__code__
        calls, lines, first_call_lines = 0, 0, 0

        def line(frame, event, arg):
            nonlocal lines, first_call_lines
            if event == "line":
                if calls == 1:
                    first_call_lines += 1
                elif calls > after and lines == index % first_call_lines:
                    os.kill(os.getpid(), signal.SIGKILL)
                lines += 1
            return line

        def call(frame, event, arg):
            nonlocal calls, lines
            if frame.f_code is code:
                calls, lines = calls + 1, 0
                return line
            return None

        sys.settrace(call)

    segs = block()
    emit({"begin": [[s.episode_id, s.first_step, s.steps.batch_size[0]] for s in segs]})
    while True:
        if writer:
            table.insert_many(segs, writer_id=writer)
        elif len(segs) == 1:
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
        from millpond.config import TableConfig
        from millpond.segments import Segment
        from millpond.service.storage import SegmentStorage
        from millpond.service.table import Table
        from millpond.testing import pattern, pattern_segment, stored_segments
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
        self.worker: int | None = None
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
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
        """Fork a worker that runs ``cmd["run"](cmd, emit)``; returns its pid."""
        if self.worker is not None:  # left running by a failed test
            self.kill(self.worker)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self.worker = self.next()["hello"]
        return self.worker

    def kill(self, pid: int) -> list[dict]:
        """SIGKILL the worker and wait until it is reaped; returns the messages seen meanwhile."""
        os.kill(pid, signal.SIGKILL)
        seen = []
        while True:
            msg = self.next()
            if msg.get("reaped") == pid:
                self.worker = None
                assert os.WIFSIGNALED(msg["status"]) and os.WTERMSIG(msg["status"]) == 9, msg
                return seen
            seen.append(msg)

    def reaped(self, pid: int, msg: dict) -> bool:
        """Whether ``msg`` says that worker ``pid`` ended (it may kill itself)."""
        if msg.get("reaped") != pid:
            return False
        self.worker = None
        return True

    def close(self) -> None:
        assert self.proc.stdin is not None
        if self.worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


# --- a model of the ring ----------------------------------------------------------------------
# A segment is (episode, first step, length, start slot).
Seg = tuple[int, int, int, int]


class Ring:
    """Where blocks go and which segments they evict: oldest-first from the cursor; a block
    that does not fit before the ring's end lays the segments that fit whole there, the
    rest from slot 0."""

    def __init__(self, capacity: int, segments: set[Seg], cursor: int) -> None:
        self.capacity = capacity
        self.segments = set(segments)
        self.cursor = cursor

    def _laid(self, block: list[list[int]]) -> list[Seg]:
        """``block``'s segments where they go, in its order."""
        laid, pos, wrapped = [], self.cursor, False
        for ep, first, length in block:
            if pos + length + 1 > self.capacity:
                assert not wrapped, "a block longer than the ring"
                pos, wrapped = 0, True
            laid.append((ep, first, length, pos))
            pos += length + 1
        if wrapped and pos > self.cursor:  # pieces would overlap
            laid, pos = [], 0
            for ep, first, length in block:
                laid.append((ep, first, length, pos))
                pos += length + 1
        return laid

    def place(self, block: list[list[int]]) -> tuple[set[Seg], set[Seg]]:
        """The segments ``block`` ([episode, first, length] each) would write, and evict."""
        laid = self._laid(block)
        new = set(laid)
        # Wrapped: the slots left before the ring's end are cleared with the block.
        end = self.capacity
        if laid[-1][3] < self.cursor:
            ahead = [n for n in laid if n[3] >= self.cursor]
            end = max((n[3] + n[2] + 1 for n in ahead), default=self.cursor)
        victims = {
            s
            for s in self.segments
            if s[3] + s[2] + 1 > end
            or any(s[3] < n[3] + n[2] + 1 and n[3] < s[3] + s[2] + 1 for n in new)
        }
        return new, victims

    def cursor_after(self, block: list[list[int]]) -> int:
        last = self._laid(block)[-1]
        return last[3] + last[2] + 1

    def insert(self, block: list[list[int]]) -> None:
        new, victims = self.place(block)
        self.segments = (self.segments - victims) | new
        self.cursor = self.cursor_after(block)


def check_intact(table: Table, segments) -> None:
    """Every slot of every segment holds exactly its (episode, step) row."""
    segments = sorted(segments)
    if not segments:
        return
    slots = np.concatenate([np.arange(s[3], s[3] + s[2] + 1) for s in segments])
    eps = np.concatenate([np.full(s[2] + 1, s[0]) for s in segments])
    steps = np.concatenate([np.arange(s[1], s[1] + s[2] + 1) for s in segments])
    obs = table.storage.columns[("observation",)].numpy()[slots]  # numpy: a fast gather
    want = pattern(eps, steps, OBS_SHAPE).numpy()
    bad = (obs != want).reshape(len(slots), -1).any(axis=1)
    assert not bad.any(), f"torn rows of episodes {sorted(set(eps[bad].tolist()))}"
    is_step = np.concatenate([np.arange(s[2] + 1) < s[2] for s in segments])
    action = table.storage.columns[("action",)].numpy()[slots[is_step]]
    want = np.stack([eps[is_step], steps[is_step]], 1)
    bad = (action != want).any(axis=1)
    assert not bad.any(), f"torn actions of episodes {sorted(set(eps[is_step][bad].tolist()))}"


def check_samples(table: Table, n: int = 256) -> None:
    """Sampled rows are stored steps (no evicted or torn slot is sampleable) and intact."""
    td = table.sample(min(n, table.config.capacity), timeout=5)  # at most its capacity
    assert set(zip(td["episode_id"].tolist(), td["step"].tolist())) <= stored_steps(table)
    assert torch.equal(td["observation"], pattern(td["episode_id"], td["step"], OBS_SHAPE))
    nxt = pattern(td["episode_id"], td["step"] + 1, OBS_SHAPE)
    assert torch.equal(td["next", "observation"], nxt)


class Acks:
    """What a writer acknowledged, and the block it announced but had not acknowledged."""

    def __init__(self) -> None:
        self.blocks: list[list[list[int]]] = []
        self.pending: list[list[int]] | None = None

    def follow(self, msg: dict) -> None:
        if "begin" in msg:
            self.pending = msg["begin"]
        else:
            assert self.pending is not None and msg["ack"] == [s[0] for s in self.pending]
            self.blocks.append(self.pending)
            self.pending = None


# Where the "crash-points" rounds kill the writer: (function, line event, inserts before).
# The last line events of publish() fall between the metadata writes and the commit markers.
KILL_POINTS = [("publish", -i, 2) for i in range(1, 7)] + [
    ("write", 1, 1),
    ("write", 3, 2),
    ("_insert_block", 5, 1),
    ("_insert_block", 12, 3),
    ("_insert_block", -3, 2),
]


@pytest.mark.parametrize(
    "capacity, rounds, kill_points",
    [(16384, 5, None), (400, 5, None), (200, len(KILL_POINTS), KILL_POINTS)],
    ids=["large", "small-wrapping", "small-crash-points"],
)
def test_sigkill_during_inserts_loses_no_acknowledged_segment(
    tmp_path, zygote, capacity, rounds, kill_points
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
            max_len=MAX_LEN if kill_points is None else 12,
            kill_at=None if kill_points is None else kill_points[r],
        )
        acks = Acks()
        if kill_points:
            # The child kills itself at the chosen point.
            while not zygote.reaped(pid, msg := zygote.next()):
                acks.follow(msg)
            assert os.WIFSIGNALED(msg["status"]) and os.WTERMSIG(msg["status"]) == 9, msg
            assert len(acks.blocks) == kill_points[r][2] and acks.pending is not None
        else:
            kill_after = int(rng.integers(1, 25))
            while len(acks.blocks) < kill_after:
                acks.follow(zygote.next())
            time.sleep(float(rng.uniform(0, 0.003)))
            for msg in zygote.kill(pid):
                acks.follow(msg)

        # What the ring must hold: everything acknowledged that no acknowledged block evicted,
        # less what the interrupted block (if any) may have claimed, plus what it may have
        # published.
        for block in acks.blocks:
            ring.insert(block)
        in_flight, may_lose = ring.place(acks.pending) if acks.pending else (set(), set())
        if acks.pending:
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
        # The ring goes on after the newest block: the newest segment's, or the interrupted
        # block's if the kill came after it was placed (the cursor is kept when a block is).
        newest = max(present, key=stored.get)
        ends = {newest[3] + newest[2] + 1}
        if in_flight:
            ends.add(ring.cursor_after(acks.pending))
        assert table.storage.cursor in ends, (table.storage.cursor, ends)
        assert table.info()["next_generation"] > max(stored.values())
        # Inserted steps were counted as they were published (the counter file is a memmap).
        acked_steps = sum(s[2] for b in acks.blocks for s in b)
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


def test_resending_after_sigkill_stores_nothing_twice(tmp_path, zygote):
    """A writer that lost its acknowledgements re-sends: nothing is stored twice or lost."""
    rng = np.random.default_rng(11)
    path = tmp_path / "table"
    Table.create(path, TableConfig.uniform("t", 8192, seed=0)).close()
    for r in range(3):
        first_sequence = 1000 * r + 1
        pid = zygote.start(
            run="insert_loop",
            dir=str(path),
            seed=int(rng.integers(2**31)),
            first_episode=(r + 1) * 100_000,
            max_len=MAX_LEN,
            writer="actor-0",
            first_sequence=first_sequence,
        )
        acks, kill_after = Acks(), int(rng.integers(1, 15))
        while len(acks.blocks) < kill_after:
            acks.follow(zygote.next())
        time.sleep(float(rng.uniform(0, 0.003)))
        for msg in zygote.kill(pid):
            acks.follow(msg)
        sent = [*acks.blocks, *([acks.pending] if acks.pending else [])]

        table = Table.open(path)
        before = stored_segments(table)
        # Re-send every block of this round, acknowledged or not, with the same sequences.
        sequence = first_sequence
        for block in sent:
            segs = []
            for ep, first, length in block:
                segs.append(make_segment(ep, first, length, False))
                segs[-1].sequence = sequence
                sequence += 1
            gens = table.insert_many(segs, writer_id="actor-0")
            for (ep, first, length), gen in zip(block, gens.tolist()):
                already = any(k[:3] == (ep, first, length) for k in before)
                assert (gen == 0) == already, (ep, first, length, gen, already)
        stored = stored_segments(table)
        keys = [k[:3] for k in stored]
        assert len(keys) == len(set(keys)), "a re-sent segment was stored twice"
        assert {tuple(s) for b in sent for s in b} <= set(keys)
        check_intact(table, stored)
        assert table.writer_sequence("actor-0") == sequence - 1
        table.close()


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
    td = prio.sample(64, timeout=5)
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
    rest = fifo.sample(fifo.size, timeout=5)
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
