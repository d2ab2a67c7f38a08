"""The CPU cost of one datagram to the cheapest Python UDP reader, and to a Python sender.

    taskset -c 0 python bench/dns/reader_floor.py [--count 200000]

What a flood costs a single Python process at the least, measured by the thread's CPU time (not
wall time, so a busy machine slows it less than it slows the wall clock): ``send``, a
``sendto`` of a 60-byte datagram on loopback (the flooder's cost: on loopback the sender's
system call also delivers the datagram); ``read_drop``, a ``recvfrom`` and the two dictionary
look-ups the listener makes before it drops a datagram over its network's share
(gtm.geodns.server.TURN_SHARE); ``read_answer``, the same and a ``sendto`` back (the least a
cached answer costs). A flood faster than ``1 / read_drop`` per second of the server's core
overflows the kernel's receive buffer whatever the server does with what it reads, and every
sender loses the same share there (bench/dns/fairness.py, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import socket
import time

QUERY = bytes(60)
CHUNK = 5_000  # datagrams sent before each read-back: well inside a 1 GiB-asked buffer


def _socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
    sock.bind((host, 0))
    sock.setblocking(False)
    return sock


def _drain(sock: socket.socket) -> None:
    while True:
        try:
            sock.recv(65535)
        except BlockingIOError:
            return


def send_us(tx: socket.socket, rx: socket.socket, count: int) -> float:
    target = rx.getsockname()
    start = time.thread_time()
    for _ in range(count):
        tx.sendto(QUERY, target)
    cost = (time.thread_time() - start) / count * 1e6
    _drain(rx)
    return cost


def read_us(tx: socket.socket, rx: socket.socket, count: int, answer: bool) -> float:
    target = rx.getsockname()
    networks: dict[str, str] = {}
    taken: dict[str, int] = {}
    read, cpu = 0, 0.0
    while read < count:
        for _ in range(CHUNK):
            tx.sendto(QUERY, target)
        start = time.thread_time()
        while True:
            try:
                data, addr = rx.recvfrom(65535)
            except BlockingIOError:
                break
            read += 1
            network = networks.get(addr[0])
            if network is None:
                network = networks[addr[0]] = addr[0][: addr[0].rfind(".")]
            taken[network] = taken.get(network, 0) + 1
            if answer:
                rx.sendto(data, addr)
        cpu += time.thread_time() - start
        _drain(tx)
    return cpu / read * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200_000)
    args = parser.parse_args()
    rx, tx = _socket("127.0.0.1"), _socket("127.0.1.1")
    figures = {
        "send_us": send_us(tx, rx, args.count // 10),
        "read_drop_us": read_us(tx, rx, args.count, answer=False),
        "read_answer_us": read_us(tx, rx, args.count, answer=True),
    }
    print({name: round(value, 2) for name, value in figures.items()})
    drop = figures["read_drop_us"]
    print(f"a reader that only drops keeps up with {1e6 / drop:,.0f} datagrams/s of a core")


if __name__ == "__main__":
    main()
