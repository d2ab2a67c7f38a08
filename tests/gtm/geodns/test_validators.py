"""Every query type a resolver may ask, validated by three validating resolvers that nobody here
wrote: unbound, PowerDNS Recursor and delv, each anchored on the zone's DS, in front of a signed
``gtm serve`` on loopback (issue 32).

The matrix is query type x resolver; each cell asks the type at the names where it means
something different (a service name, the apex, a CNAME owner, an empty non-terminal, a name
that does not exist) and expects SECURE: NOERROR with AD from unbound and PowerDNS Recursor,
"fully validated" from delv, for positive answers and for the compact denials alike. The cells
that cannot be SECURE say why in ``NOT_SECURE``; those whose reason is the resolver's or the
missing parent zone's are checked to end the same way in front of Knot serving the same zone
signed with the same key (tests/support/dns_peers).

Before issue 32, NSEC asked at any name got a NODATA whose NSEC listed NSEC (unbound: "nodata
proof failed", SERVFAIL; delv: "no valid RRSIG"), and RRSIG a NODATA whose NSEC listed RRSIG
(unbound SERVFAIL, delv "insecurity proof failed"): under compact denial both exist at every
name, and are answered (gtm.geodns.dnssec, Signer._own_records).
"""

from __future__ import annotations

import enum
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from gtm.geodns.dnssec_keys import ZoneKey, generate
from tests.support import dns_peers
from tests.support.dns_peers import APEX

from .test_dig import serve_env


class Seen(enum.Enum):
    SECURE = "validated (AD, or delv: fully validated)"
    UNCHECKED = "NOERROR without AD: passed on, not validated"
    SERVFAIL = "SERVFAIL"
    REJECTED = "an error other than SERVFAIL, or delv's failure"


# Not validated, whichever way: the DS of the apex asked with no parent zone in the test fails
# as SERVFAIL offline, and may come back NXDOMAIN (unvalidated) where the real root is reachable.
NOT_VALIDATED = frozenset({Seen.UNCHECKED, Seen.SERVFAIL, Seen.REJECTED})


# Names by the query types asked there (a type's cell asks them all).
APEX_ONLY = [APEX]
EVERY_KIND = [
    APEX,
    "chat.gtm.example.",  # a service name (geo answers)
    "api.gtm.example.",  # a CNAME owner (into the service)
    "eu.gtm.example.",  # an empty non-terminal (above chat.eu)
    "nope.gtm.example.",  # a name that does not exist: a black lie
    "x.y.nope.gtm.example.",
]
MATRIX: dict[str, list[str]] = {
    "A": ["chat.gtm.example.", "api.gtm.example.", "eu.gtm.example.", "nope.gtm.example."],
    "AAAA": ["chat.eu.gtm.example.", "mail.gtm.example.", "ns1.gtm.example."],
    "SOA": APEX_ONLY,
    "NS": APEX_ONLY,
    "TXT": [APEX, "chat.gtm.example."],
    "MX": [APEX, "mail.gtm.example."],
    "CAA": APEX_ONLY,
    "SRV": ["_submission._tcp.gtm.example.", "_tcp.gtm.example."],
    "CNAME": ["api.gtm.example.", "docs.gtm.example.", "chat.gtm.example."],
    "DNSKEY": [APEX, "chat.gtm.example."],
    "DS": ["chat.gtm.example.", "eu.gtm.example.", "nope.gtm.example."],  # below the apex
    "DS@apex": APEX_ONLY,  # the parent's question, asked of the child (see NOT_SECURE)
    "CDS": APEX_ONLY,  # not served (no automated DS updates): a denial
    "CDNSKEY": APEX_ONLY,
    "NSEC": EVERY_KIND,
    "RRSIG": EVERY_KIND,
    "ANY": [APEX, "chat.gtm.example.", "api.gtm.example.", "nope.gtm.example."],
    "HINFO": [APEX, "nope.gtm.example."],  # a type nothing here has
    "TYPE65534": ["chat.gtm.example."],  # an unknown type
    "NXNAME": [APEX, "nope.gtm.example."],  # RFC 9824's meta type, asked
}
RESOLVERS = ("unbound", "pdns_recursor", "delv")

