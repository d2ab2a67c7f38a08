"""Fair admission of the UDP slow path (gtm.geodns.admission) over real sockets on loopback.

Senders on other 127.x.y.z addresses stand for other networks (/24s). Starvation is made
observable by order, not time: the test runs in the node's own event loop and sends a whole
flood and then the legitimate queries without yielding, so all of them wait in the kernel's
buffer before the server reads the first. Answered in the order read (the old listener, and
``dns_fair_admission=False``), every flood answer is out before the first legitimate one; with
fair admission the legitimate answers arrive while flood queries still wait.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dns.message
import pytest

from gtm.geodns.admission import (
    NETWORK_FULL,
    OVER_SHARE,
    SHUTDOWN,
    TOTAL_FULL,
    SlowLane,
    sender_network,
)
from gtm.geodns.stats import SO_TIMESTAMPNS, DnsCollector
from gtm.geodns.steering import receive_queued
from gtm.geodns.udp import READ_BATCH, SOCKET_BATCH, TURN_SHARE
from gtm.node import Node

from .conftest import StartNode, port_of, udp

DEADLINE_S = 60.0  # generous: a busy 2-core machine; nothing here measures time
CACHED = dns.message.make_query("chat.gtm.example.", "A").to_wire()


def with_id(wire: bytes, qid: int) -> bytes:
    return qid.to_bytes(2, "big") + wire[2:]


def missing_name(i: int) -> bytes:
    """A query no cache holds: a new name each (NXDOMAIN, parsed and answered the slow way)."""
    return dns.message.make_query(f"flood{i}.gtm.example.", "A").to_wire()


@contextmanager
def sender(address: str) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    # Room for every answer a test waits for (the default holds some 200 small datagrams).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.bind((address, 0))
    try:
        yield sock
    finally:
        sock.close()


def waiting(sock: socket.socket) -> int:
    """How many datagrams wait in the socket now (read and discarded)."""
    n = 0
    while True:
        try:
            sock.recv(65535)
        except BlockingIOError:
            return n
        n += 1


async def receive(sock: socket.socket, count: int) -> list[bytes]:
    loop = asyncio.get_running_loop()

    async def take() -> list[bytes]:
        return [await loop.sock_recv(sock, 65535) for _ in range(count)]

    return await asyncio.wait_for(take(), DEADLINE_S)


async def prime(node: Node, source: str) -> None:
    """The legitimate sender's query answered once: from then on a first-level cache hit."""
    assert (await udp(node, dns.message.from_wire(CACHED), source=source)).answer


async def flood_then(
    node: Node, flood: list[bytes], legit: list[bytes], flood_from: str, legit_from: str
) -> tuple[int, int, list[bytes]]:
    """Send ``flood`` then ``legit`` without yielding to the loop; return how many flood
    answers had arrived when the last legitimate one did, how many arrived in all, and the
    legitimate answers."""
    target = ("127.0.0.1", port_of(node))
    with sender(flood_from) as f, sender(legit_from) as g:
        for wire in flood:
            f.sendto(wire, target)
        for wire in legit:
            g.sendto(wire, target)
        answers = await receive(g, len(legit))
        before = waiting(f)
        later = await receive(f, len(flood) - before)
    return before, before + len(later), answers


async def test_cached_answers_are_not_queued_behind_a_flood_of_misses(
    start_node: StartNode,
) -> None:
    # One flood query admitted per loop turn: the flood takes 300 turns to answer.
    node = await start_node(
        dns_listen=("127.0.0.1:0",), dns_slow_batch=1, dns_slow_queue_per_network=1000
    )
    await prime(node, "127.0.2.1")
    flood = [missing_name(i) for i in range(300)]
    legit = [with_id(CACHED, 1000 + i) for i in range(20)]
    before, total, answers = await flood_then(node, flood, legit, "127.0.1.1", "127.0.2.1")
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(1000, 1020))
    assert total == len(flood)  # the queue held the whole flood: every query answered
    # In the order read, all 300 flood answers would be out before the first legitimate one.
    assert before < len(flood)
    assert node.dns is not None
    lane = node.dns.responder.stats.lane
    assert lane.deferred >= len(flood) and lane.admitted == lane.deferred
    assert lane.dropped.total() == 0


