"""The authoritative answer for one query: pure, from the snapshot.

* names outside the zone, or a class other than IN: REFUSED, never a referral;
* the apex: SOA, NS with glue; ANY answered minimally with the SOA (RFC 8482);
* service names: A / AAAA from ``decide()``; a failed-closed decision as its policy says
  (REFUSED, NODATA or SERVFAIL); other types NODATA;
* nameserver names in the zone: their glue addresses;
* names that exist only as part of longer names (empty non-terminals): NODATA (RFC 8020);
* anything else in the zone: NXDOMAIN, with the SOA in the authority section (RFC 2308).

Every answer comes with its audit record (DESIGN.md rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address

from gtm.audit.record import AuditRecord, record_of, zone_record
from gtm.decision.model import Channel, Decision, DecisionRequest, Outcome
from gtm.decision.policy import DnsFailure
from gtm.decision.routing import client_network, decide
from gtm.decision.snapshot import Snapshot
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
from gtm.geodns.wire import QCLASS_ANY, QCLASS_IN, Qtype, Query, Rcode

IPAddress = IPv4Address | IPv6Address

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
    ns: tuple[bytes, ...]  # NS records at the apex, owner the question name (apex)
    glue: dict[str, tuple[tuple[bytes, ...], tuple[bytes, ...]]]  # ns name -> (A rdata, AAAA)
    glue_records: tuple[bytes, ...]  # glue as additional records
    ttl: int
    services: dict[str, Service]
    # Names that exist in the zone only because longer names do (empty non-terminals).
    interior: frozenset[str] = field(default_factory=frozenset)


_ZONES: dict[str, ZoneData] = {}


def zone_data(topology: Topology) -> ZoneData:
    key = topology.fingerprint()
    data = _ZONES.get(key)
    if data is None:
        if len(_ZONES) > 8:
            _ZONES.clear()
        data = _ZONES[key] = _build_zone(topology)
    return data


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
    interior: set[str] = set()
    for name in [*services, *glue]:
        labels = name.split(".")
        for i in range(1, len(labels)):
            parent = ".".join(labels[i:])
            if parent == zone.apex or not in_zone(parent, zone.apex):
                break
            interior.add(parent)
    return ZoneData(
        apex=zone.apex,
        soa=record(apex_wire, Qtype.SOA, zone.ttl, rdata),
        negative_soa=record(apex_wire, Qtype.SOA, min(zone.ttl, soa.minimum), rdata),
        ns=tuple(
            record(QUESTION_POINTER, Qtype.NS, zone.ttl, name_wire(ns.name))
            for ns in zone.nameservers
        ),
        glue=glue,
        glue_records=tuple(glue_records),
        ttl=zone.ttl,
        services=services,
        interior=frozenset(interior - set(services) - set(glue)),
    )


_RECORDS: dict[tuple[int, int, tuple[str, ...]], list[bytes]] = {}


def address_records(qtype: Qtype, ttl: int, addresses: tuple[str, ...]) -> list[bytes]:
    """A/AAAA records owned by the question name; memoised, as the same few answer sets
    recur (parsing address text costs more than the rest of rendering)."""
    key = (qtype, ttl, addresses)
    records = _RECORDS.get(key)
    if records is None:
        if len(_RECORDS) > 10_000:
            _RECORDS.clear()
        packed = a_rdata if qtype == Qtype.A else aaaa_rdata
        records = _RECORDS[key] = [
            record(QUESTION_POINTER, qtype, ttl, packed(a)) for a in addresses
        ]
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
    ) -> Answer:
        if opt is not None and ecs is not None:
            # RFC 7871 section 7.2.1: the scope is the prefix over which this answer holds.
            # ``located``: the answer came from the decision, whose scope is where the client's
            # location stops mattering; anything else (the apex, NODATA for a type no decision
            # gives) is the same from everywhere: scope 0.
            scope = decision.scope_prefix if located and decision is not None else 0
            out_opt: OptOut | None = OptOut(opt.do, ecs, scope)
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
        )
        response_name = rcode_name(rcode) + ("+TC" if wire[2] & 0x02 else "")
        if decision is not None:
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

    if query.qclass not in (QCLASS_IN, QCLASS_ANY) or not in_zone(name, zone.apex):
        return finish(Rcode.REFUSED, [], aa=False, outcome="refused")

    service = zone.services.get(name)
    if service is not None:
        decision = decide(
            DecisionRequest(Channel.DNS, client, service.id, name, ecs=ecs_net), snapshot, now
        )
        if decision.outcome in (Outcome.FAIL_CLOSED, Outcome.DENIED):
            failure = decision.dns_failure or DnsFailure.REFUSED
            rcode = _FAILURE_RCODE[failure]
            authority = [zone.negative_soa] if rcode == Rcode.NOERROR else []
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

    if name in zone.interior:
        return finish(Rcode.NOERROR, [], [zone.negative_soa], outcome="nodata")
    return finish(Rcode.NXDOMAIN, [], [zone.negative_soa], outcome="nxdomain")