# The cells that are not SECURE, with what is seen and why; None: not asked (and why).
NO_PARENT = (
    "the DS RRset of the apex lives in the parent zone (RFC 4035 §3.1.4.1); anchored at the "
    "zone itself there is no parent to ask, and every resolver fails asking for one, against "
    "Knot too. The child's own answer (NODATA, the apex NSEC listing SOA and not DS) is "
    "validated by dnspython in test_dnssec"
)
NOT_SECURE: dict[tuple[str, str], tuple[Seen | frozenset[Seen] | None, str]] = {
    ("unbound", "RRSIG"): (
        Seen.UNCHECKED,
        "unbound never validates a positive RRSIG answer (there are no signatures over "
        "signatures): passed on without AD, as Knot's is at the names its chain holds",
    ),
    ("pdns_recursor", "RRSIG"): (
        Seen.SERVFAIL,
        "PowerDNS Recursor answers an RRSIG query SERVFAIL itself when validating, before "
        "asking the server, for Knot's zone too",
    ),
    ("delv", "RRSIG"): (
        None,
        "delv takes the RRSIG answer and never ends the fetch (12 s, then 'shut down hung "
        "fetch'), with Knot's answer too: nothing a server can change",
    ),
    ("unbound", "DS@apex"): (NOT_VALIDATED, NO_PARENT),
    ("pdns_recursor", "DS@apex"): (NOT_VALIDATED, NO_PARENT),
    ("delv", "DS@apex"): (NOT_VALIDATED, NO_PARENT),
    ("unbound", "NXNAME"): (
        Seen.REJECTED,
        "a meta type: unbound answers FORMERR itself (RFC 9824 §3.5 asks servers for FORMERR)",
    ),
    ("pdns_recursor", "NXNAME"): (
        Seen.SERVFAIL,
        "a meta type: PowerDNS Recursor answers every meta type SERVFAIL itself",
    ),
    ("delv", "NXNAME"): (
        Seen.REJECTED,
        "a meta type: delv asks and fails on the server's error (RFC 9824 §3.5)",
    ),
}


@dataclass(frozen=True)
class Stack:
    """A signed GTM and the three resolvers' ways in."""

    key: ZoneKey
    auth: int
    ports: dict[str, int]
    delv_anchor: Path


def resolvers_for(running: ExitStack, work: Path, auth: int, key: ZoneKey) -> Stack:
    """unbound and PowerDNS Recursor forwarding the zone to ``auth``, anchored on ``key``;
    delv needs no process (it asks the server itself and validates on its own)."""
    work.mkdir(exist_ok=True)
    sockets = dns_peers.socket_dir(running)
    argvs: dict[str, Callable[[Path], list[str]]] = {
        "unbound": lambda folder: dns_peers.unbound(folder, auth, key),
        "pdns_recursor": lambda folder: dns_peers.pdns_recursor(folder, auth, key, sockets),
    }
    ports = {}
    for kind, argv in argvs.items():
        folder = work / kind
        folder.mkdir()
        ports[kind] = running.enter_context(
            dns_peers.running(
                argv(folder),
                folder / "log",
                dns_peers.resolver_port(folder),
                lambda port: dns_peers.answers_soa(port, recursion=True),
                f"{kind} answering",
            )
        )
    return Stack(key, auth, ports, dns_peers.delv_anchor(work, key))


@pytest.fixture(scope="module")
def zone_key(tmp_path_factory: pytest.TempPathFactory) -> ZoneKey:
    return generate(tmp_path_factory.mktemp("validators-key") / "zone.key")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, zone_key: ZoneKey) -> Iterator[Stack]:
    """A signed GTM and the resolvers in front of it, for the module."""
    work = tmp_path_factory.mktemp("validators")
    with ExitStack() as running:
        auth = running.enter_context(dns_peers.gtm_serve(work, zone_key, serve_env(work)))
        yield resolvers_for(running, work / "resolvers", auth, zone_key)


