"""Differential fuzz: the ECS path (gtm.geodns.shapes) answers every input byte for byte as the
full path does, malformed ones included, or both send nothing.

For each example a fresh sender first teaches the node some valid ECS queries (IPv4 and IPv6
of several source lengths, with and without DO, cookies or NSID before the ECS, several buffer
sizes: the shapes its ECS path then knows; a query with a DNS cookie is never one, and the
server cookie, made for each sender's address, is the one part of two replies not compared),
then sends one query mutated from those (another subnet, bits past the prefix, bytes
appended, cut, changed or inserted, another header), or from a query of another shape or
without EDNS; another fresh sender sends the same bytes. The
node has never heard from the second, so it answers it on the full path; the first's takes the
ECS path wherever the query's bytes match one of its shapes. The replies must be equal, or both
absent. Whether a reply is absent is known without a timeout: the sender asks a sentinel
question next, whose answer comes after the mutated query's (one socket, one loop, answered in
order).

Hypothesis runs derandomized with a fixed example count (``EXAMPLES``) and no deadline, so CI
time is bounded and the run is the same every time. Inputs that ever differed are kept in
``ecs_differential_corpus.json`` and replayed by every run; a failing example's message is
the entry to add there.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import dns.edns
import dns.exception
import dns.flags
import dns.message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtm.geodns.shapes import Shape
from gtm.geodns.wire import Query, parse_query
from gtm.node import Node

from .conftest import StartNode, port_of

EXAMPLES = 1000
CORPUS = Path(__file__).with_name("ecs_differential_corpus.json")
_TIMEOUT = 10.0  # seconds for a reply that must come (the sentinel's): a stuck node fails

# Mostly the service name (the ECS path takes its queries), in two letter cases; a CNAME to
# it, a name that does not exist; mostly the address types.
NAMES = ("chat.gtm.example.",) * 4 + ("CHAT.gtm.EXAMPLE.", "api.gtm.example.", "nope.gtm.example.")
TYPES = ("A", "A", "A", "AAAA", "AAAA", "AAAA", "TXT", "SOA", "ANY")
# Client networks the test GeoIP file places (tests.support.geoip.WORLD), a narrow pair
# inside one /24 (answers differ by network there), and anywhere.
V4_BASES = (0xC6336400, 0xCB007100, 0x64400000, 0x64460000, 0x64480000, 0x51024500, 0)
V6_BASES = (0x20010DB8AAAA << 80, 0x20010DB8BBBB << 80, 0x2A028800 << 96, 0)
# Mostly the sources the ECS path takes (up to /24 and /56), whole octets or not; some past.
V4_SOURCES = (24, 24, 24, 8, 16, 20, 22, 25, 32, 0)
V6_SOURCES = (56, 56, 56, 32, 36, 48, 64, 128, 0)


@dataclass(frozen=True)
class Case:
    teach: tuple[bytes, ...]  # valid queries the sender sends node A first
    query: bytes  # then this, to both nodes

    def entry(self, reason: str) -> str:
        return json.dumps(
            {"reason": reason, "teach": [t.hex() for t in self.teach], "query": self.query.hex()}
        )


@st.composite
def addresses(draw: st.DrawFn, v6: bool, source: int) -> bytes:
    """A client address of ``source`` bits (the rest zero), in full length."""
    bits = 128 if v6 else 32
    base = draw(st.sampled_from(V6_BASES if v6 else V4_BASES))
    value = base | draw(st.integers(0, (1 << (bits - 32 if v6 else 16)) - 1)) << (72 if v6 else 8)
    value &= ((1 << bits) - 1) ^ ((1 << (bits - source)) - 1)
    return value.to_bytes(bits // 8, "big")


@st.composite
def valid_queries(draw: st.DrawFn) -> bytes:
    """A valid ECS query of one of the shapes resolvers send (and some they do not)."""
    v6 = draw(st.booleans())
    source = draw(st.sampled_from(V6_SOURCES if v6 else V4_SOURCES))
    packed = draw(addresses(v6, source))
    address = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, packed)
    options: list[dns.edns.Option] = []
    if draw(st.integers(0, 9)) == 0:
        # A cookie before the ECS: a client cookie, alone or with a server cookie of a
        # length RFC 7873 allows (not ours: a new one is handed out; the mutations make the
        # lengths it does not). The ECS path learns no such shape; both answer it the long way.
        size = draw(st.sampled_from((8, 8, 8, 24, 16, 40)))
        options.append(dns.edns.GenericOption(10, draw(st.binary(min_size=size, max_size=size))))
    if draw(st.integers(0, 3)) == 0:  # NSID asked (the node has a server id: answered)
        options.append(dns.edns.NSIDOption(b""))
    options.append(dns.edns.ECSOption(address, source))
    query = dns.message.make_query(
        draw(st.sampled_from(NAMES)),
        draw(st.sampled_from(TYPES)),
        use_edns=0,
        want_dnssec=draw(st.booleans()),
        payload=draw(st.sampled_from((512, 1232, 4096, 1400))),
        options=options,
    )
    if draw(st.booleans()):
        query.flags &= ~dns.flags.RD
    query.id = draw(st.integers(0, 0xFFFF))
    return query.to_wire()


@st.composite
def mutated(draw: st.DrawFn, wire: bytes) -> bytes:
    """``wire`` changed the ways a malformed or hostile query may be."""
    kind = draw(
        st.sampled_from(
            ("same",) * 4
            + ("address", "address", "append", "append", "cut", "byte", "insert", "header", "id")
        )
    )
    n = len(wire)
    if kind == "address":  # the last octets, anything (bits past the prefix too)
        k = draw(st.integers(1, min(16, n - 12)))
        return wire[:-k] + draw(st.binary(min_size=k, max_size=k))
    if kind == "append":
        return wire + draw(st.binary(min_size=1, max_size=16))
    if kind == "cut":
        return wire[: -draw(st.integers(1, n - 1))]
    if kind == "byte":
        at = draw(st.integers(2, n - 1))
        return wire[:at] + bytes((draw(st.integers(0, 255)),)) + wire[at + 1 :]
    if kind == "insert":
        at = draw(st.integers(12, n))
        return wire[:at] + draw(st.binary(min_size=1, max_size=8)) + wire[at:]
    if kind == "header":
        return wire[:2] + draw(st.binary(min_size=10, max_size=10)) + wire[12:]
    if kind == "id":
        return draw(st.binary(min_size=2, max_size=2)) + wire[2:]
    return wire


@st.composite
def sibling(draw: st.DrawFn, wire: bytes) -> bytes:
    """Another query of ``wire``'s shape: another ID and client subnet of the same source."""
    parsed = parse_query(wire)
    assert isinstance(parsed, Query) and parsed.edns is not None and parsed.edns.ecs
    ecs = parsed.edns.ecs
    size = len(ecs.address)
    if not size:
        return wire
    packed = draw(addresses(ecs.family == 2, ecs.source))
    qid = draw(st.binary(min_size=2, max_size=2))
    return qid + wire[2:-size] + packed[:size]


