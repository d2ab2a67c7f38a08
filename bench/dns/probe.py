"""A latency probe that the load generator's own delays cannot reach.

    python bench/dns/probe.py PORT QUERIES.bin --rate 2000 --seconds 4

dnsperf times each reply when its receiving thread gets to it. On a machine where dnsperf needs
most of a core to generate the load, that thread waits behind the sending one, and its tail is
the client's: gdnsd, whose own answer takes a few microseconds, shows a p99 of one to two and a
half milliseconds through dnsperf here at 80k queries/s.

This probe sends its own queries (``rate`` a second, one outstanding at a time) into the same
server socket while dnsperf keeps the load on, so they queue behind the load's queries exactly as
those do, and times each reply by the kernel: the reply's arrival time is the timestamp the
kernel put on it when the server's ``sendto`` delivered it over loopback (``SO_TIMESTAMPNS``),
not when this process next ran. The send time is read just before ``send``. What is left is the
server's queueing and answering plus the loopback path; a delay of the probe itself between
reading the clock and sending can only add to it.

Queries come from a file of length-prefixed wire messages (dnsperf's ``-B`` format), sent in
turn with fresh IDs. Prints one JSON object: samples, lost, and the kernel-timed and user-timed
percentiles in milliseconds (a lost query counts as the reply timeout, one second).
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import time
from pathlib import Path

# Linux, every architecture Python runs this benchmark on: SO_TIMESTAMPNS (asm-generic's
# SO_TIMESTAMPNS_OLD), and the control message carrying it has the same number.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@ll")
REPLY_TIMEOUT_S = 1.0


def read_queries(path: Path) -> list[bytes]:
    data = path.read_bytes()
    queries, at = [], 0
    while at + 2 <= len(data):
        (length,) = struct.unpack_from("!H", data, at)
        queries.append(data[at + 2 : at + 2 + length])
        at += 2 + length
    if not queries:
        raise SystemExit(f"{path}: no queries")
    return queries


def percentile(samples: list[float], q: float) -> float:
    return samples[min(len(samples) - 1, int(len(samples) * q))]


def probe(port: int, queries: list[bytes], rate: float, seconds: float) -> dict[str, object]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    cmsg_space = socket.CMSG_SPACE(_TIMESPEC.size)
    kernel: list[float] = []
    user: list[float] = []
    lost = 0
    interval = 1.0 / rate
    start = time.monotonic()
    due = start
    serial = 0
    while time.monotonic() - start < seconds:
        wire = queries[serial % len(queries)]
        qid = serial & 0xFFFF
        serial += 1
        sent_ns = time.time_ns()
        sock.send(struct.pack("!H", qid) + wire[2:])
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                # Counted at the timeout, as dnsperf counts its own: losses show in the tail.
                lost += 1
                kernel.append(REPLY_TIMEOUT_S * 1e3)
                user.append(REPLY_TIMEOUT_S * 1e3)
                break
            reply, ancillary, _flags, _addr = sock.recvmsg(4096, cmsg_space)
            seen_ns = time.time_ns()
            if len(reply) < 2 or struct.unpack_from("!H", reply)[0] != qid:
                continue  # a late reply to an earlier probe query that was counted lost
            arrived_ns = seen_ns
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = _TIMESPEC.unpack(payload[: _TIMESPEC.size])
                    arrived_ns = sec * 1_000_000_000 + nsec
            kernel.append((arrived_ns - sent_ns) / 1e6)
            user.append((seen_ns - sent_ns) / 1e6)
            break
        due += interval
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            due = time.monotonic()  # fell behind (the core was busy): do not burst to catch up
    sock.close()
    kernel.sort()
    user.sort()
    if not kernel:
        return {"samples": 0, "lost": lost}
    return {
        "samples": len(kernel),
        "lost": lost,
        "kernel_ms": {f"p{q:g}": percentile(kernel, q / 100) for q in (50, 90, 99, 99.9)},
        "user_ms": {f"p{q:g}": percentile(user, q / 100) for q in (50, 90, 99, 99.9)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("queries", type=Path)
    parser.add_argument("--rate", type=float, default=2000)
    parser.add_argument("--seconds", type=float, default=4)
    args = parser.parse_args()
    print(json.dumps(probe(args.port, read_queries(args.queries), args.rate, args.seconds)))


if __name__ == "__main__":
    main()