@pytest.fixture(scope="module")
def peer_stack(
    tmp_path_factory: pytest.TempPathFactory, zone_key: ZoneKey, stack: Stack
) -> Iterator[Stack]:
    """Knot serving the same zone signed with the same key (by dnspython), and the resolvers
    in front of it: the check that a cell GTM cannot make SECURE is not SECURE for Knot
    either."""
    work = tmp_path_factory.mktemp("validators-knot")
    topology = dns_peers.demo_topology()
    addresses = {
        name: tuple(
            rd.to_text()
            for rdtype in ("A", "AAAA")
            for rrset in dns.query.udp(
                dns.message.make_query(name, rdtype), "127.0.0.1", port=stack.auth, timeout=5
            ).answer
            for rd in rrset
        )
        for service in topology.services
        for name in service.dns_names
    }
    text = dns_peers.signed_zone_text(
        dns_peers.zone_text(topology, addresses), zone_key, time.time()
    )
    with ExitStack() as running:
        auth = running.enter_context(dns_peers.knot(work / "knot", text))
        yield resolvers_for(running, work / "resolvers", auth, zone_key)


def matches(seen: Seen, expected: Seen | frozenset[Seen] | None) -> bool:
    return seen in expected if isinstance(expected, frozenset) else seen == expected


def qtype_of(label: str) -> str:
    return {"DS@apex": "DS", "NXNAME": "TYPE128"}.get(label, label)


def through_resolver(port: int, name: str, rdtype: str) -> tuple[Seen, str]:
    query = dns.message.make_query(name, rdtype, want_dnssec=True, payload=1232)
    reply = dns.query.udp(query, "127.0.0.1", port=port, timeout=10)
    if reply.flags & dns.flags.TC:
        reply = dns.query.tcp(query, "127.0.0.1", port=port, timeout=10)
    rcode = reply.rcode()
    if rcode == dns.rcode.NOERROR:
        seen = Seen.SECURE if reply.flags & dns.flags.AD else Seen.UNCHECKED
    else:
        seen = Seen.SERVFAIL if rcode == dns.rcode.SERVFAIL else Seen.REJECTED
    return seen, reply.to_text()


def through_delv(stack: Stack, name: str, rdtype: str) -> tuple[Seen, str]:
    done = subprocess.run(
        [
            dns_peers.require("delv"),
            "@127.0.0.1",
            "-p",
            str(stack.auth),
            "-a",
            str(stack.delv_anchor),
            f"+root={APEX}",
            name,
            rdtype,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout + done.stderr
    # "; fully validated" for data, "; negative response, fully validated" for a denial.
    seen = Seen.SECURE if "fully validated" in out else Seen.REJECTED
    return seen, out


@pytest.mark.parametrize("label", sorted(MATRIX))
@pytest.mark.parametrize("resolver", RESOLVERS)
def test_every_query_type_validates(stack: Stack, resolver: str, label: str) -> None:
    expected, why = NOT_SECURE.get((resolver, label), (Seen.SECURE, ""))
    if expected is None:
        pytest.skip(why)
    rdtype = qtype_of(label)
    wrong = []
    for name in MATRIX[label]:
        if resolver == "delv":
            seen, text = through_delv(stack, name, rdtype)
        else:
            seen, text = through_resolver(stack.ports[resolver], name, rdtype)
        if not matches(seen, expected):
            wrong.append(f"{name} {rdtype}: {seen.name}, expected {expected}\n{text}")
    assert not wrong, "\n".join(wrong)


# The cells whose reason is the resolvers' or the missing parent's, not GTM's (NXNAME's is GTM's
# own refusal of the meta type, which Knot 3.2 answers as data; delv's RRSIG hang is skipped).
SAME_FOR_KNOT = sorted(
    cell for cell, (seen, _) in NOT_SECURE.items() if seen is not None and cell[1] != "NXNAME"
)


@pytest.mark.parametrize(("resolver", "label"), SAME_FOR_KNOT)
def test_cells_not_secure_are_not_secure_with_knot_either(
    peer_stack: Stack, resolver: str, label: str
) -> None:
    expected, why = NOT_SECURE[resolver, label]
    rdtype = qtype_of(label)
    # RRSIG at the names Knot's chain holds: where it has none (an empty non-terminal, no such
    # name) Knot's denial proves there is no RRSIG, while under compact denial GTM's NSEC is
    # there, and so its RRSIG.
    names = [APEX, "chat.gtm.example.", "api.gtm.example."] if label == "RRSIG" else MATRIX[label]
    for name in names:
        if resolver == "delv":
            seen, text = through_delv(peer_stack, name, rdtype)
        else:
            seen, text = through_resolver(peer_stack.ports[resolver], name, rdtype)
        assert matches(seen, expected), (name, rdtype, why, text)