async def test_queries_that_miss_get_their_networks_share_of_the_slow_path(
    start_node: StartNode,
) -> None:
    """A client whose queries all miss (new names) is served round robin with the flood's
    network, not after it."""
    node = await start_node(
        dns_listen=("127.0.0.1:0",), dns_slow_batch=1, dns_slow_queue_per_network=1000
    )
    flood = [missing_name(i) for i in range(300)]
    legit = [with_id(missing_name(10_000 + i), 2000 + i) for i in range(10)]
    before, total, answers = await flood_then(node, flood, legit, "127.0.1.1", "127.0.3.1")
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(2000, 2010))
    assert total == len(flood)
    # Round robin: the ten are answered within the first twenty slow-path answers or so.
    assert before < len(flood)


async def test_in_the_order_read_the_flood_is_answered_first(start_node: StartNode) -> None:
    """The same flood with fair admission off (the listener as it was): the legitimate answers
    come only after every flood answer. What the two tests above guard against."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_fair_admission=False)
    await prime(node, "127.0.2.1")
    flood = [missing_name(i) for i in range(300)]
    legit = [with_id(CACHED, 1000 + i) for i in range(20)]
    before, total, answers = await flood_then(node, flood, legit, "127.0.1.1", "127.0.2.1")
    assert len(answers) == len(legit)
    assert before == total == len(flood)


async def test_queues_are_bounded_and_every_drop_is_counted(start_node: StartNode) -> None:
    # One socket: the datagrams are read in the order sent (with a socket per network they
    # are read a socket at a time, and the drops below fall elsewhere).
    node = await start_node(
        dns_listen=("127.0.0.1:0",),
        dns_slow_queue_per_network=8,
        dns_slow_queue_total=20,
        dns_udp_sockets=1,
    )
    assert node.dns is not None
    stats = node.dns.responder.stats
    target = ("127.0.0.1", port_of(node))
    # One network floods 50 queries; then five spoofed-looking networks send 5 each. All wait in
    # the kernel's buffer before the server reads one (no await in between), and it reads them
    # in one turn: 20 of the first network's are queued (alone, it may fill the total), 30
    # dropped; the next networks' push its oldest out down to its bound of 8 (12 more
    # dropped), then the bound of 20 in all drops the rest (13).
    with (
        sender("127.0.1.1") as a,
        sender("127.0.11.1") as b,
        sender("127.0.12.1") as c,
        sender("127.0.13.1") as d,
        sender("127.0.14.1") as e,
        sender("127.0.15.1") as f,
    ):
        for i in range(50):
            a.sendto(missing_name(i), target)
        others = [b, c, d, e, f]
        for n, sock in enumerate(others):
            for i in range(5):
                sock.sendto(missing_name(100 * (n + 1) + i), target)
        got = [await receive(a, 8)]
        got += [await receive(s, k) for s, k in zip(others[:3], [5, 5, 2], strict=True)]
        assert [len(x) for x in got] == [8, 5, 5, 2]
        assert stats.lane.dropped[NETWORK_FULL] == 42
        assert stats.lane.dropped[TOTAL_FULL] == 13
        assert stats.lane.peak == 20
        # Queued: the 20 answered and the 12 pushed out after they were queued.
        assert stats.lane.deferred == 32 and stats.lane.admitted == 20
        assert stats.lane.queued == 0
        # Nothing else arrives: what was dropped was dropped, and counted. (A query answered
        # after them, through the same queues, shows the server read everything sent before.)
        check = dns.message.make_query("chat.gtm.example.", "A")
        assert (await udp(node, check, source="127.0.13.1")).answer
        assert all(waiting(s) == 0 for s in [a, *others])
    metrics = {
        (m.name, tuple(s.labels.values())): s.value
        for m in DnsCollector(stats).collect()
        for s in m.samples
    }
    assert metrics[("gtm_dns_slow_dropped", ("network_full",))] == 42
    assert metrics[("gtm_dns_slow_dropped", ("total_full",))] == 13
    assert metrics[("gtm_dns_slow_admitted", ())] == 21  # with the check
    assert metrics[("gtm_dns_slow_deferred", ())] == 33
    assert metrics[("gtm_dns_slow_queued", ())] == 0


def test_lane_round_robin_bounds_and_shutdown_count() -> None:
    lane: SlowLane[tuple[str, int]] = SlowLane(per_network=3, total=5)
    for i in range(5):
        lane.offer("flood", ("flood", i))
    lane.offer("a", ("a", 0))
    lane.offer("b", ("b", 0))
    lane.offer("b", ("b", 1))
    assert lane.counts.dropped[NETWORK_FULL] == 2  # the flood's two oldest, pushed out
    assert lane.counts.dropped[TOTAL_FULL] == 1  # b's second: five waiting, none past a bound
    assert len(lane) == 5 and lane.networks() == 3
    # The flood queued five while alone; a and b each took the place of its oldest.
    assert lane.take(4) == [("flood", 2), ("a", 0), ("b", 0), ("flood", 3)]
    assert lane.clear() == 1 and lane.counts.dropped[SHUTDOWN] == 1
    assert lane.counts.queued == 0 and lane.counts.peak == 5
    with pytest.raises(ValueError, match="positive"):
        SlowLane[Any](per_network=0, total=1)


def test_sender_networks_are_slash_24s_and_slash_56s_mapped_ipv4_included() -> None:
    assert sender_network("192.0.2.7") == sender_network("192.0.2.200")
    assert sender_network("192.0.2.7") != sender_network("192.0.3.7")
    # On a dual-stack socket IPv4 senders come as mapped addresses: each keeps its /24.
    assert sender_network("::ffff:192.0.2.9") == sender_network("192.0.2.7")
    assert sender_network("::ffff:192.0.2.9") != sender_network("::ffff:198.51.100.9")
    assert sender_network("2001:db8:0:ff::1") == sender_network("2001:db8::1%eth0")
    assert sender_network("2001:db8:0:100::1") != sender_network("2001:db8::1")


async def test_a_large_resolver_alone_is_not_capped_at_its_networks_bound(
    start_node: StartNode,
) -> None:
    """600 queries that miss from one network at once, on an idle node with a per-network bound
    of 64: queued past the bound while no other network waits, every one answered."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_slow_queue_per_network=64)
    assert node.dns is not None
    target = ("127.0.0.1", port_of(node))
    with sender("127.0.5.1") as big:
        for i in range(600):
            big.sendto(with_id(missing_name(i), i), target)
        answers = await receive(big, 600)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(600))
    assert node.dns.responder.stats.lane.dropped.total() == 0


