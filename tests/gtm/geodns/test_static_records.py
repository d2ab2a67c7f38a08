"""Static records (issue 17) served over real UDP and TCP sockets: dnspython, dig and kdig.

The node runs the demo topology (which ships an apex TXT, CAA, MX, a SRV, ``mail`` A/AAAA and
``api`` CNAME to the chat service) plus the records below: a CNAME chain, CNAMEs to the apex and
a nameserver, a static TXT at a service name, an empty non-terminal and a TXT too big for UDP.
"""

from __future__ import annotations

import asyncio
import shutil
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtm.decision.model import Outcome
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import parse_topology
from gtm.geodns.render import response
from gtm.geodns.static import build_static
from gtm.geodns.wire import Qtype, Query, parse_query
from gtm.geodns.zone import answer, nonexistent, zone_data
from tests.conftest import DEMO

from .conftest import StartNode, port_of, tcp, udp, write_topology

DE, US = "198.51.100.0", "203.0.113.0"
BIG_TEXT = "".join(chr(ord("a") + i % 26) for i in range(2000))  # 8 character-strings
EXTRA: list[dict[str, Any]] = [
    {"name": "c1", "type": "CNAME", "target": "c2.gtm.example."},
    {"name": "c2", "type": "CNAME", "target": "mail.gtm.example."},
    {"name": "to-apex", "type": "CNAME", "target": "gtm.example."},
    {"name": "to-ns", "type": "CNAME", "target": "ns1.gtm.example."},
    {"name": "to-eu", "type": "cname", "target": "chat.eu.gtm.example"},
    {"name": "chat", "type": "TXT", "text": ["service", "notes"]},
    {"name": "x.ent", "type": "TXT", "text": "below an empty non-terminal", "ttl": 120},
    {"name": "big", "type": "TXT", "text": BIG_TEXT},
]


def with_extra(data: dict[str, Any]) -> None:
    data["zone"]["records"] += EXTRA


def q(name: str, rdtype: str, ecs: tuple[str, int] | None = None, **kw: Any) -> dns.message.Message:
    options: list[dns.edns.Option] = [dns.edns.ECSOption(*ecs)] if ecs else []
    if ecs:
        kw.setdefault("use_edns", 0)
    return dns.message.make_query(name, rdtype, options=options, **kw)


def rrset(r: dns.message.Message, name: str, rdtype: str) -> dns.rrset.RRset:
    return r.find_rrset(
        r.answer, dns.name.from_text(name), dns.rdataclass.IN, dns.rdatatype.from_text(rdtype)
    )


def texts(rs: dns.rrset.RRset) -> set[str]:
    return {item.to_text() for item in rs}


def ecs_scope(r: dns.message.Message) -> int:
    (option,) = [o for o in r.options if isinstance(o, dns.edns.ECSOption)]
    return int(option.scopelen)


