"""The query parser: every malformation the listeners must survive, and fuzzing."""

from __future__ import annotations

import struct

import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rdatatype
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtm.geodns.wire import Query, Rcode, Reject, cookie_option, parse_query


def wire_of(name: str = "chat.gtm.example.", rdtype: str = "A", **kw: object) -> bytes:
    return dns.message.make_query(name, rdtype, **kw).to_wire()  # type: ignore[arg-type]


def header(
    qid: int = 0x1234, flags: int = 0, qd: int = 1, an: int = 0, ns: int = 0, ar: int = 0
) -> bytes:
    return struct.pack("!HHHHHH", qid, flags, qd, an, ns, ar)


QUESTION = b"\x04chat\x03gtm\x07example\x00\x00\x01\x00\x01"


def test_plain_query() -> None:
    q = parse_query(wire_of("Chat.GTM.example.", "AAAA", use_edns=False))
    assert isinstance(q, Query)
    assert q.qname_text == "chat.gtm.example." and q.qtype == 28 and q.qclass == 1
    assert q.qname == b"\x04Chat\x03GTM\x07example\x00"  # case kept for the echo
    assert q.edns is None and q.rd


def test_edns_and_client_subnet() -> None:
    ecs = dns.edns.ECSOption("198.51.100.0", 24)
    q = parse_query(wire_of(use_edns=0, payload=4096, options=[ecs], want_dnssec=True))
    assert isinstance(q, Query) and q.edns is not None
    assert q.edns.udp_size == 4096 and q.edns.do and q.edns.version == 0
    assert q.edns.ecs is not None and str(q.edns.ecs.network) == "198.51.100.0/24"
    tiny = parse_query(wire_of(use_edns=0, payload=100))
    assert isinstance(tiny, Query) and tiny.edns is not None and tiny.edns.udp_size == 512


def test_unknown_options_are_skipped() -> None:
    unknown = dns.edns.GenericOption(65001, b"\x01\x02\x03")
    cookie = dns.edns.GenericOption(10, b"12345678")
    q = parse_query(wire_of(use_edns=0, options=[unknown, cookie]))
    assert isinstance(q, Query) and q.edns is not None and q.edns.ecs is None


def reject(wire: bytes) -> Reject:
    r = parse_query(wire)
    assert isinstance(r, Reject), r
    return r


@pytest.mark.parametrize("wire", [b"", b"\x12", b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00"])
def test_no_header_is_dropped(wire: bytes) -> None:
    assert reject(wire).drop


def test_responses_are_dropped_never_answered() -> None:
    assert reject(header(flags=0x8000) + QUESTION).drop


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (header(qd=0), "QDCOUNT is 0"),
        (header(qd=2) + QUESTION + QUESTION, "QDCOUNT is 2"),
        (header() + b"\x04chat", "past the end"),
        (header() + b"\x04chat\x03gtm\x07example\x00\x00\x01", "truncated question"),
        (header() + b"\xc0\x0c\x00\x01\x00\x01", "does not point backwards"),  # points at itself
        (header() + b"\x01a\xc0\x0c\x00\x01\x00\x01", "does not point backwards"),  # loop
        (header() + b"\x41" + b"a" * 65 + b"\x00\x00\x01\x00\x01", "unknown label type"),
        (header() + (b"\x3f" + b"a" * 63) * 4 + b"\x00\x00\x01\x00\x01", "longer than 255"),
        (header() + QUESTION + b"junk", "trailing bytes"),
    ],
)
def test_malformed_questions_get_formerr_with_the_id(wire: bytes, reason: str) -> None:
    r = reject(wire)
    assert r.rcode is Rcode.FORMERR and r.id == 0x1234
    assert reason in r.reason


def opt(options: bytes = b"", udp: int = 1232, ttl: int = 0) -> bytes:
    return b"\x00" + struct.pack("!HHIH", 41, udp, ttl, len(options)) + options


def ecs(family: int, source: int, address: bytes) -> bytes:
    body = struct.pack("!HBB", family, source, 0) + address
    return struct.pack("!HH", 8, len(body)) + body


