"""Established networks that must prove their return path (GTM_DNS_ESTABLISH_WITH_COOKIE): a
valid DNS cookie or a TCP query proves it, and the cookie then tells the network's own queries
from a flood forged in its name (gtm.geodns.established, gtm.geodns.udp)."""

from __future__ import annotations

import dns.asyncquery
import dns.edns
import dns.message
import dns.query
import pytest

from gtm.geodns.admission import UNPROVEN, sender_network
from gtm.geodns.established import (
    AGE_TICKS,
    DEMOTED,
)
from gtm.node import Node

from .conftest import StartNode, port_of
from .conftest import udp as udp_query
from .test_established import listener, sharing_a_protected_socket
from .test_fairness import (
    CACHED,
    prime,
    receive,
    sender,
    with_id,
)


@pytest.mark.usefixtures("manual_ticks")
async def test_with_cookies_required_a_spoofable_network_is_never_established(
    start_node: StartNode,
) -> None:
    """Before, any network read in three calm ticks was established: forged senders asking
    steadily on a calm day got protected sockets, to flood from later. With
    GTM_DNS_ESTABLISH_WITH_COOKIE, a network asking without a cookie never is; one whose query
    brought back the server cookie it was given (its address receives our answers) is."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_establish_with_cookie=True)
    fair = listener(node)
    assert fair.established is not None
    for _ in range(AGE_TICKS + 2):
        await prime(node, "127.0.7.1")
        fair.tick()
    assert sender_network("127.0.7.1") not in fair.established
    client = bytes(range(8))
    asked = dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.GenericOption(10, client)]
    )
    first = await udp_query(node, asked, source="127.0.8.1")
    (issued,) = (o.to_wire() for o in first.options if o.otype == dns.edns.OptionType.COOKIE)
    assert sender_network("127.0.8.1") not in fair.established
    proof = dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.GenericOption(10, issued)]
    )
    for _ in range(AGE_TICKS):
        await udp_query(node, proof, source="127.0.8.1")
        await prime(node, "127.0.7.1")
        fair.tick()
    assert sender_network("127.0.8.1") in fair.established
    assert sender_network("127.0.7.1") not in fair.established


@pytest.mark.usefixtures("manual_ticks")
async def test_with_proof_required_a_query_over_tcp_proves_its_network(
    start_node: StartNode,
) -> None:
    """A TCP connection proves its peer's address as a cookie does (the peer answered the
    SYN-ACK sent to it). Before, only a cookie counted: a network whose resolvers speak no
    cookies but fall back to TCP was never established."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_establish_with_cookie=True)
    fair = listener(node)
    assert fair.established is not None
    for _ in range(AGE_TICKS):
        await prime(node, "127.0.9.1")
        fair.tick()
    assert sender_network("127.0.9.1") not in fair.established
    plain = dns.message.make_query("chat.gtm.example.", "A")
    reply = await dns.asyncquery.tcp(plain, "127.0.0.1", port=port_of(node), source="127.0.9.7")
    assert reply.answer
    for _ in range(AGE_TICKS):
        await prime(node, "127.0.9.1")
        fair.tick()
    assert sender_network("127.0.9.1") in fair.established


async def cookie_query(node: Node, source: str) -> bytes:
    """The query ``source`` asks with the server cookie the node gave it (valid for an hour)."""
    client = bytes(range(8))
    first = await udp_query(
        node,
        dns.message.make_query(
            "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.GenericOption(10, client)]
        ),
        source=source,
    )
    (issued,) = (o.to_wire() for o in first.options if o.otype == dns.edns.OptionType.COOKIE)
    proof = dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.GenericOption(10, issued)]
    )
    assert (await udp_query(node, proof, source=source)).answer
    return proof.to_wire()