async def test_every_static_type_at_its_owner(start_node: StartNode, tmp_path: Path) -> None:
    node = await start_node(write_topology(tmp_path / "t.yaml", with_extra))
    txt = await udp(node, q("gtm.example.", "TXT"))
    assert txt.rcode() == dns.rcode.NOERROR and txt.flags & dns.flags.AA
    assert texts(rrset(txt, "gtm.example.", "TXT")) == {
        '"gtm-site-verification=3f9c2a61d0b7e845"',
        '"v=spf1 mx -all"',
    }
    assert rrset(txt, "gtm.example.", "TXT").ttl == 3600  # the zone's TTL by default
    caa = await udp(node, q("gtm.example.", "CAA"))
    assert texts(rrset(caa, "gtm.example.", "CAA")) == {
        '0 issue "letsencrypt.org"',
        '0 iodef "mailto:security@gtm.example"',
    }
    mx = await udp(node, q("gtm.example.", "MX"))
    assert texts(rrset(mx, "gtm.example.", "MX")) == {"10 mail.gtm.example."}
    # Additional section processing: the exchange's in-zone addresses.
    extra = {(rs.name.to_text(), rs.rdtype, item.to_text()) for rs in mx.additional for item in rs}
    assert extra == {
        ("mail.gtm.example.", dns.rdatatype.A, "192.0.2.25"),
        ("mail.gtm.example.", dns.rdatatype.AAAA, "2001:db8::25"),
    }
    srv = await tcp(node, q("_submission._tcp.gtm.example.", "SRV"))
    assert texts(rrset(srv, "_submission._tcp.gtm.example.", "SRV")) == {
        "0 1 587 mail.gtm.example."
    }
    assert {rs.name.to_text() for rs in srv.additional} == {"mail.gtm.example."}
    a = await udp(node, q("MAIL.gtm.example.", "A"))
    assert a.answer[0].name.to_text() == "MAIL.gtm.example."  # the question's case echoed
    assert texts(a.answer[0]) == {"192.0.2.25"}
    aaaa = await udp(node, q("mail.gtm.example.", "AAAA"))
    assert texts(rrset(aaaa, "mail.gtm.example.", "AAAA")) == {"2001:db8::25"}
    cname = await udp(node, q("api.gtm.example.", "CNAME"))
    assert [rs.rdtype for rs in cname.answer] == [dns.rdatatype.CNAME]  # not followed
    assert texts(cname.answer[0]) == {"chat.gtm.example."}
    ttl = await udp(node, q("x.ent.gtm.example.", "TXT"))
    assert ttl.answer[0].ttl == 120
    # A static type at a service name, beside its decided addresses.
    notes = await udp(node, q("chat.gtm.example.", "TXT"))
    assert texts(notes.answer[0]) == {'"service" "notes"'}
    chat = await udp(node, q("chat.gtm.example.", "A", ecs=(DE, 24)))
    assert chat.answer[0].rdtype == dns.rdatatype.A


async def test_apex_records_coexist_with_soa_and_ns(start_node: StartNode) -> None:
    node = await start_node()
    soa = await udp(node, q("gtm.example.", "SOA"))
    assert soa.answer[0].rdtype == dns.rdatatype.SOA
    ns = await udp(node, q("gtm.example.", "NS"))
    assert texts(ns.answer[0]) == {"ns1.gtm.example.", "ns2.gtm.example."}
    anything = await udp(node, q("gtm.example.", "ANY"))
    assert [rs.rdtype for rs in anything.answer] == [dns.rdatatype.SOA]  # RFC 8482, unchanged
    a = await udp(node, q("gtm.example.", "A"))  # no static A at the apex: NODATA
    assert a.rcode() == dns.rcode.NOERROR and not a.answer
    assert a.authority[0].rdtype == dns.rdatatype.SOA


async def test_cname_chains_inside_the_zone(start_node: StartNode, tmp_path: Path) -> None:
    node = await start_node(write_topology(tmp_path / "t.yaml", with_extra))
    chain = await udp(node, q("c1.gtm.example.", "A"))
    assert chain.rcode() == dns.rcode.NOERROR and chain.flags & dns.flags.AA
    assert [(rs.name.to_text(), rs.rdtype) for rs in chain.answer] == [
        ("c1.gtm.example.", dns.rdatatype.CNAME),
        ("c2.gtm.example.", dns.rdatatype.CNAME),
        ("mail.gtm.example.", dns.rdatatype.A),
    ]
    # The end has no such type: NODATA after the chain, with the SOA.
    nodata = await udp(node, q("c1.gtm.example.", "MX"))
    assert nodata.rcode() == dns.rcode.NOERROR and len(nodata.answer) == 2
    assert nodata.authority[0].rdtype == dns.rdatatype.SOA
    apex = await udp(node, q("to-apex.gtm.example.", "MX"))
    assert [rs.rdtype for rs in apex.answer] == [dns.rdatatype.CNAME, dns.rdatatype.MX]
    assert {rs.name.to_text() for rs in apex.additional} == {"mail.gtm.example."}
    soa = await udp(node, q("to-apex.gtm.example.", "SOA"))
    assert soa.answer[1].rdtype == dns.rdatatype.SOA
    assert soa.answer[1].name.to_text() == "gtm.example."
    glue = await udp(node, q("to-ns.gtm.example.", "AAAA"))
    assert texts(rrset(glue, "ns1.gtm.example.", "AAAA")) == {"2001:db8::53"}
    # Leaving the zone: the CNAME alone, the resolver follows it.
    out = await udp(node, q("docs.gtm.example.", "A"))
    assert out.rcode() == dns.rcode.NOERROR and len(out.answer) == 1
    assert texts(out.answer[0]) == {"docs.example.net."} and not out.authority
    anything = await udp(node, q("c1.gtm.example.", "ANY"))
    assert [rs.rdtype for rs in anything.answer] == [dns.rdatatype.CNAME]


