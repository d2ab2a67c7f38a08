"""Fair admission over TCP (gtm.geodns.tcp): a flood of connections asking for what no cache
holds, the connection cap, and a connection pipelining what the caches hold."""

from __future__ import annotations

import asyncio
import socket
import struct

import dns.message
import pytest

from gtm.geodns.stats import DnsCollector
from gtm.node import Node
from tests.support.waiting import eventually

from .conftest import StartNode, port_of
from .test_fairness import CACHED, DEADLINE_S, missing_name, with_id


def framed(wire: bytes) -> bytes:
    return struct.pack("!H", len(wire)) + wire


def tcp_connection(node: Node, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port_of(node)), source_address=(source, 0))
    sock.setblocking(False)
    return sock


async def tcp_answer(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < 2 or len(data) < 2 + int.from_bytes(data[:2], "big"):
        data += await asyncio.wait_for(loop.sock_recv(sock, 65535), DEADLINE_S)
    return data[2:]


async def end_of_stream(sock: socket.socket) -> bool:
    """Whether the server closed the connection (end of stream, or a reset) before sending
    anything more on it."""
    try:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65535), DEADLINE_S)
    except ConnectionResetError:
        return True
    return data == b""


def answers_waiting(sock: socket.socket) -> int:
    """How many whole answers wait in a connection now (read and discarded)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65535)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    n = pos = 0
    while pos + 2 <= len(data):
        pos += 2 + int.from_bytes(data[pos : pos + 2], "big")
        n += pos <= len(data)
    return n


@pytest.mark.parametrize("fair", [True, False])
async def test_a_tcp_flood_of_misses_does_not_hold_cached_tcp_answers(
    start_node: StartNode, fair: bool
) -> None:
    """Twenty connections from one network each pipeline twenty new names; then a client of
    another network asks its cached question over TCP, all sent before the server reads any.
    With fair admission the misses wait for the slow path (one message a loop turn here) and
    the cached answer comes before any of theirs; in the order read (admission off), each
    flood connection's first message is answered before the client's."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_slow_batch=1, dns_fair_admission=fair)
    assert node.dns is not None
    legit = tcp_connection(node, "127.0.2.1")
    flood = [tcp_connection(node, "127.0.1.1") for _ in range(20)]
    try:
        legit.send(framed(CACHED))
        assert dns.message.from_wire(await tcp_answer(legit)).answer  # now a first-level hit
        for _ in range(int(DEADLINE_S / 0.01)):  # until every connection is accepted
            if node.dns_stats.tcp_connections == 21:
                break
            await asyncio.sleep(0.01)
        for c, sock in enumerate(flood):
            sock.send(b"".join(framed(missing_name(100 * c + i)) for i in range(20)))
        legit.send(framed(with_id(CACHED, 4242)))
        answer = await tcp_answer(legit)
        assert int.from_bytes(answer[:2], "big") == 4242
        before = sum(answers_waiting(sock) for sock in flood)
    finally:
        for sock in [legit, *flood]:
            sock.close()
    if fair:
        assert before < len(flood)
        lane = node.dns.responder.stats.tcp_lane
        assert lane.deferred > 0
        metrics = {m.name: m.samples[0].value for m in DnsCollector(node.dns_stats).collect()}
        assert metrics["gtm_dns_tcp_slow_deferred"] == lane.deferred
        assert metrics["gtm_dns_tcp_slow_admitted"] == lane.admitted
    else:
        assert before >= len(flood)


async def test_at_the_connection_cap_a_newcomer_closes_the_biggest_networks_oldest(
    start_node: StartNode,
) -> None:
    """Three connections from one network fill a cap of three; a client of another network is
    served, and the first network's oldest connection is closed for it (counted as refused). A
    fourth from the first network is refused: it holds as many as the other would then."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_tcp_max_connections=3)
    flood = [tcp_connection(node, "127.0.1.1") for _ in range(3)]
    others: list[socket.socket] = []
    try:
        for sock in flood:  # each served, in the order opened
            sock.send(framed(CACHED))
            assert dns.message.from_wire(await tcp_answer(sock)).answer
        others.append(tcp_connection(node, "127.0.2.1"))
        others[0].send(framed(CACHED))
        assert dns.message.from_wire(await tcp_answer(others[0])).answer
        # The oldest flood connection was closed: end of stream (or a reset).
        assert await end_of_stream(flood[0])
        assert node.dns_stats.tcp_refused == 1
        flood[1].send(framed(CACHED))  # the others still answer
        assert dns.message.from_wire(await tcp_answer(flood[1])).answer
        others.append(tcp_connection(node, "127.0.1.1"))
        others[1].send(framed(CACHED))
        assert await end_of_stream(others[1])
        assert node.dns_stats.tcp_refused == 2
    finally:
        for sock in [*flood, *others]:
            sock.close()


async def test_a_connection_pipelining_cached_queries_answers_a_few_a_loop_turn(
    start_node: StartNode,
) -> None:
    """One connection pipelines 1,000 cached queries; once the server answers them, another
    asks one. A connection answers TURN_MESSAGES in a row, then lets the loop turn: with no
    bound (a read from a full buffer never suspends), the other's answer came after all
    1,000, and every UDP client waited as long."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    hog = tcp_connection(node, "127.0.1.1")
    other = tcp_connection(node, "127.0.2.1")
    try:
        for sock in (hog, other):  # each connection's question is now a first-level hit
            sock.send(framed(CACHED))
            assert dns.message.from_wire(await tcp_answer(sock)).answer
        burst = b"".join(framed(with_id(CACHED, i)) for i in range(1000))
        assert hog.send(burst) == len(burst)
        # The other asks once the server is answering the burst (with no bound, this test's
        # task would only run again once all 1,000 were answered).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while node.dns_stats.tcp_messages < 3:
            assert loop.time() < deadline, "the burst was never read"
            await asyncio.sleep(0)
        other.send(framed(with_id(CACHED, 4242)))
        answer = await tcp_answer(other)
        assert int.from_bytes(answer[:2], "big") == 4242
        # The few turns between the answer sent and this test reading it, TURN_MESSAGES each:
        # far from the whole burst.
        before = answers_waiting(hog)
        assert before < 250, before
        await eventually(
            lambda: node.dns_stats.tcp_messages == 1003, DEADLINE_S, "every message read"
        )
    finally:
        hog.close()
        other.close()
    metrics = {m.name: m.samples[0].value for m in DnsCollector(node.dns_stats).collect()}
    assert metrics["gtm_dns_tcp_messages"] == 1003
