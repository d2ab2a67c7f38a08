"""Name compression (gtm.geodns.render.compress): every owner name, and the names in the data of
the types RFC 1035 lets be compressed, point to their first writing, over UDP and TCP.

Before, only owners equal to the question pointed to it: an NS answer with its glue took 246
octets where NSD, Knot and BIND send 164 (Knot 3 measured on the same zone: 164 with EDNS, 153
without), and a signed answer of some 560 octets that compresses to under 400 went out
truncated to a client of 512.
"""

from __future__ import annotations

import io
import struct
import time
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import pytest

from gtm.geodns.dnssec_keys import generate
from gtm.geodns.render import compress, name_wire
from gtm.geodns.responder import udp_limit
from gtm.geodns.wire import Query, parse_query
from gtm.geodns.zone import answer

from .conftest import StartNode, raw_tcp, raw_udp, write_topology
from .test_dnssec import validate


def _uncompressed_size(message: dns.message.Message) -> int:
    """What ``message`` takes on the wire with no name compressed."""
    out = io.BytesIO()
    for rrset in message.question:
        out.write(rrset.name.to_wire() + struct.pack("!HH", rrset.rdtype, rrset.rdclass))
    for section in (message.answer, message.authority, message.additional):
        for rrset in section:
            rrset.to_wire(out, None)
    opt = 11 + sum(4 + len(o.to_wire()) for o in message.options) if message.edns >= 0 else 0
    return 12 + len(out.getvalue()) + opt


QUERIES = [
    ("gtm.example.", "NS"),
    ("gtm.example.", "SOA"),
    ("gtm.example.", "MX"),
    ("GTM.example.", "MX"),
    ("nope.gtm.example.", "A"),
    ("api.gtm.example.", "A"),
    ("docs.gtm.example.", "A"),
    ("_submission._tcp.gtm.example.", "SRV"),
    ("chat.gtm.example.", "TXT"),
]


async def test_names_are_compressed_and_mean_what_they_meant(start_node: StartNode) -> None:
    node = await start_node()
    snapshot = node.runtime.store.current
    for edns, ns_size in ((0, 164), (False, 153)):
        query = dns.message.make_query("gtm.example.", "NS", use_edns=edns)
        for raw in (
            await raw_udp(node, query.to_wire(), wait=10),
            await raw_tcp(node, query.to_wire()),
        ):
            assert raw is not None and len(raw) == ns_size  # Knot's size for the same data
    for name, rdtype in QUERIES:
        for transport in ("udp", "tcp"):
            query = dns.message.make_query(name, rdtype, use_edns=0)
            wire = query.to_wire()
            raw = (
                await raw_udp(node, wire, wait=10)
                if transport == "udp"
                else await raw_tcp(node, wire)
            )
            assert raw is not None
            parsed = parse_query(wire)
            assert isinstance(parsed, Query)
            limit = udp_limit(parsed.edns) if transport == "udp" else None
            full = answer(parsed, IPv4Address("127.0.0.1"), snapshot, time.time(), limit)
            got, want = dns.message.from_wire(raw), dns.message.from_wire(full.wire)
            # The same message, record for record; fewer octets unless nothing repeats.
            assert got == want, (name, rdtype)
            assert got.question[0].name.to_text() == name  # the question's case
            assert len(raw) <= len(full.wire), (name, rdtype)
            assert raw == compress(full.wire)
    # An SRV target is never compressed (RFC 2782), nor anything else in its data.
    query = dns.message.make_query("_submission._tcp.gtm.example.", "SRV", use_edns=0)
    raw = await raw_udp(node, query.to_wire(), wait=10)
    assert raw is not None
    assert struct.pack("!HHH", 0, 1, 587) + name_wire("mail.gtm.example.") in raw


async def test_names_that_do_not_exist_of_other_lengths_get_their_own_pointers(
    start_node: StartNode,
) -> None:
    """Answers for names that do not exist share a rendering with the question patched in
    (gtm.geodns.responder); compressed, the SOA's names point past the question, so names of
    another length must not take a rendering made for one length: each answer reads right."""
    node = await start_node()
    apex = dns.name.from_text("gtm.example.")
    for label in ("a", "bb", "ccc", "dd", "e", "a" * 40, "f" * 40, "Gg", "h.i.j"):
        for use_edns in (0, False):
            name = f"{label}.gtm.example."
            query = dns.message.make_query(name, "A", use_edns=use_edns)
            for raw in (
                await raw_udp(node, query.to_wire(), wait=10),
                await raw_tcp(node, query.to_wire()),
            ):
                assert raw is not None
                reply = dns.message.from_wire(raw)
                assert reply.rcode() == dns.rcode.NXDOMAIN, name
                assert reply.question[0].name.to_text() == name
                (soa,) = reply.authority
                assert soa.name == apex and soa.rdtype == dns.rdatatype.SOA
                rdata: Any = soa[0]
                assert rdata.mname == dns.name.from_text("ns1.gtm.example.")
                assert rdata.rname == dns.name.from_text("hostmaster.gtm.example.")


def _four_nameservers(data: dict[str, Any]) -> None:
    data["zone"]["nameservers"] = [
        {"name": f"ns{i}.gtm.example.", "ipv4": [f"192.0.2.{50 + i}"], "ipv6": [f"2001:db8::{i}"]}
        for i in range(1, 5)
    ]


@pytest.mark.parametrize("transport", ["udp", "tcp"])
async def test_a_signed_answer_that_fits_512_octets_compressed_is_not_truncated(
    start_node: StartNode, tmp_path: Path, transport: str
) -> None:
    """Four nameservers with A and AAAA glue, signed: some 560 octets uncompressed without the
    glue's RRSIGs (more than a client of 512 takes; it went out TC), under 512 compressed. Over
    TCP the glue comes with its RRSIGs (RFC 4035 §3.1.1); to a client of 512 over UDP without
    them, which a short answer may leave out, rather than TC."""
    key = generate(tmp_path / "zone.key")
    node = await start_node(
        write_topology(tmp_path / "four.yaml", _four_nameservers), dnssec_key_file=key.path
    )
    query = dns.message.make_query("gtm.example.", "NS", use_edns=0, want_dnssec=True, payload=512)
    wire = query.to_wire()
    raw = await raw_udp(node, wire, wait=10) if transport == "udp" else await raw_tcp(node, wire)
    assert raw is not None
    reply = dns.message.from_wire(raw)
    assert not reply.flags & dns.flags.TC
    glue = [r for r in reply.additional if r.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)]
    signatures = [r for r in reply.additional if r.rdtype == dns.rdatatype.RRSIG]
    assert len(reply.answer) == 2 and len(glue) == 8
    if transport == "udp":
        assert len(raw) <= 512 < _uncompressed_size(reply)
        assert signatures == []
    else:
        assert len(signatures) == 8
    assert validate(reply, key) == 1  # the NS RRset, signed
