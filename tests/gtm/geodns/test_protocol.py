"""Meta and transfer query types, and FORMERR with an OPT, over real UDP and TCP sockets.

What BIND, Knot and NSD answer, and what this responder picked, is in ``gtm.geodns.zone``
(``_META_RCODE``): transfers REFUSED, MAILA/MAILB/TKEY NOTIMP, TSIG/OPT as a question FORMERR.
Before, every one of them got NOERROR with no answer, and a FORMERR for a bad ECS option came
back without an OPT record (RFC 6891 §6.1.1 wants one when the query's OPT was understood).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest

from gtm.node import Node

from .conftest import StartNode, port_of, raw_tcp, raw_udp, tcp, udp

TRANSPORTS = ("udp", "tcp")


async def ask(node: Node, transport: str, message: dns.message.Message) -> dns.message.Message:
    if transport == "udp":
        return await udp(node, message)
    return await tcp(node, message)


def meta_query(name: str, rdtype: str, use_edns: bool = True) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype, use_edns=0 if use_edns else False)
    query.flags &= ~dns.flags.RD  # as a transfer client or a resolver asks an authority
    return query


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("rdtype", "rcode"),
    [
        ("AXFR", dns.rcode.REFUSED),
        ("IXFR", dns.rcode.REFUSED),
        ("MAILA", dns.rcode.NOTIMP),
        ("MAILB", dns.rcode.NOTIMP),
        ("TKEY", dns.rcode.NOTIMP),
        ("TSIG", dns.rcode.FORMERR),
        ("OPT", dns.rcode.FORMERR),
        ("TYPE200", dns.rcode.NOTIMP),  # an unassigned meta type (RFC 6895 §3.1: 128-255)
        ("TYPE128", dns.rcode.FORMERR),  # NXNAME: never a question (RFC 9824 §3.5)
    ],
)
async def test_meta_and_transfer_types(
    start_node: StartNode, transport: str, rdtype: str, rcode: int
) -> None:
    node = await start_node()
    for name in ("gtm.example.", "chat.gtm.example."):
        for use_edns in (True, False):
            query = meta_query(name, rdtype, use_edns)
            reply = await ask(node, transport, query)
            assert reply.rcode() == rcode, (name, rdtype, use_edns)
            assert reply.id == query.id and not reply.answer and not reply.authority
            assert not reply.flags & dns.flags.AA  # nothing authoritative was said
            assert reply.question[0].rdtype == dns.rdatatype.from_text(rdtype)  # echoed
            assert reply.edns == (0 if use_edns else -1)  # OPT exactly when asked with one


async def test_an_ixfr_with_its_soa_in_the_authority_section_is_refused(
    start_node: StartNode,
) -> None:
    """An IXFR as a secondary sends it (RFC 1995 §3): the serial it holds in the authority."""
    node = await start_node()
    query = meta_query("gtm.example.", "IXFR", use_edns=False)
    query.authority.append(
        dns.rrset.from_text(
            "gtm.example.", 0, "IN", "SOA", "ns1.gtm.example. h.gtm.example. 1 1 1 1 1"
        )
    )
    for transport in TRANSPORTS:
        reply = await ask(node, transport, query)
        assert reply.rcode() == dns.rcode.REFUSED and not reply.answer


async def test_a_whole_axfr_session_is_refused_over_tcp(start_node: StartNode) -> None:
    """dnspython's transfer client, as an operator would try it: refused, nothing streamed."""
    import dns.asyncquery
    import dns.exception
    import dns.zone

    node = await start_node()
    zone = dns.zone.Zone(dns.name.from_text("gtm.example."))
    with pytest.raises(dns.exception.DNSException, match=r"(?i)refused"):
        await dns.asyncquery.inbound_xfr("127.0.0.1", zone, port=port_of(node), timeout=3)


def with_option(base: bytes, body: bytes, code: int = 8) -> bytes:
    """``base`` (a query ending in an empty OPT record) with one option of ``body`` added."""
    option = struct.pack("!HH", code, len(body)) + body
    return base[:-2] + struct.pack("!H", len(option)) + option


BAD_ECS = {
    "unknown family": struct.pack("!HBB", 3, 24, 0) + b"\xc6\x33\x64",
    "bits past the prefix": struct.pack("!HBB", 1, 20, 0) + b"\xc6\x33\x6f",
    "address longer than the prefix": struct.pack("!HBB", 1, 8, 0) + b"\xc6\x33",
    "shorter than 4 octets": b"\x00\x01",
}