async def two_cookie_networks(start_node: StartNode) -> tuple[Node, str, str, dict[str, bytes]]:
    """A node establishing only proven networks, and two cookie-speaking networks established
    on one protected socket: the node, the two resolvers' hosts, and the query each asks with
    its valid cookie."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_establish_with_cookie=True)
    assert node.dns is not None and node.dns.split
    fair = listener(node)
    assert fair.split is not None and fair.established is not None
    victim = "127.0.5.1"
    other = sharing_a_protected_socket(fair, victim)
    asks = {host: await cookie_query(node, host) for host in (victim, other)}
    for _ in range(AGE_TICKS):
        for host, wire in asks.items():
            assert (await udp_query(node, dns.message.from_wire(wire), source=host)).answer
        fair.tick()
    assert sender_network(victim) in fair.established
    assert sender_network(other) in fair.established
    return node, victim, other, asks


@pytest.mark.usefixtures("manual_ticks")
async def test_a_flood_forged_in_an_established_networks_name_is_told_by_its_cookie(
    start_node: StartNode,
) -> None:
    """Two cookie-speaking networks are established on one protected socket. A forger sends
    2,000 queries from the first network's addresses, without a cookie (it never sees ours),
    while each network's resolver asks 20 with its cookie. Before, the forged datagrams were
    the first network's: past its share of a batch, its own queries were dropped with them
    and, at the tick, it was demoted, which is what the forger wanted. Now, on a protected
    socket behind, a datagram without a valid cookie in the name of a network whose clients
    bring one is dropped as read (counted as unproven; UNPROVEN_ALLOWANCE of them a tick are
    answered all the same): both resolvers get every answer and keep their place."""
    node, victim, other, asks = await two_cookie_networks(start_node)
    fair = listener(node)
    assert fair.established is not None
    port = port_of(node)
    forger_host = "127.0.5.66"  # the victim's /24: its queries land where the victim's do
    with sender(forger_host) as forger, sender(victim) as v, sender(other) as o:
        for i in range(2000):
            forger.sendto(with_id(CACHED, i), ("127.0.0.1", port))
            if i % 100 == 0:
                v.sendto(with_id(asks[victim], 61_000 + i // 100), ("127.0.0.1", port))
                o.sendto(with_id(asks[other], 62_000 + i // 100), ("127.0.0.1", port))
        got_v = await receive(v, 20)
        got_o = await receive(o, 20)
    assert sorted(int.from_bytes(a[:2], "big") for a in got_v) == list(range(61_000, 61_020))
    assert sorted(int.from_bytes(a[:2], "big") for a in got_o) == list(range(62_000, 62_020))
    assert node.dns.responder.stats.lane.dropped[UNPROVEN] > 0
    fair.tick()
    assert sender_network(victim) in fair.established
    assert fair.established.changes[DEMOTED] == 0


@pytest.mark.usefixtures("manual_ticks")
async def test_a_client_whose_cookie_went_bad_is_handed_a_new_one_while_its_socket_is_behind(
    start_node: StartNode,
) -> None:
    """A cookie-speaking network's own resolver keeps its protected socket behind (2,000
    queries at once, each with its valid cookie); meanwhile another client of the network asks
    with a client cookie alone (it restarted, or is new to the network's address pool). Its
    query is unproven, and with no allowance it went unanswered for as long as the socket
    stayed behind; now a few unproven queries a tick are answered, each with a fresh cookie."""
    node, victim, _, asks = await two_cookie_networks(start_node)
    port = port_of(node)
    restarted = "127.0.5.9"
    fresh_ask = dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.GenericOption(10, bytes(8))]
    ).to_wire()
    with sender(victim) as v, sender(restarted) as c:
        for i in range(2000):
            v.sendto(with_id(asks[victim], i), ("127.0.0.1", port))
            if i % 500 == 250:
                c.sendto(with_id(fresh_ask, 63_000 + i // 500), ("127.0.0.1", port))
        answers = await receive(c, 4)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(63_000, 63_004))
    for answer in answers:
        reply = dns.message.from_wire(answer)
        (cookie,) = (o.to_wire() for o in reply.options if o.otype == dns.edns.OptionType.COOKIE)
        assert cookie[:8] == bytes(8) and len(cookie) == 24  # a server cookie to come back with