@st.composite
def plain_queries(draw: st.DrawFn) -> bytes:
    """A query without ECS: without EDNS, or with EDNS and DO (the ECS path never takes
    them; bytes appended to one can still end like a shape's address)."""
    query = dns.message.make_query(
        draw(st.sampled_from(NAMES)),
        draw(st.sampled_from(TYPES)),
        use_edns=draw(st.sampled_from((False, 0))),
        want_dnssec=draw(st.booleans()),
    )
    query.id = draw(st.integers(0, 0xFFFF))
    return query.to_wire()


@st.composite
def cases(draw: st.DrawFn) -> Case:
    teach = tuple(draw(st.lists(valid_queries(), min_size=1, max_size=4)))
    # Mostly a query of a taught shape with another subnet (what the ECS path answers), then
    # mutated or not; else a query of another shape altogether, or one without ECS, mutated.
    kind = draw(st.integers(0, 9))
    if kind < 8:
        base = draw(sibling(draw(st.sampled_from(teach))))
    elif kind == 8:
        base = draw(valid_queries())
    else:
        base = draw(plain_queries())
    return Case(teach, draw(mutated(base)))


_SENTINEL = dns.message.make_query("gtm.example.", "SOA", use_edns=False)
_SENTINEL.id = 0x5E57
SENTINEL = _SENTINEL.to_wire()