async def test_a_cname_to_a_service_gets_the_services_decision(
    start_node: StartNode, tmp_path: Path
) -> None:
    node = await start_node(write_topology(tmp_path / "t.yaml", with_extra))
    for ecs in ((DE, 24), (US, 24)):
        direct = await udp(node, q("chat.gtm.example.", "A", ecs=ecs))
        via = await udp(node, q("api.gtm.example.", "A", ecs=ecs))
        assert [(rs.name.to_text(), rs.rdtype) for rs in via.answer] == [
            ("api.gtm.example.", dns.rdatatype.CNAME),
            ("chat.gtm.example.", dns.rdatatype.A),
        ]
        assert texts(via.answer[1]) == texts(direct.answer[0])
        assert via.answer[1].ttl == direct.answer[0].ttl == 30
        assert ecs_scope(via) == ecs_scope(direct) > 0  # located, as the service's own answer
    # Residency holds through the CNAME: EU personal data from a US network stays in the EU.
    eu = await udp(node, q("to-eu.gtm.example.", "A", ecs=(US, 24)))
    assert texts(eu.answer[1]) <= {"192.0.2.30", "192.0.2.40"}
    # A type no decision gives, through the CNAME: NODATA from everywhere (scope 0).
    mx = await udp(node, q("api.gtm.example.", "MX", ecs=(DE, 24)))
    assert mx.rcode() == dns.rcode.NOERROR and len(mx.answer) == 1 and ecs_scope(mx) == 0


def test_cname_answers_are_audited_with_the_decision(snapshot: Snapshot) -> None:
    """The demo's api -> chat: the row names the name asked, the service and the addresses."""

    def ask(name: str, rdtype: str) -> Any:
        parsed = parse_query(q(name, rdtype, ecs=(DE, 24)).to_wire())
        assert isinstance(parsed, Query)
        return answer(parsed, ip_address("192.0.2.1"), snapshot, 1000.0, 1232)

    via = ask("api.gtm.example.", "A")
    assert via.decision is not None and via.decision.outcome == Outcome.ANSWER
    assert via.record.name == "api.gtm.example." and via.record.service == "chat"
    assert via.record.answer[0] == "chat.gtm.example." and via.record.answer[1:]
    static = ask("gtm.example.", "MX")
    assert static.decision is None and static.record.outcome == "zone"
    assert static.record.answer == ("10 mail.gtm.example.",)
    assert static.record.client_network == "198.51.100.0/24"  # per network, as the apex's
    nodata = ask("mail.gtm.example.", "TXT")
    assert nodata.record.outcome == "nodata"


async def test_nodata_nxdomain_and_empty_non_terminals(
    start_node: StartNode, tmp_path: Path
) -> None:
    node = await start_node(write_topology(tmp_path / "t.yaml", with_extra))
    for name, rdtype in (
        ("mail.gtm.example.", "TXT"),  # exists, not that type
        ("ent.gtm.example.", "TXT"),  # empty non-terminal (RFC 8020)
        ("ent.gtm.example.", "A"),
        ("_tcp.gtm.example.", "SRV"),  # empty non-terminal above the SRV owner
        ("big.gtm.example.", "A"),
    ):
        r = await udp(node, q(name, rdtype))
        assert r.rcode() == dns.rcode.NOERROR and not r.answer, (name, rdtype)
        assert r.authority[0].rdtype == dns.rdatatype.SOA and r.authority[0].ttl == 60
    for name in (
        "x.mail.gtm.example.",
        "y.ent.gtm.example.",
        "_udp.gtm.example.",
        "www.gtm.example.",
    ):
        r = await udp(node, q(name, "A"))
        assert r.rcode() == dns.rcode.NXDOMAIN, name
        assert r.authority[0].rdtype == dns.rdatatype.SOA
    anything = await udp(node, q("mail.gtm.example.", "ANY"))  # RFC 8482: one RRset
    assert [rs.rdtype for rs in anything.answer] == [dns.rdatatype.A]


