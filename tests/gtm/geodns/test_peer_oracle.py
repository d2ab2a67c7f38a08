"""A peer as the oracle (issue 32): Knot DNS (Debian package knot, installed by ``.ci/run``)
serves the demo zone as a zone file, and GTM's answers are compared with Knot's for a matrix of
names x types x EDNS variants (none, EDNS, DO, DO with a 512-byte buffer) x UDP and TCP, with
the zone signed (Knot serves it signed by dnspython with GTM's own key, so the keys, key tags
and signers are the same) and unsigned. Response code, flags, EDNS and the three sections must
agree record for record (owner, type, TTL, data; an RRSIG by its fields, never its signature
bytes or validity times), except for the differences listed in ``DIFFERENCES``, each with its
reason; each is counted, and one that never applies fails the test (a stale excuse), but for
the two that depend on message sizes only.

The service names are geo answers: the zone file gives them the addresses GTM gives a client
on loopback (asked first), so their records compare like any other.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from gtm.geodns.dnssec_keys import generate
from tests.support import dns_peers
from tests.support.dns_peers import APEX

from .test_dig import serve_env

NAMES = [
    APEX,
    "chat.gtm.example.",  # a service name
    "chat.eu.gtm.example.",
    "eu.gtm.example.",  # an empty non-terminal
    "api.gtm.example.",  # CNAME into a service name
    "docs.gtm.example.",  # CNAME out of the zone
    "mail.gtm.example.",  # static A/AAAA
    "_submission._tcp.gtm.example.",  # SRV
    "_tcp.gtm.example.",  # an empty non-terminal
    "ns1.gtm.example.",  # a nameserver's glue
    "nope.gtm.example.",  # no such name
    "x.y.nope.gtm.example.",
    "example.net.",  # outside the zone
]
TYPES = [
    "A", "AAAA", "NS", "SOA", "TXT", "MX", "SRV", "CAA", "CNAME", "DNSKEY", "DS", "NSEC",
    "RRSIG", "ANY", "HINFO", "CDS", "TYPE65534", "TYPE128",
]  # fmt: skip
VARIANTS = ("noedns", "edns", "do", "do512")
TRANSPORTS = ("udp", "tcp")


# -- what is compared -------------------------------------------------------------------------

Record = tuple[str, str, int, str]  # owner (lower case), type, TTL, data


@dataclass
class View:
    """A response as compared: everything but IDs, order and signature bytes."""

    rcode: str
    flags: str
    edns: tuple[int, int, int] | None  # version, flags (DO), payload
    answer: list[Record]
    authority: list[Record]
    additional: list[Record]
    notes: list[str] = field(default_factory=list)


def _record(owner: str, rdtype: int, ttl: int, rdata: object) -> Record:
    kind = dns.rdatatype.to_text(rdtype)
    if rdtype == dns.rdatatype.RRSIG:
        r = rdata  # fields, not the signature or its validity (made at each server's time)
        data = (
            f"{dns.rdatatype.to_text(r.type_covered)} {r.algorithm} {r.labels} "
            f"{r.original_ttl} {r.key_tag} {r.signer}"
        )
    else:
        data = rdata.to_text()
    return (owner.lower(), kind, ttl, data)


def view(r: dns.message.Message) -> View:
    def section(rrsets: list[dns.rrset.RRset]) -> list[Record]:
        return sorted(
            _record(rrset.name.to_text(), rrset.rdtype, rrset.ttl, rd)
            for rrset in rrsets
            for rd in rrset
        )

    edns = (r.edns, r.ednsflags & 0xFFFF, r.payload) if r.edns >= 0 else None
    return View(
        dns.rcode.to_text(r.rcode()),
        dns.flags.to_text(r.flags),
        edns,
        section(r.answer),
        section(r.authority),
        section(r.additional),
    )


@dataclass(frozen=True)
class Asked:
    name: str
    rdtype: str
    variant: str
    transport: str
    signed: bool

    @property
    def do(self) -> bool:
        return self.variant in ("do", "do512")


def ask(port: int, q: Asked) -> dns.message.Message:
    if q.variant == "noedns":
        query = dns.message.make_query(q.name, q.rdtype, use_edns=False)
    else:
        payload = 512 if q.variant == "do512" else 1232
        query = dns.message.make_query(
            q.name, q.rdtype, use_edns=0, payload=payload, want_dnssec=q.do
        )
    query.flags &= ~dns.flags.RD  # a resolver's question to an authority
    if q.transport == "tcp":
        return dns.query.tcp(query, "127.0.0.1", port=port, timeout=5)
    return dns.query.udp(query, "127.0.0.1", port=port, timeout=5)


# -- the documented differences ---------------------------------------------------------------


def _nsecs(records: list[Record]) -> dict[str, set[str]]:
    """NSEC owner -> the types its bitmap lists."""
    return {owner: set(data.split()[1:]) for owner, kind, _, data in records if kind == "NSEC"}


def _without_denial(records: list[Record]) -> list[Record]:
    return [
        r for r in records if r[1] != "NSEC" and not (r[1] == "RRSIG" and r[3].startswith("NSEC "))
    ]


def _own_records_only(v: View, name: str, kind: str) -> bool:
    return bool(v.answer) and all(o == name.lower() and k == kind for o, k, _, _ in v.answer)


DIFFERENCES = {
    "truncation": "over UDP, when either answer is truncated: the sizes differ by design (a "
    "black lie is one NSEC where Knot sends two, and Knot compresses every name where GTM "
    "does not yet); the same query over TCP is compared in full",
    "meta type asked": "TYPE128 (NXNAME) is a meta type: GTM refuses it (NOTIMP, FORMERR per "
    "RFC 9824 §3.5); Knot 3.2 predates NXNAME and answers it as a data type",
    "black lie": "a name that does not exist, asked with DO of the signed zone: GTM says "
    "NOERROR with an NSEC at the name listing NXNAME (RFC 9824 compact denial), Knot "
    "NXDOMAIN with its chain's covering NSECs",
    "denial NSECs": "negative answers with DO: Knot's NSECs are its chain's (next name the next "
    "owner; covering ones for NXDOMAIN and empty non-terminals), GTM's one NSEC at the name "
    "(next name \\000.name). Dropped from both sides once an NSEC both have at the same owner "
    "is checked to list the same types",
    "own NSEC": "NSEC or RRSIG asked where Knot's chain has no NSEC (an empty non-terminal; a "
    "name that does not exist, with DO): under compact denial every name GTM admits to has "
    "its own NSEC, so GTM answers it (or its RRSIG); checked to be that, and nothing else",
    "NSEC next name": "NSEC asked at a name both hold: the same owner and types; the next "
    "name is the chain's at Knot, \\000.name at GTM",
    "RRSIG asked": "one RRSIG RRset answers (as Knot does, and RFC 8482 for ANY): Knot's over "
    "the first type at the name, GTM's over the name's NSEC (the same for every client, "
    "no geo decision to sign); checked to be RRSIGs at the name only",
    "minimal ANY": "ANY is answered with one RRset (RFC 8482): GTM the SOA at the apex, Knot "
    "the NS RRset (with glue); checked to be one RRset at the name, and its RRSIGs with DO",
    "additional RRSIGs cut": "a 512-byte UDP answer whose additional section fits without its "
    "RRSIGs only: GTM leaves them all out, Knot keeps those that fit (RFC 4035 §3.1.1 allows "
    "both); over TCP and at 1232 bytes both send them all",
    "negative SOA signature": "the RRSIG over the SOA of a negative answer: GTM signs the SOA "
    "at the negative TTL it sends (original TTL 60), Knot sends the zone's signature "
    "(original TTL 3600) over the same SOA with its TTL lowered (RFC 2308); both validate",
}


# Differences that come from message sizes only: they come and go as either server's name
# compression changes, so they are allowed without being required to occur.
SIZE_DEPENDENT = {"truncation", "additional RRSIGs cut"}


def reconcile(q: Asked, g: View, k: View, used: Counter[str]) -> tuple[View, View] | None:
    """``(gtm, knot)`` with the documented differences taken out (each counted in ``used``),
    or None when the pair is settled by them. Raises AssertionError when GTM's side of a
    documented difference is not what the difference says."""
    if q.transport == "udp" and ("TC" in g.flags.split() or "TC" in k.flags.split()):
        used["truncation"] += 1
        return None
    if q.rdtype == "TYPE128":
        assert g.rcode in ("NOTIMP", "FORMERR"), g
        used["meta type asked"] += 1
        return None
    in_zone = q.name.endswith(APEX)
    own = _nsecs(g.answer) | _nsecs(g.authority)
    name = q.name.lower()
    knot_has_it = k.rcode == "NOERROR" and _own_records_only(k, name, q.rdtype)
    nxdomain_plain = k.rcode == "NXDOMAIN" and not q.do
    if (
        q.signed
        and in_zone
        and q.rdtype in ("NSEC", "RRSIG")
        and not (knot_has_it or nxdomain_plain)
    ):
        # Knot has no NSEC here: GTM answers its own (the black lie's, with DO, for a
        # name that does not exist).
        asked = [r for r in g.answer if r[1] == q.rdtype]
        assert g.rcode == "NOERROR" and _own_records_only(
            replace(g, answer=asked), name, q.rdtype
        ), g
        if q.rdtype == "NSEC":
            assert ("NXNAME" in own[name]) == (k.rcode == "NXDOMAIN"), (g, k)
        used["own NSEC"] += 1
        return None
    if q.signed and k.rcode == "NXDOMAIN" and q.do and in_zone:
        assert g.rcode == "NOERROR" and "NXNAME" in own.get(name, set()), g
        g = replace(g, rcode="NXDOMAIN")
        used["black lie"] += 1
    if q.rdtype == "RRSIG" and k.answer:
        assert _own_records_only(g, name, "RRSIG") and _own_records_only(k, name, "RRSIG"), g
        g, k = replace(g, answer=[]), replace(k, answer=[])
        used["RRSIG asked"] += 1
    if q.rdtype == "NSEC" and k.answer:
        assert _nsecs(g.answer) == _nsecs(k.answer), (g, k)
        g = replace(g, answer=_without_denial(g.answer))
        k = replace(k, answer=_without_denial(k.answer))
        used["NSEC next name"] += 1
    if q.rdtype == "ANY" and g.answer and k.answer and g.answer != k.answer:
        for v in (g, k):
            kinds = {kind for _, kind, _, data in v.answer if kind != "RRSIG"}
            assert len(kinds) == 1 and all(o == name for o, _, _, _ in v.answer), v
        g, k = replace(g, answer=[], additional=[]), replace(k, answer=[], additional=[])
        used["minimal ANY"] += 1
    if _nsecs(k.authority) or _nsecs(g.authority):
        theirs, ours = _nsecs(k.authority), _nsecs(g.authority)
        assert len(ours) == 1, g  # compact denial: one NSEC
        denied = name  # where the denial is: the name, or the end of the CNAME chain
        for _ in k.answer:
            denied = next(
                (d for o, kind, _, d in k.answer if o == denied and kind == "CNAME"), denied
            )
        if denied.lower() in theirs:  # Knot's NSEC matches the name: GTM's is there too
            assert denied.lower() in ours, (denied, g, k)
        for owner in theirs.keys() & ours.keys():
            assert theirs[owner] == ours[owner], (owner, g, k)
        g = replace(g, authority=_without_denial(g.authority))
        k = replace(k, authority=_without_denial(k.authority))
        used["denial NSECs"] += 1
    soa_sig = [r for r in k.authority if r[1] == "RRSIG" and r[3].startswith("SOA ")]
    if soa_sig and not set(soa_sig) <= set(g.authority):
        g = replace(g, authority=_without_original_ttl(g.authority))
        k = replace(k, authority=_without_original_ttl(k.authority))
        used["negative SOA signature"] += 1
    cut = [r for r in k.additional if r[1] == "RRSIG"]
    if (
        q.transport == "udp"
        and q.variant == "do512"
        and cut
        and g.additional == [r for r in k.additional if r[1] != "RRSIG"]
    ):
        k = replace(k, additional=[r for r in k.additional if r[1] != "RRSIG"])
        used["additional RRSIGs cut"] += 1
    return g, k


def _without_original_ttl(records: list[Record]) -> list[Record]:
    out = []
    for owner, kind, ttl, data in records:
        if kind == "RRSIG" and data.startswith("SOA "):
            fields = data.split()
            data = " ".join(fields[:3] + fields[4:])
        out.append((owner, kind, ttl, data))
    return out


# -- the servers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    signed: bool
    gtm: int
    knot: int


@pytest.fixture(scope="module", params=["signed", "unsigned"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    signed = request.param == "signed"
    work = tmp_path_factory.mktemp(f"oracle-{request.param}")
    key = generate(work / "zone.key") if signed else None
    topology = dns_peers.demo_topology()
    with ExitStack() as running:
        gtm = running.enter_context(dns_peers.gtm_serve(work, key, serve_env(work)))
        addresses = {
            name: tuple(
                rd.to_text()
                for rdtype in ("A", "AAAA")
                for rrset in ask(gtm, Asked(name, rdtype, "edns", "udp", signed)).answer
                for rd in rrset
            )
            for service in topology.services
            for name in service.dns_names
        }
        text = dns_peers.zone_text(topology, addresses)
        if key is not None:
            text = dns_peers.signed_zone_text(text, key, time.time())
        knot = running.enter_context(dns_peers.knot(work / "knot", text))
        yield Pair(signed, gtm, knot)


def test_gtm_answers_as_knot_does_but_for_the_documented_differences(pair: Pair) -> None:
    used: Counter[str] = Counter()
    wrong: list[str] = []
    compared = 0
    for name, rdtype, variant, transport in itertools.product(NAMES, TYPES, VARIANTS, TRANSPORTS):
        q = Asked(name, rdtype, variant, transport, pair.signed)
        g, k = view(ask(pair.gtm, q)), view(ask(pair.knot, q))
        compared += 1
        try:
            settled = reconcile(q, g, k, used)
        except AssertionError as e:
            wrong.append(f"{q}: GTM's side is not what its documented difference says: {e}")
            continue
        if settled is None:
            continue
        g, k = settled
        for part in ("rcode", "flags", "edns", "answer", "authority", "additional"):
            if getattr(g, part) != getattr(k, part):
                wrong.append(f"{q} {part}:\n  GTM  {getattr(g, part)}\n  Knot {getattr(k, part)}")
    assert compared == len(NAMES) * len(TYPES) * len(VARIANTS) * len(TRANSPORTS)
    assert not wrong, f"{len(wrong)} of {compared} differ:\n" + "\n".join(wrong[:40])
    # Every documented difference still happens (none is a stale excuse), but for those of
    # message sizes; the unsigned zone has no denial records, signatures or black lies.
    allowed = set(DIFFERENCES) if pair.signed else {"truncation", "meta type asked", "minimal ANY"}
    assert allowed - SIZE_DEPENDENT <= set(used) <= allowed, dict(used)
    print(f"{'signed' if pair.signed else 'unsigned'}: {compared} queries, {dict(used)}")
