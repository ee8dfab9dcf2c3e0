"""A delay shaper for test hosts: holds each packet an NFQUEUE hands it, then accepts it.

Run inside a network namespace whose iptables send packets to NFQUEUE queues (one per
direction). Each packet is released ``delay`` ms (plus a uniform jitter of ``± jitter`` ms)
after it arrived, never before a packet that arrived earlier in the same queue: a path with
a varying delay, but no reordering (which only makes TCP retransmit what is not lost).
The kernel lacks ``sch_netem`` here, so this takes its place. Standard library only: it
speaks the nfnetlink queue protocol itself.

    python _shaper.py --queues 0,1 --delay-ms 50 --jitter-ms 10
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SO_RCVBUFFORCE = 33


def _attr(kind: int, payload: bytes) -> bytes:
    body = struct.pack("=HH", 4 + len(payload), kind) + payload
    return body + b"\0" * (-len(body) % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), kind, flags, 0, 0) + body


def _configure(sock: socket.socket, queue: int) -> None:
    for attrs in (
        _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)),
        _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
        _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)),
    ):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
        reply = sock.recv(65536)
        _, kind = struct.unpack_from("=IH", reply)
        if kind == NLMSG_ERROR and struct.unpack_from("=i", reply, 16)[0] != 0:
            err = -struct.unpack_from("=i", reply, 16)[0]
            raise OSError(err, f"nfqueue {queue}: configuration refused: {os.strerror(err)}")


def _packets(data: bytes):
    """``(queue, packet id)`` of every packet message in one netlink read."""
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            (queue,) = struct.unpack_from("!H", data, offset + 18)
            pos = offset + 20
            while pos + 4 <= offset + length:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if atype & 0x7FFF == NFQA_PACKET_HDR:
                    (packet_id,) = struct.unpack_from("!I", data, pos + 4)
                    yield queue, packet_id
                    break
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3


def run(queues: list[int], delay_s: float, jitter_s: float, seed: int) -> None:
    rng = random.Random(seed)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    sock.bind((0, 0))
    for queue in queues:
        _configure(sock, queue)
    sock.setblocking(False)
    print("SHAPING", flush=True)
    held: list[tuple[float, int, int, int]] = []  # (release time, order, queue, packet id)
    last = dict.fromkeys(queues, 0.0)
    order = 0
    while True:
        now = time.monotonic()
        wait = max(0.0, held[0][0] - now) if held else 1.0
        ready, _, _ = select.select([sock], [], [], wait)
        now = time.monotonic()
        if ready:
            while True:
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: the kernel dropped some, as a full queue does
                    continue
                for queue, packet_id in _packets(data):
                    release = now + max(0.0, delay_s + rng.uniform(-jitter_s, jitter_s))
                    release = max(release, last[queue])  # no reordering within a direction
                    last[queue] = release
                    order += 1
                    heapq.heappush(held, (release, order, queue, packet_id))
        verdicts = []
        while held and held[0][0] <= now:
            _, _, queue, packet_id = heapq.heappop(held)
            header = struct.pack("!II", NF_ACCEPT, packet_id)
            verdicts.append(_message(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, header)))
        for i in range(0, len(verdicts), 256):
            sock.send(b"".join(verdicts[i : i + 256]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queues", required=True, help="comma-separated NFQUEUE numbers")
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    queues = [int(q) for q in args.queues.split(",")]
    run(queues, args.delay_ms / 1000, args.jitter_ms / 1000, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