@pytest.mark.parametrize("case", sorted(BAD_ECS))
async def test_formerr_for_a_bad_option_carries_an_opt(start_node: StartNode, case: str) -> None:
    node = await start_node()
    query = dns.message.make_query("chat.gtm.example.", "A", use_edns=0, want_dnssec=True)
    wire = with_option(query.to_wire(), BAD_ECS[case])
    udp_reply = await raw_udp(node, wire)
    assert udp_reply is not None
    # Over TCP too: one length-prefixed message on a fresh connection.
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(node))
    writer.write(struct.pack("!H", len(wire)) + wire)
    (length,) = struct.unpack("!H", await reader.readexactly(2))
    tcp_reply = await reader.readexactly(length)
    writer.close()
    await writer.wait_closed()
    for raw in (udp_reply, tcp_reply):
        reply = dns.message.from_wire(raw)
        assert reply.rcode() == dns.rcode.FORMERR and reply.id == query.id, case
        assert reply.edns == 0, case  # RFC 6891 §6.1.1: the OPT comes back
        assert reply.ednsflags & dns.flags.DO  # the query's DO bit, as on every answer
        assert reply.options == ()  # the bad option is not echoed


async def test_formerr_after_a_sound_opt_carries_it_and_one_without_has_none(
    start_node: StartNode,
) -> None:
    node = await start_node()
    base = dns.message.make_query("chat.gtm.example.", "A", use_edns=0).to_wire()
    # Trailing garbage after a sound OPT: FORMERR with the OPT.
    reply = dns.message.from_wire(await raw_udp(node, base + b"\x00") or b"")
    assert reply.rcode() == dns.rcode.FORMERR and reply.edns == 0
    # Two OPT records (RFC 6891 §6.1.1 says FORMERR): the reply still has exactly one.
    opt = base[-11:]
    doubled = bytearray(base + opt)
    doubled[11] = 2  # ARCOUNT
    raw = await raw_udp(node, bytes(doubled))
    assert raw is not None
    reply = dns.message.from_wire(raw)
    assert reply.rcode() == dns.rcode.FORMERR and reply.edns == 0
    # No OPT in the query: none in the FORMERR either.
    plain = dns.message.make_query("chat.gtm.example.", "A", use_edns=False).to_wire()
    reply = dns.message.from_wire(await raw_udp(node, plain + b"\x00") or b"")
    assert reply.rcode() == dns.rcode.FORMERR and reply.edns == -1


async def test_refused_transfers_are_counted_in_the_audit(start_node: StartNode) -> None:
    node = await start_node()
    before = node.runtime.writer.counted
    await tcp(node, meta_query("gtm.example.", "AXFR"))
    await udp(node, meta_query("gtm.example.", "MAILA"))
    assert node.runtime.writer.counted == before + 2  # DESIGN.md rule 2: errors are answers
    assert node.dns_stats.queries["tcp", "AXFR", "REFUSED"] == 1
    assert node.dns_stats.queries["udp", "MAILA", "NOTIMP"] == 1


async def _both(node: Node, wire: bytes) -> list[bytes]:
    udp_reply = await raw_udp(node, wire, wait=10)
    assert udp_reply is not None
    return [udp_reply, await raw_tcp(node, wire)]


@pytest.mark.parametrize("qdcount", [0, 2])
async def test_formerr_for_a_question_count_other_than_one_carries_the_opt(
    start_node: StartNode, qdcount: int
) -> None:
    """QDCOUNT 0 (or 2) with a readable OPT: FORMERR with an OPT echoing DO (RFC 6891 §7), no
    question, as Knot answers. Before, the parse stopped at the count and the FORMERR had none."""
    node = await start_node()
    query = dns.message.make_query("chat.gtm.example.", "A", use_edns=0, want_dnssec=True)
    wire = query.to_wire()
    question, opt = wire[12:-11], wire[-11:]
    packet = wire[:4] + struct.pack("!HHHH", qdcount, 0, 0, 1) + question * qdcount + opt
    for raw in await _both(node, packet):
        reply = dns.message.from_wire(raw)
        assert reply.id == query.id and reply.rcode() == dns.rcode.FORMERR
        assert reply.edns == 0 and reply.ednsflags & dns.flags.DO
        assert not reply.question and not reply.answer
    # Without an OPT: none in the FORMERR either.
    plain = dns.message.make_query("chat.gtm.example.", "A", use_edns=False).to_wire()
    packet = plain[:4] + struct.pack("!HHHH", 0, 0, 0, 0)
    for raw in await _both(node, packet):
        reply = dns.message.from_wire(raw)
        assert reply.rcode() == dns.rcode.FORMERR and reply.edns == -1


