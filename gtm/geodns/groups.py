"""The UDP sockets of a listen address, and the groups worker processes share (DESIGN.md
rule 9).

A split group (:class:`gtm.geodns.steering.SplitGroup`) names sockets by their place in the
port's reuseport group, which is the order they were bound in. Worker processes that each bind
their own sockets (``GTM_WORKERS``) join the group in whatever order they start, so none could
know which socket the map's index names. So with workers and established networks, the first
process binds every worker's sockets, worker after worker, loads the map and the program for
that layout (:func:`gtm.geodns.steering.split_program` with ``workers``), and hands each worker
its sockets and the map's descriptor (:func:`handoff`, :func:`received`). The program hashes
each sender network to one worker's general sockets, so that worker alone establishes it, on
one of its own protected sockets; its siblings never see it.

Each worker's TCP listener is bound here too, one a worker in the same order, and a classic
program steers each network's connections to the worker that reads its datagrams
(:func:`gtm.geodns.steering.worker_index`): a query over TCP proves its network
(``GTM_DNS_ESTABLISH_WITH_COOKIE``) to the one worker that may establish it. Left to the
kernel's hash of addresses and ports, a connection would reach that worker one time in
``GTM_WORKERS``.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import structlog

from gtm.geodns import bpf, steering
from gtm.geodns.steering import SplitGroup
from gtm.listen import parse_listen

log = structlog.get_logger(__name__)

UDP_RECEIVE_BUFFER = 2 << 20  # bytes asked for; Linux doubles it for its bookkeeping


def bind_udp(host: str, port: int, family: socket.AddressFamily, reuse_port: bool) -> socket.socket:
    """A non-blocking UDP socket bound to ``host``:``port``, its receive buffer widened."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    widen_receive_buffer(sock)
    return sock


def widen_receive_buffer(sock: Any) -> None:
    """Ask for a UDP receive buffer of :data:`UDP_RECEIVE_BUFFER` (the kernel caps it at
    net.core.rmem_max). The default (about 200 KB, some 200 queries as the kernel accounts
    them) overflows, and drops queries, whenever the loop pauses a few milliseconds under load;
    authoritative servers raise it for the same reason (NSD, Unbound: so-rcvbuf)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < UDP_RECEIVE_BUFFER:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RECEIVE_BUFFER)


TCP_BACKLOG = 1024  # connections waiting to be accepted, per listener


def bind_tcp(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
    """A non-blocking TCP listener on ``host``:``port`` in the port's reuseport group."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(TCP_BACKLOG)  # a TCP listener joins the group as it listens: in order
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class WorkerGroup:
    """One worker's share of a listen address's split group: its sockets (protected first),
    the group's map as that worker sees it, and its TCP listener (None where the kernel
    refused the program that steers connections: it then binds its own)."""

    socks: list[socket.socket]
    split: SplitGroup
    tcp: socket.socket | None = None


def bind_worker_groups(
    listens: tuple[str, ...], workers: int, per_worker: int, capacity: int
) -> list[dict[str, WorkerGroup]] | None:
    """Every listen address's split group for ``workers`` processes of ``per_worker`` sockets
    each, bound here in order, with room for ``capacity`` established networks; by worker,
    then by listen address. None, with nothing left bound, when the kernel refuses the
    program (logged: the workers then bind their own sockets, hashed) or an address has port
    0 (each worker would get a port of its own)."""
    protected = per_worker // 2
    general = per_worker - protected
    shares: list[dict[str, WorkerGroup]] = [{} for _ in range(workers)]
    opened: list[socket.socket] = []
    splits: list[SplitGroup] = []
    try:
        for listen in listens:
            host, port = parse_listen(listen)
            if port == 0:
                raise _NotShared("port 0: each worker would bind a port of its own")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            socks = [bind_udp(host, port, family, True) for _ in range(workers * per_worker)]
            opened += socks
            try:
                split = SplitGroup.open(socks[0], protected, general, capacity, workers)
            except OSError as exc:
                raise _NotShared(
                    str(exc).split("\n")[0] + " (the eBPF program needs CAP_BPF)"
                ) from None
            splits.append(split)
            listeners = _tcp_listeners(host, port, family, workers, general)
            opened += listeners
            for w in range(workers):
                mine = socks[w * per_worker : (w + 1) * per_worker]
                shares[w][listen] = WorkerGroup(
                    mine,
                    split if w == 0 else split.joined(w),
                    listeners[w] if listeners else None,
                )
    except BaseException as exc:
        for sock in opened:
            sock.close()
        for split in splits:
            split.close()
        if not isinstance(exc, _NotShared):
            raise
        log.warning(
            "dns.established_refused",
            workers=workers,
            error=str(exc),
            detail="each worker binds its own sockets, hashed: every sender network shares "
            "them, a flood from many networks with them",
        )
        return None
    return shares


def _tcp_listeners(
    host: str, port: int, family: socket.AddressFamily, workers: int, general: int
) -> list[socket.socket]:
    """One TCP listener a worker, in worker order, each network's connections steered to the
    worker whose general sockets its datagrams reach; none (logged) where the kernel refuses
    the program, and each worker binds its own."""
    listeners: list[socket.socket] = []
    try:
        for _ in range(workers):
            listeners.append(bind_tcp(host, port, family))
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    if steering.attach(listeners[0], general * workers, general):
        return listeners
    for sock in listeners:
        sock.close()
    log.warning(
        "dns.tcp_steering_refused",
        host=host,
        port=port,
        detail="the kernel spreads connections over the workers by addresses and ports: a "
        "query over TCP proves its network to the worker that reads its datagrams one time "
        "in the number of workers",
    )
    return []


class _NotShared(Exception):
    """Internal: the groups cannot be bound for the workers here."""


class _Descriptor:
    """A descriptor to pass to a spawned process: duplicated into it as the process's
    arguments are pickled (multiprocessing passes it), an int again on the other side."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _descriptor, (DupFd(self.fd),)


def _descriptor(duplicated: Any) -> int:
    return int(duplicated.detach())


# What a worker's process is handed: by listen address, its sockets (passed as descriptors
# when the process is spawned, as the map's is), the group's map and layout, its TCP listener.
Handoff = dict[str, tuple[list[socket.socket], Any, int, int, int, int, socket.socket | None]]


def handoff(share: dict[str, WorkerGroup]) -> Handoff:
    """A worker's share, ready to be pickled into the process that will run it (while it is
    spawned: multiprocessing passes the descriptors)."""
    return {
        listen: (
            group.socks,
            _Descriptor(group.split.table.fd),
            group.split.protected,
            group.split.general,
            group.split.base,
            group.split.workers,
            group.tcp,
        )
        for listen, group in share.items()
    }


def received(handed: Handoff) -> dict[str, WorkerGroup]:
    """The share a worker's process was handed (:func:`handoff`)."""
    out: dict[str, WorkerGroup] = {}
    for listen, (socks, map_fd, protected, general, base, workers, tcp) in handed.items():
        for sock in (*socks, *([tcp] if tcp is not None else [])):
            sock.setblocking(False)
        table = bpf.HashMap(map_fd, 8, 4)
        split = SplitGroup(table, -1, protected, general, base=base, workers=workers)
        out[listen] = WorkerGroup(list(socks), split, tcp)
    return out


def close_share(share: dict[str, WorkerGroup]) -> None:
    """This process's copies of a share it handed to another (after that one started)."""
    for group in share.values():
        for sock in group.socks:
            sock.close()
        if group.tcp is not None:
            group.tcp.close()