class Pair:
    """One node, asked by two fresh senders per case over UDP: the taught one, whose shapes
    its ECS path knows, and one it has never heard from (the full path)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.port = port_of(node)
        self.sentinel: bytes | None = None
        self._senders = itertools.count(1)

    def _exchange(self, sock: socket.socket, wire: bytes) -> bytes:
        sock.sendto(wire, ("127.0.0.1", self.port))
        reply, _ = sock.recvfrom(65535)
        return reply

    def _learn_sentinel(self) -> bytes:
        """The sentinel's answer, asked by a sender of its own: from each fresh sender the
        sentinel is then a first-level miss, queued for the slow path behind the query it
        follows when that one is queued too (gtm.geodns.admission answers cached queries as
        they are read, before the queued ones: a cached sentinel would overtake the query)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(_TIMEOUT)
            sock.bind(("127.0.0.9", 0))
            return self._exchange(sock, SENTINEL)

    def _ask(self, sock: socket.socket, wire: bytes) -> bytes | None:
        """The reply to ``wire``, or None when the node sent none."""
        sock.sendto(wire, ("127.0.0.1", self.port))
        sock.sendto(SENTINEL, ("127.0.0.1", self.port))
        first, _ = sock.recvfrom(65535)
        if first == self.sentinel and wire[2:] != SENTINEL[2:]:
            return None
        second, _ = sock.recvfrom(65535)
        assert second == self.sentinel, "the sentinel's answer, after the query's"
        return first

    def run(self, case: Case) -> tuple[bytes | None, bytes | None]:
        """(the taught sender's reply, the fresh sender's reply) to ``case.query``. Senders
        in 127.1.0.0/16 up, places the GeoIP file does not know: alike for every decision."""
        replies: list[bytes | None] = []
        for taught in (True, False):
            n = next(self._senders)
            host = f"127.{1 + (n >> 16) % 200}.{(n >> 8) & 0xFF}.{n & 0xFF}"
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.settimeout(_TIMEOUT)
                sock.bind((host, 0))
                if self.sentinel is None:
                    self.sentinel = self._learn_sentinel()
                if taught:
                    for wire in case.teach:
                        self._exchange(sock, wire)
                replies.append(self._ask(sock, case.query))
        return replies[0], replies[1]

    def check(self, case: Case) -> None:
        taught, full = (_blind_cookie(reply) for reply in self.run(case))
        assert taught == full, (
            "the ECS path and the full path differ; keep this in "
            f"{CORPUS.name}:\n{case.entry('found by the differential fuzz')}"
        )


def _blind_cookie(reply: bytes | None) -> bytes | None:
    """``reply`` with the server cookie of its COOKIE option zeroed: the two senders are two
    addresses, and a server cookie is made for its client's address (gtm.geodns.cookies), so
    it is the one part of the replies that must differ. The rest, the option's place and
    length and the client cookie echoed, is compared."""
    if reply is None:
        return None
    try:
        message = dns.message.from_wire(reply)
    except dns.exception.DNSException:  # a reply dnspython cannot read: compared as it is
        return reply
    for option in message.options:
        if option.otype == dns.edns.OptionType.COOKIE:
            data = option.to_wire()
            assert len(data) == 24, "a client cookie and a 16-octet server cookie"
            return reply.replace(data, data[:8] + bytes(16))
    return reply


def _corpus() -> list[tuple[str, Case]]:
    entries = json.loads(CORPUS.read_text())
    return [
        (
            e["reason"],
            Case(tuple(bytes.fromhex(t) for t in e["teach"]), bytes.fromhex(e["query"])),
        )
        for e in entries
    ]


async def _pair(start_node: StartNode) -> Pair:
    # No audit flush during the run: the node answers, the writer only collects.
    return Pair(
        await start_node(
            audit_flush_interval_s=3600, audit_journal_interval_s=0, dns_server_id="fuzz"
        )
    )


async def test_inputs_that_ever_differed_are_answered_alike(start_node: StartNode) -> None:
    pair = await _pair(start_node)

    def replay() -> None:
        for reason, case in _corpus():
            taught, full = pair.run(case)
            assert taught == full, reason

    await asyncio.to_thread(replay)


async def test_the_ecs_path_and_the_full_path_answer_fuzzed_queries_alike(
    start_node: StartNode,
) -> None:
    pair = await _pair(start_node)
    seen: list[int] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases())
    def differential(case: Case) -> None:
        seen.append(1)
        pair.check(case)

    # Watched, not changed: how many queries the ECS path answered (the rest it handed to the
    # full path), so a generator that stopped reaching it fails here instead of passing idly.
    responder = pair.node.dns.responder  # type: ignore[union-attr]
    shaped = responder._shaped
    answered = [0]

    def watched(
        shapes: dict[bytes, Shape], wire: bytes, host: str, known_only: bool = False
    ) -> bytes | None:
        out = shaped(shapes, wire, host, known_only)
        answered[0] += out is not None
        return out

    responder._shaped = watched  # type: ignore[method-assign]
    try:
        await asyncio.to_thread(differential)
    finally:
        del responder._shaped
    assert len(seen) >= EXAMPLES  # the size the report quotes: every example ran
    assert answered[0] >= EXAMPLES // 10, answered


def test_the_corpus_is_sound() -> None:
    """Each kept input is hex that parses into a teaching list of valid queries."""
    entries = _corpus()
    assert entries
    for reason, case in entries:
        assert reason
        assert all(isinstance(parse_query(t), Query) for t in case.teach), reason