@pytest.mark.parametrize(
    ("additional", "count", "reason"),
    [
        (opt() + opt(), 2, "more than one OPT"),
        (opt(struct.pack("!HH", 3, 10) + b"abc"), 1, "runs past the OPT record"),
        (opt(b"\x00\x08\x00"), 1, "truncated EDNS option header"),
        (opt(ecs(3, 24, b"\xc6\x33\x64")), 1, "family 3"),
        (opt(ecs(1, 24, b"\xc6\x33\x64\x01")), 1, "does not match the source prefix"),
        (opt(ecs(1, 20, b"\xc6\x33\x6f")), 1, "bits set beyond the source prefix"),
        (opt(ecs(1, 33, b"\xc6\x33\x64\x01\x01")), 1, "longer than the address"),
        (opt(ecs(1, 24, b"\xc6\x33\x64") + ecs(1, 24, b"\xc6\x33\x64")), 1, "more than one ECS"),
        (b"\x01x\x00" + struct.pack("!HHIH", 41, 512, 0, 0), 1, "not at the root"),
        (opt()[:-1], 1, "truncated additional"),
    ],
)
def test_bad_opt_records_get_formerr(additional: bytes, count: int, reason: str) -> None:
    r = reject(header(ar=count) + QUESTION + additional)
    assert r.rcode is Rcode.FORMERR and r.id == 0x1234 and reason in r.reason
    assert r.qname == b"\x04chat\x03gtm\x07example\x00"  # the question is echoed


def test_other_opcodes_are_not_implemented() -> None:
    r = reject(header(flags=15 << 11) + QUESTION)
    assert r.rcode is Rcode.NOTIMP and r.qname is not None
    q = dns.message.make_query("chat.gtm.example.", "SOA")
    q.set_opcode(dns.opcode.NOTIFY)
    assert reject(q.to_wire()).rcode is Rcode.NOTIMP


def test_edns_version_above_zero_is_badvers() -> None:
    r = reject(wire_of(use_edns=1))
    assert r.rcode is Rcode.BADVERS and r.edns is not None and r.edns.version == 1


def test_unknown_flags_and_bits_are_accepted() -> None:
    # Z bit, AD, CD and an unknown EDNS flag: answered, not rejected (RFC 8906).
    m = dns.message.make_query("chat.gtm.example.", "A", use_edns=0, ednsflags=0x4000)
    m.flags |= dns.flags.AD | dns.flags.CD | 0x0040
    q = parse_query(m.to_wire())
    assert isinstance(q, Query) and q.cd


# -- fuzzing -----------------------------------------------------------------------------------


def assert_verdict(data: bytes, result: Query | Reject) -> None:
    """What the listeners do with any packet: drop it when no header can be read or it is a
    response (QR set: answering responses invites loops); otherwise answer it, an error with
    the query's own ID echoed."""
    assert isinstance(result, Query | Reject)
    if len(data) < 12 or data[2] & 0x80:
        assert isinstance(result, Reject) and result.drop, (data, result)
    elif isinstance(result, Reject):
        assert not result.drop and result.id == int.from_bytes(data[:2], "big"), (data, result)
        assert result.rcode in (Rcode.FORMERR, Rcode.NOTIMP, Rcode.BADVERS, Rcode.REFUSED)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_raise(data: bytes) -> None:
    assert_verdict(data, parse_query(data))