async def test_a_big_txt_is_truncated_over_udp_and_whole_over_tcp(
    start_node: StartNode, tmp_path: Path
) -> None:
    node = await start_node(write_topology(tmp_path / "t.yaml", with_extra))
    cut = await udp(node, q("big.gtm.example.", "TXT", use_edns=0, payload=1232))
    assert cut.flags & dns.flags.TC and not cut.answer
    plain = await udp(node, q("big.gtm.example.", "TXT"))  # no EDNS: 512
    assert plain.flags & dns.flags.TC
    whole = await tcp(node, q("big.gtm.example.", "TXT"))
    assert not whole.flags & dns.flags.TC
    (item,) = whole.answer[0]
    assert [len(s) for s in item.strings] == [255] * 7 + [215]
    assert b"".join(item.strings).decode() == BIG_TEXT


def test_mx_addresses_are_dropped_not_truncated_when_only_they_do_not_fit() -> None:
    question = b"\x00\x00\x01\x00\x01"
    full = response(
        1, 0, 0, authoritative=True, question=question, answer=[b"x" * 400], additional=[b"y" * 200]
    )
    assert len(full) > 512
    kept = response(
        1,
        0,
        0,
        authoritative=True,
        question=question,
        answer=[b"x" * 400],
        additional=[b"y" * 200],
        limit=512,
        optional_additional=True,
    )
    assert not kept[2] & 0x02 and kept[10:12] == b"\x00\x00" and kept[6:8] == b"\x00\x01"
    cut = response(
        1,
        0,
        0,
        authoritative=True,
        question=question,
        answer=[b"x" * 400],
        additional=[b"y" * 200],
        limit=512,
    )
    assert cut[2] & 0x02  # glue-like additional records stay all or nothing


def test_types_at_lists_the_static_types(snapshot: Snapshot) -> None:
    zone = zone_data(snapshot.topology)
    assert zone.types_at("gtm.example.") == {Qtype.SOA, Qtype.NS, Qtype.TXT, Qtype.CAA, Qtype.MX}
    assert zone.types_at("gtm.example") == zone.types_at("gtm.example.")
    assert zone.types_at("mail.gtm.example.") == {Qtype.A, Qtype.AAAA}
    assert zone.types_at("_submission._tcp.gtm.example.") == {Qtype.SRV}
    assert zone.types_at("api.gtm.example.") == {Qtype.CNAME}  # a service's CNAME: CNAME only
    assert zone.types_at("docs.gtm.example.") == {Qtype.CNAME}
    assert zone.types_at("chat.gtm.example.") == {Qtype.A, Qtype.AAAA}
    assert zone.types_at("_tcp.gtm.example.") == frozenset()  # empty non-terminal
    assert "_tcp.gtm.example." in zone.interior
    assert zone.types_at("nope.gtm.example.") == frozenset()


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.text(max_size=1500), st.lists(st.text(max_size=60), min_size=1, max_size=5)))
def test_txt_round_trips_through_the_wire(text: str | list[str]) -> None:
    data = {
        **_demo(),
        "zone": {**_demo()["zone"], "records": [{"name": "t", "type": "TXT", "text": text}]},
    }
    topology = parse_topology(data)
    rrset_ = build_static(topology).rrsets["t.gtm.example.", Qtype.TXT]
    wire = response(7, 0, 0, authoritative=True, question=_QUESTION, answer=list(rrset_.records))
    (item,) = dns.message.from_wire(wire).answer[0]
    if isinstance(text, str):
        assert b"".join(item.strings) == text.encode()
        assert all(len(s) == 255 for s in item.strings[:-1])
    else:
        assert list(item.strings) == [s.encode() for s in text]


