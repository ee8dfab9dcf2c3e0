"""A writer across a link with latency: steps per second acknowledged, by window.

Builds the network tests' two hosts (network namespaces; root only, see
``tests/integration/network/conftest.py``), serves a shard on one and runs a writer on the
other, which writes chunks of 16 segments of 16 CartPole-sized steps as fast as it can. For
each round trip (no delay, then ``--delay-ms`` each way, so twice that) and each writer
window, it reports the steps per second the shard acknowledged:

    sudo python benchmarks/network_faults.py --delay-ms 50 --seconds 8

Windows: the old default (``max_in_flight=64``), the current default (``Writer``'s), and
any ``--also N`` (``max_in_flight=N`` without a byte bound).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hosts_module():
    path = ROOT / "tests" / "integration" / "network" / "conftest.py"
    spec = importlib.util.spec_from_file_location("millpond_net_hosts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(hosts, work: Path, name: str, seconds: float, window: dict) -> float:
    out = work / f"{name}.json"
    proc = hosts.client(
        "throughput", table=name, out=str(out), L=16, obs=[4], seconds=seconds, **window
    )
    proc.wait(seconds + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the writer failed; see {work}")
    return json.loads(out.read_text())["steps_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, default=50.0, help="delay each way")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run")
    p.add_argument(
        "--also", type=int, nargs="*", default=[], help="more max_in_flight values to try"
    )
    args = p.parse_args()
    net = _hosts_module()
    reason = net.why_not()
    if reason is not None:
        raise SystemExit(f"cannot build test hosts: {reason}")
    windows = {"max_in_flight=64 (old default)": {"max_in_flight": 64}, "default": {}}
    for n in args.also:
        windows[f"max_in_flight={n}, no byte bound"] = {
            "max_in_flight": n,
            "max_in_flight_bytes": None,
        }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hosts = net.NetHosts(work)
        try:
            hosts.serve()
            rows = {}
            for delay in (0.0, args.delay_ms):
                if delay:
                    hosts.delay(delay)
                for i, (label, window) in enumerate(windows.items()):
                    name = f"w{int(delay)}-{i}"
                    rows[(delay, label)] = measure(hosts, work, name, args.seconds, window)
        finally:
            hosts.close()
    print(f"| window | no delay, steps/s | {2 * args.delay_ms:.0f} ms round trip | ratio |")
    print("|---|---|---|---|")
    for label in windows:
        fast, slow = rows[(0.0, label)], rows[(args.delay_ms, label)]
        print(f"| {label} | {fast:,.0f} | {slow:,.0f} | {slow / fast:.0%} |")


if __name__ == "__main__":
    main()