async def test_a_network_over_its_share_of_a_batch_is_dropped_as_read_while_behind(
    start_node: StartNode,
) -> None:
    """Behind a flood of cached queries from one network, with another network sending too,
    the flood's datagrams past TURN_SHARE of a read batch are dropped as they are read, and
    counted; the other network's are all answered. All 510 datagrams wait in the kernel's
    buffer before the server reads one: the first batch (READ_BATCH, from both networks) is
    read whole, so the reader is behind; in the second, the flood gets TURN_SHARE. One socket:
    the two networks share its buffer, as networks steered to the same socket do."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_udp_sockets=1)
    assert node.dns is not None
    await prime(node, "127.0.1.1")
    await prime(node, "127.0.2.1")
    target = ("127.0.0.1", port_of(node))
    with sender("127.0.1.1") as f, sender("127.0.2.1") as g:
        for part in range(2):
            for i in range(250):
                f.sendto(with_id(CACHED, 250 * part + i), target)
            for i in range(5):
                g.sendto(with_id(CACHED, 1000 + 5 * part + i), target)
        answers = await receive(g, 10)
        # The first batch: 250 + 5 + 1 of the flood's second part; of the 249 left in the
        # second, TURN_SHARE (64) answered.
        flood_answers = await receive(f, 251 + TURN_SHARE)
        check = dns.message.make_query("chat.gtm.example.", "A")
        assert (await udp(node, check, source="127.0.1.1")).answer  # read after the rest
        assert waiting(f) == 0
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(1000, 1010))
    assert len(flood_answers) == 251 + TURN_SHARE
    lane = node.dns.responder.stats.lane
    assert lane.dropped[OVER_SHARE] == 500 - 251 - TURN_SHARE


async def test_a_network_alone_is_not_dropped_over_its_share(start_node: StartNode) -> None:
    """The same 500 cached queries from one network alone: every one answered."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None
    await prime(node, "127.0.1.1")
    target = ("127.0.0.1", port_of(node))
    with sender("127.0.1.1") as f:
        for i in range(500):
            f.sendto(with_id(CACHED, i), target)
        answers = await receive(f, 500)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(500))
    assert node.dns.responder.stats.lane.dropped[OVER_SHARE] == 0