@pytest.mark.parametrize("opcode", [15, 3])
async def test_notimp_for_an_unknown_opcode_echoes_rd_not_cd(
    start_node: StartNode, opcode: int
) -> None:
    """An opcode this server does not implement: NOTIMP with the opcode, the question and the
    OPT echoed, and of the query's flags RD only. RFC 1035 §4.1.1 has RD copied into every
    response; CD (RFC 4035 §3.2.2) asks for DNSSEC processing of a query this server did not
    process, and AD is never set by an authority here. Knot 3 answers these exactly so (flags
    QR, opcode, RD; CD and AD clear; OPT echoed); before, CD was echoed and the OPT dropped."""
    node = await start_node()
    query = dns.message.make_query("chat.gtm.example.", "A", use_edns=0, want_dnssec=True)
    query.flags |= dns.flags.RD | dns.flags.CD | dns.flags.AD
    query.set_opcode(opcode)
    for raw in await _both(node, query.to_wire()):
        reply = dns.message.from_wire(raw)
        assert reply.rcode() == dns.rcode.NOTIMP and reply.opcode() == opcode
        assert reply.flags & dns.flags.RD
        assert not reply.flags & (dns.flags.CD | dns.flags.AD | dns.flags.AA | dns.flags.RA)
        assert reply.question[0].name == dns.name.from_text("chat.gtm.example.")
        assert reply.edns == 0 and reply.ednsflags & dns.flags.DO
    # Without RD: none echoed.
    query.flags &= ~dns.flags.RD
    for raw in await _both(node, query.to_wire()):
        assert not dns.message.from_wire(raw).flags & dns.flags.RD


CHAOS_NAMES = ("version.bind.", "id.server.", "hostname.bind.", "version.server.")


def chaos(name: str, rdtype: str = "TXT") -> dns.message.Message:
    return dns.message.make_query(name, rdtype, rdclass="CH", use_edns=0)


def chaos_text(reply: dns.message.Message) -> str:
    (rrset,) = reply.answer
    assert rrset.rdclass == dns.rdataclass.CH and rrset.rdtype == dns.rdatatype.TXT
    assert rrset.ttl == 0
    return b"".join(b"".join(r.strings) for r in rrset).decode()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_chaos_identity_is_refused_unless_configured(
    start_node: StartNode, transport: str
) -> None:
    node = await start_node()
    for name in CHAOS_NAMES:
        reply = await ask(node, transport, chaos(name))
        assert reply.rcode() == dns.rcode.REFUSED and not reply.answer, name


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_chaos_identity_answers_what_is_configured(
    start_node: StartNode, transport: str
) -> None:
    """As Knot answers them: TXT in class CH, TTL 0, AA clear; other types and CHAOS names
    REFUSED. A version alone configured leaves the identity names REFUSED."""
    node = await start_node(dns_server_id="edge-fra-1", dns_server_version="gtm")
    for name, text in zip(CHAOS_NAMES, ("gtm", "edge-fra-1", "edge-fra-1", "gtm"), strict=True):
        for _ in range(2):  # the second from the caches
            reply = await ask(node, transport, chaos(name.upper()))
            assert reply.rcode() == dns.rcode.NOERROR, name
            assert chaos_text(reply) == text
            assert not reply.flags & dns.flags.AA and reply.edns == 0
        any_reply = await ask(node, transport, chaos(name, "ANY"))
        assert chaos_text(any_reply) == text
    for name, rdtype in (("version.bind.", "A"), ("authors.bind.", "TXT"), ("id.server.", "NS")):
        reply = await ask(node, transport, chaos(name, rdtype))
        assert reply.rcode() == dns.rcode.REFUSED and not reply.answer, (name, rdtype)
    # Class IN: the zone's answer (REFUSED: outside it), never the identity.
    reply = await ask(node, transport, dns.message.make_query("id.server.", "TXT", use_edns=0))
    assert reply.rcode() == dns.rcode.REFUSED


async def test_a_long_identity_is_split_into_character_strings(start_node: StartNode) -> None:
    node = await start_node(dns_server_version="v" * 300)
    reply = await tcp(node, chaos("version.bind."))
    (rdata,) = list(reply.answer[0])
    assert [len(s) for s in rdata.strings] == [255, 45]  # RFC 1035 §3.3.14
    assert (await udp(node, chaos("id.server."))).rcode() == dns.rcode.REFUSED


def nsid_query(ecs: str | None = None, nsid: bool = True) -> dns.message.Message:
    options: list[dns.edns.Option] = [dns.edns.NSIDOption(b"")] if nsid else []
    if ecs is not None:
        options.append(dns.edns.ECSOption(ecs, 24))
    return dns.message.make_query("chat.gtm.example.", "A", use_edns=0, options=options)


