"""Malformed queries on the ECS path: answered as the full path answers them, byte for byte.

The ECS path (gtm.geodns.shapes) finds a query's shape by the bytes before its last N octets,
for every address length N any shape of this sender has. A query of one shape with bytes
appended could match another length's key: an IPv4 /24 query with 4 octets appended ends with
7 octets, the length of an IPv6 /56 shape's address, and the bytes before those are the IPv4
shape's key. It was then answered as that shape with 7 octets of "address": OverflowError in
the GeoIP lookup (nothing sent, a traceback logged), or, when the 7 octets made a small enough
number, NOERROR with a 7-octet ECS echo, where the full path says FORMERR (trailing bytes).
"""

from __future__ import annotations

import asyncio
import socket
import struct

import dns.message
import dns.rcode
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from gtm.geodns.wire import Query, Reject, parse_query
from gtm.node import Node
from tests.support.waiting import eventually

from .conftest import StartNode, port_of, raw_udp
from .test_server import q


async def _tcp_raw(node: Node, wire: bytes) -> bytes | None:
    """One length-prefixed message over a fresh TCP connection; the reply, or None when the
    server closed the connection without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(node))
    try:
        writer.write(struct.pack("!H", len(wire)) + wire)
        try:
            (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 10))
        except asyncio.IncompleteReadError:
            return None
        return await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()
        await writer.wait_closed()


async def _sender(node: Node, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    return sock


async def _exchange(node: Node, sock: socket.socket, wire: bytes) -> bytes | None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendto(sock, wire, ("127.0.0.1", port_of(node)))
    try:
        return await asyncio.wait_for(loop.sock_recv(sock, 65535), 10)  # a loaded machine
    except TimeoutError:
        return None


REPRO_V4 = ("81.2.69.0", 24)
REPRO_V6 = ("2a02:8800::", 56)


async def _repro(node: Node, v4: tuple[str, int], bad: bytes, source: str) -> bytes | None:
    """The issue's sequence from one sender: an IPv4 /24 ECS query, an IPv6 /56 ECS query,
    then ``bad`` (the IPv4 query again with bytes appended); the last reply."""
    sock = await _sender(node, source)
    try:
        first = await _exchange(node, sock, q(ecs=v4).to_wire())
        assert first is not None and dns.message.from_wire(first).rcode() == dns.rcode.NOERROR
        second = await _exchange(node, sock, q(ecs=REPRO_V6).to_wire())
        assert second is not None
        return await _exchange(node, sock, bad)
    finally:
        sock.close()


async def test_a_v4_query_with_four_bytes_appended_after_a_v6_shape_gets_formerr(
    start_node: StartNode,
) -> None:
    """The repro packets (the issue's two cases), over UDP from one sender: FORMERR with the
    query's OPT, as the full path (a fresh sender, TCP) answers the same bytes."""
    node = await start_node()
    cases = (
        (REPRO_V4, b"\xff\xff\xff\xff", "127.0.0.2"),  # OverflowError, nothing sent
        (("0.0.0.0", 24), b"\x00\x00\x00\x01", "127.0.0.3"),  # NOERROR, 7-octet ECS echo
    )
    for v4, tail, source in cases:
        bad = q(ecs=v4).to_wire() + tail
        assert isinstance(parse_query(bad), Reject)
        got = await _repro(node, v4, bad, source)
        assert got is not None, v4  # answered, not dropped by an exception
        reply = dns.message.from_wire(got)
        assert reply.rcode() == dns.rcode.FORMERR, v4
        assert reply.edns == 0 and not reply.answer  # the OPT was readable: it comes back
        # The full path's answer to the same bytes: over TCP (no ECS path there), and over
        # UDP from a sender with no shapes.
        full_tcp = await _tcp_raw(node, bad)
        full_udp = await raw_udp(node, bad, wait=10, source="127.0.0.9")
        assert got == full_udp, v4
        assert got == full_tcp, v4
    # The well-formed queries of those shapes still take the ECS path and are answered.
    sock = await _sender(node, "127.0.0.2")
    try:
        for v4 in (("81.2.70.0", 24), REPRO_V4):
            out = await _exchange(node, sock, q(ecs=v4).to_wire())
            assert out is not None and dns.message.from_wire(out).answer
    finally:
        sock.close()


def test_the_repro_bytes_parse_as_a_reject() -> None:
    """Sanity for the test above: the appended bytes are what makes the packet malformed."""
    good = q(ecs=REPRO_V4).to_wire()
    assert isinstance(parse_query(good), Query)
    bad = parse_query(good + b"\x00\x00\x00\x01")
    assert isinstance(bad, Reject) and bad.rcode == dns.rcode.FORMERR and bad.edns is not None


def _failures(path: str, error: str) -> float:
    return (
        REGISTRY.get_sample_value("gtm_answer_failures_total", {"path": path, "error": error})
        or 0.0
    )


async def test_a_flood_of_packets_that_raise_is_counted_logged_once_and_starves_no_one(
    start_node: StartNode,
) -> None:
    """A bug a packet can reach (injected here: the GeoIP walk of the ECS path raises for
    5.0.0.0/8, as libmaxminddb's did for a 7-octet "address") hit by 400 packets from one
    sender: every one counted by path and exception type, one log line for the interval (with
    the type, where and a stack), and another client answered all along."""
    node = await start_node(answer_failure_log_interval_s=3600)
    stats = node.dns_stats
    geo = node.runtime.store.current.geo
    real_where = geo.where

    def where(version: int, value: int) -> tuple[tuple[object, ...], int]:
        if version == 4 and value >> 24 == 5:
            raise OverflowError("int too big to convert")
        return real_where(version, value)  # type: ignore[return-value]

    geo.where = where  # type: ignore[method-assign,assignment]
    before = _failures("dns.udp", "OverflowError")
    bad_sender = await _sender(node, "127.0.0.4")
    good_sender = await _sender(node, "127.0.0.5")
    loop = asyncio.get_running_loop()
    sent = 0
    try:
        # The slow path answers the sender's first query and keeps its shape: the rest take
        # the ECS path, and each new subnet its GeoIP walk.
        assert await _exchange(node, bad_sender, q(ecs=REPRO_V4).to_wire()) is not None
        with capture_logs() as logs:
            for batch in range(8):
                for i in range(50):
                    wire = q(ecs=(f"5.{batch}.{i}.0", 24)).to_wire()
                    await loop.sock_sendto(bad_sender, wire, ("127.0.0.1", port_of(node)))
                    sent += 1
                # Another client, meanwhile: answered every time.
                reply = await _exchange(node, good_sender, q(ecs=("81.2.70.0", 24)).to_wire())
                assert reply is not None and dns.message.from_wire(reply).answer, batch
                await eventually(
                    lambda n=sent: stats.failed == n, within=30, what=f"{sent} failures counted"
                )
    finally:
        del geo.where
        bad_sender.close()
        good_sender.close()
    assert _failures("dns.udp", "OverflowError") - before == sent
    lines = [e for e in logs if e["event"] == "answer.failed"]
    assert len(lines) == 1  # one line for the interval, not one per packet
    (line,) = lines
    assert line["path"] == "dns.udp" and line["error_type"] == "OverflowError"
    assert line["location"].startswith(f"{__name__}:")  # where it was raised: the injection
    assert "OverflowError: int too big to convert" in line["exception"]
    assert "responder.py" in line["exception"]  # the stack, through the answering path
    assert not any(e.get("exc_info") for e in logs)  # no traceback rendered per packet
    assert node.runtime.failures.logged == 1


_LONG = b"\x01a" * 127 + b"\x00"  # a 255-octet name of 127 labels


def _pointer_flood(questions: bool) -> bytes:
    """A 64 KB message whose every question (or answer record) is a pointer to a 127-label
    name: each would be read label by label again (0.54 s to parse the answer-record kind
    before the label budget, and it was then answered)."""
    body = _LONG + b"\x00\x01\x00\x01"
    if questions:
        n = (65535 - 12 - len(body)) // 6
        head = struct.pack("!HHHHHH", 0x1234, 0, 1 + n, 0, 0, 0)
        return head + body + b"\xc0\x0c\x00\x01\x00\x01" * n
    n = (65535 - 12 - len(body)) // 12
    head = struct.pack("!HHHHHH", 0x1234, 0, 1, n, 0, 0)
    return head + body + b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x00\x00\x00" * n


def test_a_packet_may_read_only_so_many_labels() -> None:
    for questions in (True, False):
        reject = parse_query(_pointer_flood(questions))
        assert isinstance(reject, Reject) and reject.rcode == dns.rcode.FORMERR
        assert reject.reason == "more names than a query holds"
    # What a query may legitimately hold stays well inside: an IXFR with its SOA (two
    # 255-octet names in its data) and an OPT, every name as long as a name gets.
    soa = _LONG + struct.pack("!HHIH", 6, 1, 0, 2 * len(_LONG) + 20) + _LONG * 2 + bytes(20)
    opt = b"\x00" + struct.pack("!HHIH", 41, 1232, 0, 0)
    ixfr = struct.pack("!HHHHHH", 7, 0, 1, 0, 1, 1) + _LONG + b"\x00\xfb\x00\x01" + soa + opt
    query = parse_query(ixfr)
    assert isinstance(query, Query) and query.qtype == 251 and query.edns is not None


async def test_a_message_of_pointers_is_formerr_over_tcp(start_node: StartNode) -> None:
    node = await start_node()
    for questions in (True, False):
        reply = await _tcp_raw(node, _pointer_flood(questions))
        assert reply is not None
        message = dns.message.from_wire(reply)
        assert message.id == 0x1234 and message.rcode() == dns.rcode.FORMERR