_QUESTION = b"\x01t\x03gtm\x07example\x00\x00\x10\x00\x01"
_DEMO: list[dict[str, Any]] = []


def _demo() -> dict[str, Any]:
    if not _DEMO:
        import yaml

        _DEMO.append(yaml.safe_load(DEMO.read_text()))
    return _DEMO[0]


async def _tool(tool: str, port: int, *args: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    retries = "+tries=1" if tool == "dig" else "+retry=0"
    proc = await asyncio.create_subprocess_exec(
        path,
        "@127.0.0.1",
        "-p",
        str(port),
        "+time=2",
        retries,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    return out.decode()


async def test_dig_and_kdig_parse_the_static_records(start_node: StartNode, tmp_path: Path) -> None:
    node = await start_node(write_topology(tmp_path / "t.yaml", with_extra))
    port = port_of(node)
    for tool in ("dig", "kdig"):
        txt = await _tool(tool, port, "gtm.example", "TXT", "+short")
        assert set(txt.split("\n")) - {""} == {
            '"gtm-site-verification=3f9c2a61d0b7e845"',
            '"v=spf1 mx -all"',
        }, tool
        caa = await _tool(tool, port, "gtm.example", "CAA", "+short")
        assert '0 issue "letsencrypt.org"' in caa, (tool, caa)
        assert '0 iodef "mailto:security@gtm.example"' in caa, (tool, caa)
        mx = await _tool(tool, port, "gtm.example", "MX", "+short")
        assert mx.strip() == "10 mail.gtm.example.", (tool, mx)
        srv = await _tool(tool, port, "_submission._tcp.gtm.example", "SRV", "+short")
        assert srv.strip() == "0 1 587 mail.gtm.example.", (tool, srv)
        chain = await _tool(tool, port, "c1.gtm.example", "A", "+short")
        assert chain.split() == ["c2.gtm.example.", "mail.gtm.example.", "192.0.2.25"], tool
        # A big TXT: truncated over UDP, the tool retries over TCP by itself.
        big = await _tool(tool, port, "big.gtm.example", "TXT", "+short")
        strings = big.replace('" "', "|").strip().strip('"').split("|")
        assert "".join(strings) == BIG_TEXT, (tool, big[:200])
    full = await _tool("dig", port, "gtm.example", "MX", "+norec")
    assert "status: NOERROR" in full and "ADDITIONAL: 3" in full  # A, AAAA and the OPT
    nodata = await _tool("kdig", port, "ent.gtm.example", "TXT")
    assert "status: NOERROR" in nodata and "ANSWER: 0" in nodata


def test_nonexistent_says_nxdomain_exactly_where_answer_does(snapshot: Snapshot) -> None:
    """The responder answers names that do not exist from one rendering
    (gtm.geodns.zone.nonexistent): it must pick out exactly the queries answer() gives
    NXDOMAIN, for every name the zone holds, below them, beside them and outside it."""
    zone = zone_data(snapshot.topology)
    held = {zone.apex, *zone.services, *zone.static.types, *zone.glue, *zone.interior}
    names = set(held)
    for name in held:
        names |= {"x." + name, "a.b." + name, name.upper()}
    names |= {"nope." + zone.apex, "example.net.", "gtm.example.net.", "."}
    types = ("A", "AAAA", "TXT", "MX", "SRV", "CNAME", "SOA", "NS", "ANY", "CAA", "DNSKEY")
    seen_nx = seen_other = 0
    for name in sorted(names):
        for rdtype in (*types, "AXFR", "TYPE1234"):
            for rdclass in ("IN", "CH", "ANY"):
                message = dns.message.make_query(name, rdtype, rdclass)
                parsed = parse_query(message.to_wire())
                assert isinstance(parsed, Query)
                full = answer(parsed, ip_address("192.0.2.1"), snapshot, 1000.0, 512)
                is_nx = full.rcode == dns.rcode.NXDOMAIN
                assert nonexistent(parsed, zone) == is_nx, (name, rdtype, rdclass)
                seen_nx += is_nx
                seen_other += not is_nx
    assert seen_nx and seen_other