def mutated(base: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    """``base`` with each (position, octet) of ``edits`` written where it falls inside, then
    its last ``cut`` octets cut (unless that would leave nothing)."""
    data = bytearray(base)
    for pos, value in edits:
        if pos < len(data):
            data[pos] = value
    return bytes(data[: len(data) - cut] if cut < len(data) else data)


VALID = [
    wire_of(),
    wire_of(use_edns=0, options=[dns.edns.ECSOption("2001:db8::", 48)]),
    wire_of("gtm.example.", "NS", use_edns=0, want_dnssec=True),
]


@settings(max_examples=3000, deadline=None)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 599), st.integers(0, 255)), max_size=6),
    st.integers(0, 80),
)
def test_mutated_queries_never_raise(base: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    packet = mutated(base, edits, cut)
    assert_verdict(packet, parse_query(packet))


labels = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-",
    min_size=1,
    max_size=20,
)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(labels, min_size=1, max_size=5),
    st.sampled_from(["A", "AAAA", "SOA", "NS", "MX", "TXT", "ANY", "TYPE999"]),
    st.booleans(),
    st.one_of(st.none(), st.integers(0, 24)),
    st.booleans(),
)
def test_what_dnspython_writes_we_read_the_same(
    parts: list[str], rdtype: str, edns: bool, source: int | None, do: bool
) -> None:
    name = ".".join(parts) + ".gtm.example."
    options = [dns.edns.ECSOption("198.51.100.0", source)] if edns and source is not None else []
    m = dns.message.make_query(
        name, rdtype, use_edns=0 if edns else False, options=options, want_dnssec=do and edns
    )
    q = parse_query(m.to_wire())
    assert isinstance(q, Query)
    assert q.qname_text == name.lower() and q.qtype == dns.rdatatype.from_text(rdtype)
    assert (q.edns is not None) == edns
    if q.edns is not None:
        assert q.edns.do == do
        if source is not None:
            assert q.edns.ecs is not None and q.edns.ecs.source == source


@settings(max_examples=3000, deadline=None)
@given(
    st.sampled_from([*VALID, wire_of(use_edns=1), wire_of("A.b.GTM.example.", "TXT")]),
    st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=3),
    st.integers(0, 20),
)
def test_the_short_path_agrees_with_the_general_parser(
    base: bytes, edits: list[tuple[int, int]], cut: int
) -> None:
    from gtm.geodns.wire import _parse_general

    packet = mutated(base, edits, cut)
    general = _parse_general(packet)
    assert parse_query(packet) == general
    assert parse_query(packet) == general  # again, now with the memos primed


COOKIED = [
    wire_of(use_edns=0, options=[dns.edns.GenericOption(10, bytes(range(8)))]),
    wire_of(use_edns=0, options=[dns.edns.GenericOption(10, bytes(range(24)))]),
    wire_of(
        "a.b.gtm.example.",
        "AAAA",
        use_edns=0,
        want_dnssec=True,
        options=[
            dns.edns.GenericOption(3, b""),
            dns.edns.GenericOption(10, bytes(range(24))),
            dns.edns.ECSOption("198.51.100.0", 24),
        ],
    ),
]


@settings(max_examples=3000, deadline=None)
@given(
    st.sampled_from(COOKIED),
    st.lists(st.tuples(st.integers(0, 90), st.integers(0, 255)), max_size=3),
    st.integers(0, 20),
)
def test_the_cookie_read_alone_is_the_one_the_parser_reads(
    base: bytes, edits: list[tuple[int, int]], cut: int
) -> None:
    """cookie_option (a protected socket's check behind a flood) never reads a cookie the
    parser would not, and misses none the parser reads in a plain query: for any mutation of
    real cookie queries, whatever it finds is the parsed query's own cookie."""
    packet = mutated(base, edits, cut)
    found = cookie_option(packet)
    parsed = parse_query(packet)
    if found is not None:
        assert isinstance(parsed, Query | Reject) and parsed.edns is not None
        assert parsed.edns.cookie == found, (packet, parsed)
    if not edits and not cut:
        assert found is not None
    # The other way: a plain query (one question as sent, an OPT alone after it) whose cookie
    # the parser reads is never one cookie_option misses (it would be dropped as unproven).
    if (
        isinstance(parsed, Query)
        and parsed.edns is not None
        and parsed.edns.cookie is not None
        and packet[4:12] == b"\x00\x01\x00\x00\x00\x00\x00\x01"
        and packet[12 : 12 + len(parsed.qname)] == parsed.qname
    ):
        assert found == parsed.edns.cookie, packet