def nsid_of(reply: dns.message.Message) -> bytes | None:
    found = [o for o in reply.options if o.otype == dns.edns.OptionType.NSID]
    return found[0].nsid if found else None  # type: ignore[attr-defined]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_nsid_is_answered_with_the_server_id_when_configured(
    start_node: StartNode, transport: str
) -> None:
    """RFC 5001: a query with an NSID option gets the server id in one, on every answer, the
    ECS echo still last in the OPT record; without a server id configured, none."""
    node = await start_node(dns_server_id="edge-fra-1")
    for _ in range(2):  # the second from the caches
        reply = await ask(node, transport, nsid_query())
        assert nsid_of(reply) == b"edge-fra-1" and reply.answer
        reply = await ask(node, transport, nsid_query("198.51.100.0"))
        assert nsid_of(reply) == b"edge-fra-1" and reply.answer
        assert reply.options[-1].otype == dns.edns.OptionType.ECS
        assert nsid_of(await ask(node, transport, nsid_query(nsid=False))) is None


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_no_nsid_without_a_server_id(start_node: StartNode, transport: str) -> None:
    node = await start_node()
    reply = await ask(node, transport, nsid_query("198.51.100.0"))
    assert nsid_of(reply) is None and reply.answer


async def test_nsid_answers_alike_on_the_ecs_path(start_node: StartNode) -> None:
    """A sender's second ECS query of a shape takes the ECS path: the same bytes as the full
    path gives another sender, NSID included."""
    node = await start_node(dns_server_id="edge-fra-1")
    responder = node.dns.responder  # type: ignore[union-attr]
    # Two subnets of one wide GeoIP network (tests.support.geoip.WORLD: 100.72.0.0/13).
    taught = await udp(node, nsid_query("100.72.1.0"), source="127.0.0.2")
    assert nsid_of(taught) == b"edge-fra-1"
    query = nsid_query("100.73.2.0")
    wire = query.to_wire()
    shaped = responder._shaped
    answered: list[bytes | None] = []

    def watched(*args: Any, **kwargs: Any) -> bytes | None:
        answered.append(shaped(*args, **kwargs))
        return answered[-1]

    responder._shaped = watched  # watched, not changed: which path answered
    try:
        fast = await raw_udp(node, wire, wait=10, source="127.0.0.2")
    finally:
        del responder._shaped
    # The ECS path answered it: a subnet it has not seen, so on the slow path's turn (the
    # look-up as the datagram is read takes known subnets only: gtm.geodns.admission).
    assert answered == [None, fast]
    full = await raw_udp(node, wire, wait=10, source="127.0.0.3")
    assert fast is not None and fast == full
    assert nsid_of(dns.message.from_wire(fast)) == b"edge-fra-1"


def _nsid_rejects() -> list[tuple[str, bytes, int]]:
    """Packets rejected with a readable OPT asking for the NSID: (what, wire, rcode)."""
    nsid = dns.edns.NSIDOption(b"")
    query = dns.message.make_query("chat.gtm.example.", "A", use_edns=0, options=[nsid])
    wire = query.to_wire()
    opt_at = wire.index(b"\x00\x00\x29")  # the OPT record: root owner, type 41
    question, opt = wire[12:opt_at], wire[opt_at:]
    no_question = wire[:4] + struct.pack("!HHHH", 0, 0, 0, 1) + opt
    notimp = dns.message.make_query("chat.gtm.example.", "A", use_edns=0, options=[nsid])
    notimp.set_opcode(15)
    # ECS whose address has bits past its source prefix (/24 with a last octet), then NSID.
    bad_ecs = struct.pack("!HHHBB", 8, 8, 1, 24, 0) + bytes([198, 51, 100, 7])
    nsid_option = struct.pack("!HH", 3, 0)
    options = bad_ecs + nsid_option
    bad_opt = b"\x00" + struct.pack("!HHIH", 41, 1232, 0, len(options)) + options
    bad_option = wire[:12] + question + bad_opt
    badvers = dns.message.make_query("chat.gtm.example.", "A", use_edns=1, options=[nsid])
    return [
        ("QDCOUNT 0", no_question, dns.rcode.FORMERR),
        ("opcode 15", notimp.to_wire(), dns.rcode.NOTIMP),
        ("bad ECS, NSID after it", bad_option, dns.rcode.FORMERR),
        ("EDNS version 1", badvers.to_wire(), dns.rcode.BADVERS),
    ]


@pytest.mark.parametrize("server_id", ["edge-fra-1", None])
async def test_rejects_carry_the_nsid_when_asked(
    start_node: StartNode, server_id: str | None
) -> None:
    """FORMERR, NOTIMP and BADVERS to a query whose OPT was readable and asked for the NSID
    carry the server id as every other answer does (RFC 5001 §2.2), over UDP and TCP; with no
    server id configured, none. Before, only answers the zone rendered had it."""
    node = await start_node(dns_server_id=server_id)
    for what, wire, rcode in _nsid_rejects():
        for raw in await _both(node, wire):
            reply = dns.message.from_wire(raw)
            assert reply.rcode() == rcode, what
            assert nsid_of(reply) == (server_id.encode() if server_id else None), what