FLOOD_DATAGRAMS = 30_000  # far more than a receive buffer holds (some 5,000 at 2 MiB)


def other_socket_sender(node: Node, flood_from: str) -> str:
    """A sender address (its own /24) that the steering program puts in another socket than
    ``flood_from``'s."""
    assert node.dns is not None
    flood_socket = node.dns.socket_of(flood_from)
    for third in range(2, 250):
        host = f"127.0.{third}.1"
        if node.dns.socket_of(host) != flood_socket:
            return host
    raise AssertionError("every /24 tried shares the flood's socket")


async def overflow_then(node: Node, flood_from: str, legit_from: str) -> socket.socket:
    """Prime ``legit_from``, then send FLOOD_DATAGRAMS cached queries from ``flood_from`` and 50
    from ``legit_from``, all before the server reads one (no await in between): whatever one
    receive buffer cannot hold, the kernel drops. Returns the legitimate sender's socket (the
    caller closes it)."""
    await prime(node, legit_from)
    target = ("127.0.0.1", port_of(node))
    legit = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    legit.setblocking(False)
    legit.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    legit.bind((legit_from, 0))
    with sender(flood_from) as f:
        for i in range(FLOOD_DATAGRAMS):
            f.sendto(with_id(CACHED, i % 60_000), target)
        for i in range(50):
            legit.sendto(with_id(CACHED, 60_000 + i), target)
    return legit


async def test_a_flood_that_overflows_its_socket_drops_nothing_of_another_network(
    start_node: StartNode,
) -> None:
    """A network floods far more than a receive buffer holds, all sent before the server reads
    any: the kernel steers it to its own socket (gtm.geodns.steering) and drops only from that
    socket's buffer, so another network's 50 queries, sent after the whole flood, are all
    answered; the drops are counted (gtm_dns_receive_dropped). With one socket for everyone
    (below, and the listener before) the same 50 are dropped in the kernel, unread."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None and node.dns.steered
    assert node.dns.steer_group > 1
    legit_from = other_socket_sender(node, "127.0.1.1")
    legit = await overflow_then(node, "127.0.1.1", legit_from)
    with legit:
        answers = await receive(legit, 50)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(60_000, 60_050))
    drops = node.dns.receive_drops()
    assert 0 < drops < FLOOD_DATAGRAMS  # the flood's socket overflowed; nothing else
    metrics = {
        m.name: m.samples[0].value for m in DnsCollector(node.dns_stats).collect() if m.samples
    }
    assert metrics["gtm_dns_receive_dropped"] == drops


async def test_in_one_socket_a_flood_that_overflows_it_drops_every_network_alike(
    start_node: StartNode,
) -> None:
    """The same flood with one socket for every sender (GTM_DNS_UDP_SOCKETS=1): the buffer is
    full when the other network's 50 arrive, and none is answered. What steering prevents."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_udp_sockets=1)
    assert node.dns is not None and not node.dns.steered
    legit = await overflow_then(node, "127.0.1.1", "127.0.2.1")
    with legit:
        # Every datagram that reached the buffer is read (it is empty again) before the marker
        # is sent; the server reads in order, so the marker's answer comes after any answer to
        # the 50 that were not dropped. The server reads in this loop: yielding lets it, and no
        # event marks a kernel buffer empty.
        while receive_queued(node.dns.udp_sockets()[0]):  # noqa: ASYNC110
            await asyncio.sleep(0)
        legit.sendto(with_id(CACHED, 65_000), ("127.0.0.1", port_of(node)))
        answers = await receive(legit, 1)
        while int.from_bytes(answers[-1][:2], "big") != 65_000:
            answers += await receive(legit, 1)
    assert [int.from_bytes(a[:2], "big") for a in answers] == [65_000]
    assert node.dns.receive_drops() >= 50


