"""The authoritative answer for one query: pure, from the snapshot.

* meta and transfer types first: AXFR/IXFR REFUSED, MAILA/MAILB/TKEY NOTIMP, TSIG/OPT FORMERR;
* names outside the zone, or a class other than IN: REFUSED, never a referral;
* the apex: SOA, NS with glue; ANY answered minimally with the SOA (RFC 8482);
* service names: A / AAAA from ``decide()``; a failed-closed decision as its policy says
  (REFUSED, NODATA or SERVFAIL); other types NODATA;
* nameserver names in the zone: their glue addresses;
* static records (``zone.records``, :mod:`gtm.geodns.static`): the RRset of the type asked, at
  their own names and beside the apex's SOA/NS, a service's A/AAAA or a nameserver's glue;
  NODATA for another type; a CNAME owner answers its CNAME and follows it inside the zone, into
  a service name with ``decide()`` for the client;
* names that exist only as part of longer names (empty non-terminals): NODATA (RFC 8020);
* anything else in the zone: NXDOMAIN, with the SOA in the authority section (RFC 2308).

Every answer comes with its audit record (DESIGN.md rule 2); those whose name is the sender's
to choose (NXDOMAIN, refusals, errors) share one per zone, outcome and sender's network bucket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from gtm.audit.record import AuditRecord, record_of, zone_record
from gtm.decision.model import Channel, Decision, DecisionRequest, Outcome
from gtm.decision.policy import DnsFailure
from gtm.decision.routing import client_network, decide
from gtm.decision.snapshot import Snapshot, Versions
from gtm.decision.topology import Service, Topology, in_zone
from gtm.geodns.render import (
    QUESTION_POINTER,
    OptOut,
    a_rdata,
    aaaa_rdata,
    name_wire,
    rcode_name,
    record,
    response,
    soa_rdata,
)
from gtm.geodns.static import StaticZone, build_static
from gtm.geodns.wire import QCLASS_ANY, QCLASS_IN, Qtype, Query, Rcode

IPAddress = IPv4Address | IPv6Address

# Meta and transfer query types (RFC 6895 §3.1), answered before the zone is looked at, as BIND
# does (ns_query_start: meta types before the zone; transfers refused by the default ACL):
# * AXFR, IXFR: REFUSED. This responder never transfers its zone (answers are per client; there
#   is no zone to copy); BIND and NSD refuse a transfer no ACL allows (Knot says NOTAUTH,
#   which resolvers and tools read as the same refusal).
# * MAILA, MAILB (obsolete, RFC 883 mail queries) and TKEY (key negotiation, RFC 2930, which
#   this server does not implement): NOTIMP. BIND answers MAILA/MAILB with NOTIMP; NSD, Knot and
#   PowerDNS answer NODATA, which a client cannot tell from "no such records".
# * TSIG and OPT: FORMERR, as BIND does. They are meta-records that only exist in the
#   additional section (RFC 8945 §4.2, RFC 6891 §6.1.1), so a question for them is malformed.
# * NXNAME (128): FORMERR. It only marks a name that does not exist in a compact denial's NSEC
#   bitmap; a query for it is malformed (RFC 9824 §3.5).
# * the unassigned rest of the meta range (129-248): NOTIMP, there is nothing to implement yet.
# ANY is answered minimally (RFC 8482) below, as BIND's minimal-any and Knot do.
_META_RCODE: dict[int, Rcode] = {
    Qtype.AXFR: Rcode.REFUSED,
    Qtype.IXFR: Rcode.REFUSED,
    Qtype.MAILA: Rcode.NOTIMP,
    Qtype.MAILB: Rcode.NOTIMP,
    Qtype.TKEY: Rcode.NOTIMP,
    Qtype.TSIG: Rcode.FORMERR,
    Qtype.OPT: Rcode.FORMERR,
    Qtype.NXNAME: Rcode.FORMERR,
}
_META_OUTCOME = {Rcode.REFUSED: "refused", Rcode.NOTIMP: "notimp", Rcode.FORMERR: "malformed"}


def meta_rcode(qtype: int) -> Rcode | None:
    """The error a meta or transfer query type gets (see above), or None for a data type."""
    rcode = _META_RCODE.get(qtype)
    if rcode is None and 128 <= qtype <= 248:
        return Rcode.NOTIMP
    return rcode


_BESIDE_CNAME = frozenset({46, 47})  # RRSIG, NSEC

_FAILURE_RCODE = {
    DnsFailure.REFUSED: Rcode.REFUSED,
    DnsFailure.SERVFAIL: Rcode.SERVFAIL,
    DnsFailure.NODATA: Rcode.NOERROR,
}


@dataclass(frozen=True, slots=True)
class ZoneData:
    """What the zone holds besides the service names, rendered once per topology."""

    apex: str
    soa: bytes  # the SOA record, owner the apex
    negative_soa: bytes  # the SOA for negative answers: TTL min(SOA TTL, minimum) (RFC 2308)
    # The SOA of a fail-closed NODATA: TTL and minimum both the routing's degraded TTL, so a
    # resolver caches the failure only that long (RFC 2308 §5: min(SOA TTL, minimum)) and asks
    # again soon after the region is back. See answer() on why NODATA.
    failure_soa: bytes
    ns: tuple[bytes, ...]  # NS records at the apex, owner the question name (apex)
    glue: dict[str, tuple[tuple[bytes, ...], tuple[bytes, ...]]]  # ns name -> (A rdata, AAAA)
    glue_records: tuple[bytes, ...]  # glue as additional records
    ttl: int
    # Names answered from a decision: every service name, and every CNAME owner whose chain
    # ends at one (-> that service), so the responder keys their cached answers by location.
    services: dict[str, Service]
    # Names that exist in the zone only because longer names do (empty non-terminals).
    interior: frozenset[str] = field(default_factory=frozenset)
    static: StaticZone = field(default_factory=StaticZone)  # zone.records, rendered

    def types_at(self, name: str) -> frozenset[int]:
        """The record types that can exist at ``name`` (lower case, absolute; the trailing dot
        may be left out): what a denial of existence for another type there must list (RFC 4034
        §4.1.2). A service name lists A and AAAA whichever regions answer it: a decision for
        another client can give either. Static records add their types; a CNAME owner lists
        CNAME alone. Empty for a name that does not exist (and for empty non-terminals)."""
        if not name.endswith("."):
            name += "."
        static = self.static.types.get(name, _NO_TYPES)
        if name in self.static.chains:
            return static  # {CNAME}: nothing else may be there (checked at load)
        if name == self.apex:
            return _APEX_TYPES | static
        if name in self.services:
            return _SERVICE_TYPES | static
        glue = self.glue.get(name)
        if glue is not None:
            v4, v6 = glue
            return static | frozenset(([Qtype.A] if v4 else []) + ([Qtype.AAAA] if v6 else []))
        return static


_APEX_TYPES = frozenset({Qtype.SOA, Qtype.NS})
_SERVICE_TYPES = frozenset({Qtype.A, Qtype.AAAA})
_NO_TYPES: frozenset[int] = frozenset()


_ZONES: dict[str, ZoneData] = {}
# The last topology asked for and its data: every query the long way asks, and a topology's
# fingerprint is a pydantic private attribute, several times a dictionary lookup to read.
_last: tuple[Topology, ZoneData] | None = None


def zone_data(topology: Topology) -> ZoneData:
    global _last
    last = _last
    if last is not None and last[0] is topology:
        return last[1]
    key = topology.fingerprint()
    data = _ZONES.get(key)
    if data is None:
        if len(_ZONES) > 8:
            _ZONES.clear()
        data = _ZONES[key] = _build_zone(topology)
    _last = (topology, data)
    return data


def nonexistent(query: Query, zone: ZoneData) -> bool:
    """Whether :func:`answer` gives ``query`` NXDOMAIN: a data type of class IN or ANY, for a
    name in the zone that holds nothing (no service, static record, apex, nameserver glue or
    longer name below it). Such responses differ from one name to another only in their
    question (the SOA in the authority section is owned by the apex, written out in full), so
    the responder renders one per query shape, sender and name length (compressed, the names
    after the question point past it) for any name: a flood of random names under the zone
    costs a parse and a dictionary lookup a query, not an answer rendered each
    (tests/gtm/geodns/test_static_records.py checks it against answer())."""
    name = query.qname_text
    return (
        meta_rcode(query.qtype) is None
        and query.qclass in (QCLASS_IN, QCLASS_ANY)
        and name != zone.apex
        and in_zone(name, zone.apex)
        and name not in zone.services
        and name not in zone.static.types
        and name not in zone.glue
        and name not in zone.interior
    )


def _build_zone(topology: Topology) -> ZoneData:
    zone = topology.zone
    apex_wire = name_wire(zone.apex)
    soa = zone.soa
    rdata = soa_rdata(
        soa.mname, soa.rname, soa.serial, soa.refresh, soa.retry, soa.expire, soa.minimum
    )
    glue: dict[str, tuple[tuple[bytes, ...], tuple[bytes, ...]]] = {}
    glue_records: list[bytes] = []
    for ns in zone.nameservers:
        if in_zone(ns.name, zone.apex):
            v4 = tuple(a.packed for a in ns.ipv4)
            v6 = tuple(a.packed for a in ns.ipv6)
            glue[ns.name] = (v4, v6)
            glue_records += [record(name_wire(ns.name), Qtype.A, zone.ttl, r) for r in v4]
            glue_records += [record(name_wire(ns.name), Qtype.AAAA, zone.ttl, r) for r in v6]
    services = {n: s for s in topology.services for n in s.dns_names}
    static = build_static(topology)
    services |= {owner: services[final] for owner, final in static.to_services.items()}
    interior: set[str] = set()
    for name in [*services, *glue, *static.types]:
        labels = name.split(".")
        for i in range(1, len(labels)):
            parent = ".".join(labels[i:])
            if parent == zone.apex or not in_zone(parent, zone.apex):
                break
            interior.add(parent)
    failure_ttl = min(zone.ttl, soa.minimum, topology.routing.degraded_ttl)
    failure_rdata = soa_rdata(
        soa.mname, soa.rname, soa.serial, soa.refresh, soa.retry, soa.expire, failure_ttl
    )
    return ZoneData(
        apex=zone.apex,
        soa=record(apex_wire, Qtype.SOA, zone.ttl, rdata),
        negative_soa=record(apex_wire, Qtype.SOA, min(zone.ttl, soa.minimum), rdata),
        failure_soa=record(apex_wire, Qtype.SOA, failure_ttl, failure_rdata),
        ns=tuple(
            record(QUESTION_POINTER, Qtype.NS, zone.ttl, name_wire(ns.name))
            for ns in zone.nameservers
        ),
        glue=glue,
        glue_records=tuple(glue_records),
        ttl=zone.ttl,
        services=services,
        interior=frozenset(interior - set(services) - set(glue) - set(static.types)),
        static=static,
    )


_RECORDS: dict[tuple[int, int, tuple[str, ...], bytes], list[bytes]] = {}


def address_records(
    qtype: Qtype, ttl: int, addresses: tuple[str, ...], owner: bytes = QUESTION_POINTER
) -> list[bytes]:
    """A/AAAA records owned by the question name (or ``owner``: the end of a CNAME chain);
    memoised, as the same few answer sets recur (parsing address text costs more than the
    rest of rendering)."""
    key = (qtype, ttl, addresses, owner)
    records = _RECORDS.get(key)
    if records is None:
        if len(_RECORDS) > 10_000:
            _RECORDS.clear()
        packed = a_rdata if qtype == Qtype.A else aaaa_rdata
        records = _RECORDS[key] = [record(owner, qtype, ttl, packed(a)) for a in addresses]
    return records


@dataclass(frozen=True, slots=True)
class Answer:
    wire: bytes
    rcode: int
    record: AuditRecord
    decision: Decision | None


def question_wire(query: Query) -> bytes:
    return query.qname + query.qtype.to_bytes(2, "big") + query.qclass.to_bytes(2, "big")


_QTYPE_NAMES = {int(t): t.name for t in Qtype}


def qtype_name(qtype: int) -> str:
    name = _QTYPE_NAMES.get(qtype)
    return name if name is not None else f"TYPE{qtype}"


def stats_qtype(qtype: int) -> str:
    """The type as a metric label or an aggregated audit row says it: the types this server
    knows by name, every other one "other" (a sender cycling through 65,536 types must not
    make 65,536 label sets or rows)."""
    name = _QTYPE_NAMES.get(qtype)
    return name if name is not None else "other"


# Answers that carry no routing decision and whose names are the sender's to choose (names that
# do not exist, refusals, errors, rate-limited slips) are audited per (zone, outcome, response,
# sender's network bucket) rather than per name: the audit grows with distinct decisions, not
# with an attacker's entropy (issue 17: 500,000 random names made 500,000 rows). Every answer is
# still counted (DESIGN.md rule 2), on the row of its bucket. The bucket is the sender's /16
# (IPv6 /32): the resolver that asked, not the ECS subnet (these answers hold for every subnet),
# coarse enough that spoofed random sources cannot make a row each either.
AGGREGATED_OUTCOMES = frozenset(
    {"nxdomain", "refused", "notimp", "malformed", "rejected", "rate-limited"}
)
BUCKET_V4, BUCKET_V6 = 16, 32
_BUCKETS: dict[tuple[int, int], str] = {}


def sender_bucket(client: IPAddress) -> str:
    """The network bucket an aggregated row is counted under (memoised; at most 65,536 IPv4
    buckets, and IPv6 ones bounded by clearing)."""
    if client.version == 4:
        key = (4, int(client) >> (32 - BUCKET_V4))
    else:
        key = (6, int(client) >> (128 - BUCKET_V6))
    text = _BUCKETS.get(key)
    if text is None:
        if len(_BUCKETS) >= 100_000:
            _BUCKETS.clear()
        net = (
            IPv4Network((key[1] << (32 - BUCKET_V4), BUCKET_V4))
            if key[0] == 4
            else IPv6Network((key[1] << (128 - BUCKET_V6), BUCKET_V6))
        )
        text = _BUCKETS[key] = str(net)
    return text


def aggregated_record(
    *,
    outcome: str,
    name: str,
    apex: str | None,
    client: IPAddress,
    qtype: int | None,
    response: str,
    answer: tuple[str, ...],
    versions: Versions,
) -> AuditRecord:
    """The audit row an answer of an aggregated outcome is counted on: the name becomes "*."
    under the zone it fell in ("*." alone outside it), the type a known name or "other"."""
    if apex is not None and in_zone(name, apex):
        label = "*." + apex if name != apex else apex
    else:
        label = "*."
    return zone_record(
        channel=Channel.DNS.value,
        name=label,
        client_network=sender_bucket(client),
        ecs=None,
        query_type=stats_qtype(qtype) if qtype is not None else None,
        response=response,
        outcome=outcome,
        answer=tuple(_DIGITS.sub("N", a) for a in answer),
        versions=versions,
    )


_DIGITS = re.compile(r"\d+")  # numbers in error reasons come from the packet: not row keys


def answer(
    query: Query, client: IPAddress, snapshot: Snapshot, now: float, limit: int | None
) -> Answer:
    """The response to ``query`` from ``client`` (``limit``: the UDP size, None over TCP)."""
    edns, name = query.edns, query.qname_text
    ecs = edns.ecs if edns is not None else None
    ecs_net = ecs.network if ecs is not None else None
    opt = OptOut(edns.do, ecs) if edns is not None else None
    zone = zone_data(snapshot.topology)
    question = question_wire(query)

    def finish(
        rcode: int,
        answers: list[bytes],
        authority: list[bytes] | tuple[bytes, ...] = (),
        additional: tuple[bytes, ...] = (),
        *,
        aa: bool = True,
        decision: Decision | None = None,
        located: bool = False,
        given: tuple[str, ...] = (),
        outcome: str = "zone",
        echo_ecs: bool = True,
        optional: bool = False,
    ) -> Answer:
        if opt is not None and not echo_ecs:
            # An error says nothing about any subnet: no ECS option (RFC 7871 §7.2.1 asks for
            # one only with an answer that used it).
            out_opt: OptOut | None = OptOut(opt.do, None)
        elif opt is not None and ecs is not None:
            # RFC 7871 section 7.2.1: the scope is the prefix over which this answer holds.
            # ``located``: the answer came from the decision, whose scope is where the client's
            # location stops mattering; anything else (the apex, NODATA for a type no decision
            # gives) is the same from everywhere: scope 0.
            scope = decision.scope_prefix if located and decision is not None else 0
            out_opt = OptOut(opt.do, ecs, scope)
        else:
            out_opt = opt
        wire = response(
            query.id,
            query.flags,
            rcode,
            authoritative=aa,
            question=question,
            answer=answers,
            authority=authority,
            additional=additional,
            opt=out_opt,
            limit=limit,
            optional_additional=optional,
        )
        response_name = rcode_name(rcode) + ("+TC" if wire[2] & 0x02 else "")
        if decision is None and outcome in AGGREGATED_OUTCOMES:
            rec = aggregated_record(
                outcome=outcome,
                name=name,
                apex=zone.apex,
                client=client,
                qtype=query.qtype,
                response=response_name,
                answer=given,
                versions=snapshot.versions,
            )
        elif decision is not None:
            rec = record_of(
                decision,
                channel=Channel.DNS.value,
                name=name,
                ecs=str(ecs_net) if ecs_net else None,
                query_type=qtype_name(query.qtype),
                response=response_name,
                answer=given,
            )
        else:
            rec = zone_record(
                channel=Channel.DNS.value,
                name=name,
                client_network=str(client_network(client, ecs_net)),
                ecs=str(ecs_net) if ecs_net else None,
                query_type=qtype_name(query.qtype),
                response=response_name,
                outcome=outcome,
                answer=given,
                versions=snapshot.versions,
            )
        return Answer(wire, rcode, rec, decision)

    meta = meta_rcode(query.qtype)
    if meta is not None:
        return finish(meta, [], aa=False, outcome=_META_OUTCOME[meta], echo_ecs=False)
    if query.qclass not in (QCLASS_IN, QCLASS_ANY) or not in_zone(name, zone.apex):
        return finish(Rcode.REFUSED, [], aa=False, outcome="refused")

    # Static records (zone.records): a CNAME owner first (it holds nothing else), then the
    # exact RRset at any name; a name without the type asked falls through to its other data.
    static = zone.static
    chain = static.chains.get(name)
    if chain is not None:
        qtype = query.qtype
        if qtype in (Qtype.CNAME, Qtype.ANY):  # the CNAME itself, not followed (RFC 1034)
            return finish(Rcode.NOERROR, [chain.first], given=chain.given[:1])
        if qtype in _BESIDE_CNAME:
            # NSEC and RRSIG may sit at a CNAME owner (RFC 4035 §2.5): asked for, they are
            # the owner's own, never the target's, as BIND and Knot answer (a signed zone's
            # are given by gtm.geodns.dnssec; unsigned, there are none).
            return finish(Rcode.NOERROR, [], [zone.negative_soa], outcome="nodata")
        answers = list(chain.records)
        final = chain.final
        if final is None:  # it leaves the zone: the resolver follows it
            return finish(Rcode.NOERROR, answers, given=chain.given)
        rrset = static.targets.get((final, qtype))
        if rrset is not None:
            return finish(
                Rcode.NOERROR,
                answers + list(rrset.owned),
                (),
                rrset.additional,
                given=chain.given + rrset.given,
                optional=True,
            )
        target = zone.services.get(final)
        if target is None or qtype not in (Qtype.A, Qtype.AAAA):
            return finish(
                Rcode.NOERROR, answers, [zone.negative_soa], outcome="nodata", given=chain.given
            )
        # Into a service name: that name's answer for this client, as if it had been asked
        # (the same decision, residency and ECS scope), after the CNAMEs that lead there.
        decision = decide(
            DecisionRequest(Channel.DNS, client, target.id, final, ecs=ecs_net), snapshot, now
        )
        if decision.outcome in (Outcome.FAIL_CLOSED, Outcome.DENIED):
            rcode = _FAILURE_RCODE[decision.dns_failure or DnsFailure.REFUSED]
            if rcode == Rcode.NOERROR:
                return finish(rcode, answers, [zone.failure_soa], decision=decision, located=True)
            return finish(rcode, [], aa=rcode != Rcode.REFUSED, decision=decision, located=True)
        given = decision.ipv4 if qtype == Qtype.A else decision.ipv6
        addresses = address_records(Qtype(qtype), decision.ttl, given, chain.final_wire)
        if not addresses:
            return finish(
                Rcode.NOERROR, answers, [zone.negative_soa], decision=decision, located=True
            )
        return finish(
            Rcode.NOERROR,
            answers + addresses,
            decision=decision,
            located=True,
            given=chain.given + given,
        )
    rrset = static.rrsets.get((name, query.qtype))
    if rrset is not None:
        return finish(
            Rcode.NOERROR,
            list(rrset.records),
            (),
            rrset.additional,
            given=rrset.given,
            optional=True,
        )

    service = zone.services.get(name)
    if service is not None:
        decision = decide(
            DecisionRequest(Channel.DNS, client, service.id, name, ecs=ecs_net), snapshot, now
        )
        if decision.outcome in (Outcome.FAIL_CLOSED, Outcome.DENIED):
            # The policy's choice. NODATA is the one real resolvers recover from on time: it is
            # an answer, cached for the failure SOA's short negative TTL and then asked again.
            # REFUSED and SERVFAIL are server failures to a resolver: PowerDNS Recursor throttles
            # the server and serves SERVFAIL from its packet cache for every client of the name
            # (120 s after the region was back, with 2 s TTLs, PowerDNS Recursor 4.8).
            failure = decision.dns_failure or DnsFailure.REFUSED
            rcode = _FAILURE_RCODE[failure]
            authority = [zone.failure_soa] if rcode == Rcode.NOERROR else []
            # Which regions are allowed, and so whether any is up, can depend on where the
            # client is (rules match client geography): the failure is located too.
            return finish(
                rcode,
                [],
                authority,
                aa=rcode != Rcode.REFUSED,
                decision=decision,
                located=True,
            )
        qtype = query.qtype
        if qtype == Qtype.ANY:  # RFC 8482: one RRset is enough
            qtype = Qtype.A if decision.ipv4 else Qtype.AAAA
        if qtype == Qtype.A:
            given = decision.ipv4
            answers = address_records(Qtype.A, decision.ttl, given)
        elif qtype == Qtype.AAAA:
            given = decision.ipv6
            answers = address_records(Qtype.AAAA, decision.ttl, given)
        else:  # NODATA from everywhere: no decision gives this type
            return finish(Rcode.NOERROR, [], [zone.negative_soa], decision=decision)
        if not answers:
            # NODATA because the region chosen for this client has no address of the type:
            # another client's region may have one, so it holds over the decision's scope.
            return finish(Rcode.NOERROR, [], [zone.negative_soa], decision=decision, located=True)
        return finish(Rcode.NOERROR, answers, decision=decision, located=True, given=given)

    if name == zone.apex:
        if query.qtype in (Qtype.SOA, Qtype.ANY):
            return finish(
                Rcode.NOERROR, [QUESTION_POINTER + zone.soa[len(name_wire(name)) :]], given=("SOA",)
            )
        if query.qtype == Qtype.NS:
            return finish(
                Rcode.NOERROR,
                list(zone.ns),
                (),
                zone.glue_records,
                given=tuple(ns.name for ns in snapshot.topology.zone.nameservers),
            )
        return finish(Rcode.NOERROR, [], [zone.negative_soa], outcome="nodata")

    glue = zone.glue.get(name)
    if glue is not None:
        v4, v6 = glue
        if query.qtype in (Qtype.A, Qtype.ANY) and v4:
            return finish(
                Rcode.NOERROR,
                [record(QUESTION_POINTER, Qtype.A, zone.ttl, r) for r in v4],
                given=("glue",),
            )
        if query.qtype == Qtype.AAAA and v6:
            return finish(
                Rcode.NOERROR,
                [record(QUESTION_POINTER, Qtype.AAAA, zone.ttl, r) for r in v6],
                given=("glue",),
            )
        return finish(Rcode.NOERROR, [], [zone.negative_soa], outcome="nodata")

    any_type = static.any_type.get(name)
    if any_type is not None:  # a static name without the type asked
        if query.qtype == Qtype.ANY:  # RFC 8482: one RRset, the first configured
            rrset = static.rrsets[name, any_type]
            return finish(
                Rcode.NOERROR,
                list(rrset.records),
                (),
                rrset.additional,
                given=rrset.given,
                optional=True,
            )
        return finish(Rcode.NOERROR, [], [zone.negative_soa], outcome="nodata")

    if name in zone.interior:
        return finish(Rcode.NOERROR, [], [zone.negative_soa], outcome="nodata")
    return finish(Rcode.NXDOMAIN, [], [zone.negative_soa], outcome="nxdomain")
