"""zstd and lz4 on real Atari frames: per key, on the wire and on disk.

Collects real stacked frames (``uint8[4, 84, 84]``) from ALE games with the standard
preprocessing (``frameskip=1`` + ``AtariPreprocessing`` + ``FrameStackObservation(4)``, as
``deploy/configs/atari-*.yaml``), a random policy, ``P`` lanes and chunks of ``T`` steps, and
measures, single-threaded:

- **wire**: what ``protos/codec.py`` does per tensor of an insert, one tensor per key per
  lane-chunk (a lane's ``T`` steps; the observation column with its tail, ``T + 1`` frame
  stacks: with ``T = 32`` about the ~1 MiB a writer's request carries): compressed / raw bytes and MB/s (of raw bytes) to compress and to decompress;
- **disk**: what a table's column files would hold if each slot's frame stack were
  compressed on its own (a slot is the unit the storage reads and overwrites): the same
  figures per slot; and per slot its newest frame only (what a table storing each frame
  once, not four times, would compress).

Codecs: zstd levels 1 (what the codec uses for ``compression: zstd``) and 3, lz4 frame
(``lz4`` package, default level). Needs ``pip install 'millpond[atari]' lz4``.

    python benchmarks/atari_compression.py --out atari-compression.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable

import torch
from _common import collect_atari

GAMES = ("ALE/Pong-v5", "ALE/Breakout-v5")


def codecs() -> dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]]:
    import lz4.frame
    import zstandard

    out = {}
    for level in (1, 3):
        c = zstandard.ZstdCompressor(level=level)
        d = zstandard.ZstdDecompressor()
        out[f"zstd-{level}"] = (c.compress, d.decompress)
    out["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
    return out


def wire_tensors(batches) -> dict[str, list[bytes]]:
    """Raw bytes per key, one per lane-chunk (the observation column with its tail)."""
    out: dict[str, list[bytes]] = {}
    for batch in batches:
        for p in range(batch.shape[0]):
            lane = batch[p]
            obs = torch.cat([lane["observation"], lane["next", "observation"][-1:]])
            out.setdefault("observation", []).append(obs.numpy().tobytes())
            for key in [
                "action",
                ("next", "reward"),
                ("next", "terminated"),
                ("next", "truncated"),
                ("collector", "step_count"),
            ]:
                name = key if isinstance(key, str) else ".".join(key)
                out.setdefault(name, []).append(lane[key].contiguous().numpy().tobytes())
    return out


def slot_frames(batches, newest_only: bool = False) -> list[bytes]:
    """One piece per slot: its frame stack, or only its newest frame (a stack stored once)."""
    out = []
    for batch in batches:
        for stack in batch["observation"].reshape(-1, *batch["observation"].shape[2:]):
            out.append((stack[-1] if newest_only else stack).numpy().tobytes())
    return out


def frame_stats(batches) -> str:
    """How much the frames move: distinct newest frames, pixels changed step to step."""
    newest = torch.cat([b["observation"][:, :, -1] for b in batches], 1)  # [P, N, H, W]
    changed = (newest[:, 1:] != newest[:, :-1]).float().mean().item()
    distinct = len({f.numpy().tobytes() for f in newest.reshape(-1, *newest.shape[2:])})
    return (
        f"{distinct} distinct newest frames of {newest.shape[0] * newest.shape[1]}, "
        f"{changed:.1%} of pixels change from one step to the next"
    )


def measure(pieces: list[bytes], compress, decompress, min_s: float) -> dict[str, float]:
    raw = sum(len(p) for p in pieces)
    packed = [compress(p) for p in pieces]
    size = sum(len(p) for p in packed)
    reps, t0 = 0, time.perf_counter()
    while True:
        for p in pieces:
            compress(p)
        reps += 1
        c_s = time.perf_counter() - t0
        if c_s >= min_s:
            break
    c_mbs = raw * reps / c_s / 1e6
    reps, t0 = 0, time.perf_counter()
    while True:
        for p in packed:
            decompress(p)
        reps += 1
        d_s = time.perf_counter() - t0
        if d_s >= min_s:
            break
    d_mbs = raw * reps / d_s / 1e6
    for p, q in zip(pieces[:4], packed[:4]):
        assert decompress(q) == p
    return {"raw": raw, "size": size, "ratio": size / raw, "c_mbs": c_mbs, "d_mbs": d_mbs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", default=",".join(GAMES))
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--chunk-len", type=int, default=32, help="as the atari configs")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=0.3, help="timing per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import ale_py
    import lz4
    import zstandard

    lines = [
        f"Python {platform.python_version()}, zstandard {zstandard.__version__}, "
        f"lz4 {lz4.__version__}, ale-py {ale_py.__version__}; {args.lanes} lanes x "
        f"{args.chunks} chunks x {args.chunk_len} steps per game, random policy.",
        "",
        "| game | where | key | codec | raw bytes | compressed / raw | compress MB/s | "
        "decompress MB/s |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    codec_list = codecs()
    stats: list[str] = []
    for game in args.games.split(","):
        print(f"collecting {game} ...", file=sys.stderr)
        batches = collect_atari(game, args.lanes, args.chunk_len, args.chunks, args.seed)
        groups = {("wire", k): v for k, v in wire_tensors(batches).items()}
        groups["disk", "observation (per slot)"] = slot_frames(batches)
        groups["disk", "newest frame only (per slot)"] = slot_frames(batches, newest_only=True)
        stats.append(f"{game}: {frame_stats(batches)}.")
        print(stats[-1], file=sys.stderr)
        for (where, key), pieces in groups.items():
            for name, (compress, decompress) in codec_list.items():
                m = measure(pieces, compress, decompress, args.seconds)
                lines.append(
                    f"| {game} | {where} | {key} | {name} | {m['raw']:,} | {m['ratio']:.4f} | "
                    f"{m['c_mbs']:,.0f} | {m['d_mbs']:,.0f} |"
                )
                print(lines[-1], file=sys.stderr)
    text = "\n".join([*lines, "", *stats]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