async def readable(sock: socket.socket) -> None:
    """Until ``sock`` has a datagram waiting (none is read)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, DEADLINE_S)
    finally:
        loop.remove_reader(sock.fileno())


def _stamped(sock: socket.socket) -> list[tuple[int, bytes]]:
    """Every datagram waiting in ``sock`` (SO_TIMESTAMPNS on), with the time the kernel queued
    it, in nanoseconds."""
    out = []
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(65535, 1024)
        except BlockingIOError:
            return out
        stamp = next(
            (d for _, kind, d in ancillary if kind == SO_TIMESTAMPNS),
            None,
        )
        assert stamp is not None
        seconds, nanoseconds = struct.unpack("=qq", stamp[:16])
        out.append((seconds * 1_000_000_000 + nanoseconds, data))


async def stamped_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """At least ``count`` datagrams from ``sock`` (SO_TIMESTAMPNS on), each with the time the
    kernel queued it, waiting for them as they come."""
    got: list[tuple[int, bytes]] = []
    while len(got) < count:
        await readable(sock)
        got += _stamped(sock)
    return got


@pytest.mark.parametrize("sockets", [8, 1])
async def test_another_networks_queries_wait_behind_one_batch_of_a_flood_at_most(
    start_node: StartNode, sockets: int
) -> None:
    """2,000 cached queries from a flooding network, then 5 from another, all waiting before the
    server reads one. Steered to their own sockets, the five are answered after at most one
    socket batch (SOCKET_BATCH) of the flood's answers, by the kernel's receive timestamps;
    in one socket they wait behind a full read batch of the flood's at least."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_udp_sockets=sockets)
    assert node.dns is not None
    legit_from = other_socket_sender(node, "127.0.1.1") if sockets > 1 else ("127.0.2.1")
    await prime(node, legit_from)
    target = ("127.0.0.1", port_of(node))
    with sender("127.0.1.1") as f, sender(legit_from) as g:
        for sock in (f, g):
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        for i in range(2000):
            f.sendto(with_id(CACHED, i), target)
        for i in range(5):
            g.sendto(with_id(CACHED, 3000 + i), target)
        got = await stamped_answers(g, 5)
        last = max(stamp for stamp, _ in got)
        # Every flood answer the server sent before the legitimate ones' last (the rest come).
        check = dns.message.make_query("chat.gtm.example.", "A")
        assert (await udp(node, check, source="127.0.1.1")).answer  # read after all 2,000
        flood = _stamped(f)
    assert sorted(int.from_bytes(d[:2], "big") for _, d in got) == list(range(3000, 3005))
    before = sum(1 for stamp, _ in flood if stamp < last)
    if sockets > 1:
        assert before <= SOCKET_BATCH
    else:
        assert before >= READ_BATCH
