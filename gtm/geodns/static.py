"""The zone's static records (``zone.records``), rendered once per topology for :func:`answer`.

Each RRset is rendered twice: owned by the question name (a compression pointer to it, as every
other answer here) for a query at its owner, and owned by its name written out for a query that
reaches it through a CNAME. A CNAME owner's chain is rendered whole: the CNAMEs followed inside
the zone (validated at load: no loops, at most ``MAX_CNAME_CHAIN``) and where it ends, which
:func:`gtm.geodns.zone.answer` completes at query time:

* a static name, the apex or a nameserver name: its RRset of the type asked (rendered here), or
  NODATA;
* a service name: A / AAAA from ``decide()`` for the client, with the decision's ECS scope, as
  the service name itself is answered (``api CNAME chat`` gives ``chat``'s answer for this
  client), other types NODATA;
* a name outside the zone: the CNAMEs alone; the resolver follows them (RFC 1034 §4.3.2).

MX and SRV answers carry the addresses of in-zone targets that have static ones (static A/AAAA
or glue) in the additional section; a target that is a service name gets none (its address is
per client), and neither does one out of the zone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gtm.decision.static_records import (
    MAX_CNAME_CHAIN,
    AAAARecord,
    ARecord,
    CAARecord,
    CNAMERecord,
    MXRecord,
    SRVRecord,
    StaticRecord,
    TXTRecord,
    absolute_owner,
)
from gtm.decision.topology import Topology, in_zone
from gtm.geodns.render import (
    QUESTION_POINTER,
    caa_rdata,
    mx_rdata,
    name_wire,
    record,
    soa_rdata,
    srv_rdata,
    txt_rdata,
)
from gtm.geodns.wire import Qtype

_TYPES = {
    "A": Qtype.A,
    "AAAA": Qtype.AAAA,
    "CNAME": Qtype.CNAME,
    "TXT": Qtype.TXT,
    "CAA": Qtype.CAA,
    "MX": Qtype.MX,
    "SRV": Qtype.SRV,
}


@dataclass(frozen=True, slots=True)
class RRset:
    records: tuple[bytes, ...]  # owned by the question name (pointer to offset 12)
    owned: tuple[bytes, ...]  # owned by the name written out: the end of a CNAME chain
    additional: tuple[bytes, ...]  # in-zone addresses of MX / SRV targets
    given: tuple[str, ...]  # what the audit row says was answered


@dataclass(frozen=True, slots=True)
class Chain:
    """A CNAME owner's answer: its CNAME, the CNAMEs after it inside the zone, where they end."""

    first: bytes  # the owner's CNAME record, owned by the question name
    records: tuple[bytes, ...]  # ``first`` and the in-zone CNAMEs after it, in order
    given: tuple[str, ...]  # the targets, in order
    final: str | None  # the last target when it is in the zone; None when it leaves the zone
    final_wire: bytes  # that name in wire form (the owner of what is answered for it)


@dataclass(frozen=True, slots=True)
class StaticZone:
    # (static owner, type) -> RRset. CNAME owners are in ``chains`` instead.
    rrsets: dict[tuple[str, int], RRset] = field(default_factory=dict)
    # Static owners (not CNAME owners) -> the type whose RRset answers ANY (RFC 8482: one
    # RRset is enough): the first configured at the name.
    any_type: dict[str, int] = field(default_factory=dict)
    chains: dict[str, Chain] = field(default_factory=dict)
    # (name, type) -> RRset owned by the name, for every name a chain can end at with static
    # data: static owners, the apex (SOA, NS) and in-zone nameserver names (glue).
    targets: dict[tuple[str, int], RRset] = field(default_factory=dict)
    # Static owners -> their static types (CNAME owners: CNAME alone).
    types: dict[str, frozenset[int]] = field(default_factory=dict)
    # CNAME owners whose chain ends at a service name -> that name.
    to_services: dict[str, str] = field(default_factory=dict)


def _rdata(r: StaticRecord) -> bytes:
    if isinstance(r, ARecord | AAAARecord):
        return r.address.packed
    if isinstance(r, CNAMERecord):
        return name_wire(r.target)
    if isinstance(r, TXTRecord):
        return txt_rdata(r.strings())
    if isinstance(r, CAARecord):
        return caa_rdata(r.flags, r.tag, r.value)
    if isinstance(r, MXRecord):
        return mx_rdata(r.preference, r.exchange)
    return srv_rdata(r.priority, r.weight, r.port, r.target)


def build_static(topology: Topology) -> StaticZone:
    zone = topology.zone
    apex = zone.apex
    if not zone.records:
        return StaticZone()
    services = {n for s in topology.services for n in s.dns_names}
    # name -> type -> [(ttl, rdata, given)], in configuration order
    data: dict[str, dict[int, list[tuple[int, bytes, str]]]] = {}
    for r in zone.records:
        owner = absolute_owner(r.name, apex)
        ttl = zone.ttl if r.ttl is None else r.ttl
        data.setdefault(owner, {}).setdefault(_TYPES[r.type], []).append(
            (ttl, _rdata(r), r.describe())
        )

    # Addresses that are the same for every client, for chains' ends and additional sections.
    addresses: dict[tuple[str, int], list[bytes]] = {}
    for owner, by_type in data.items():
        for rtype in (Qtype.A, Qtype.AAAA):
            for ttl, rdata, _ in by_type.get(rtype, []):
                addresses.setdefault((owner, rtype), []).append(
                    record(name_wire(owner), rtype, ttl, rdata)
                )
    targets: dict[tuple[str, int], RRset] = {}
    for ns in zone.nameservers:
        if in_zone(ns.name, apex):
            for rtype, addrs in ((Qtype.A, ns.ipv4), (Qtype.AAAA, ns.ipv6)):
                glue = tuple(record(name_wire(ns.name), rtype, zone.ttl, a.packed) for a in addrs)
                if glue:
                    addresses[ns.name, rtype] = list(glue)
                    targets[ns.name, rtype] = RRset(glue, glue, (), ("glue",))
    soa = zone.soa
    apex_wire = name_wire(apex)
    soa_record = record(
        apex_wire,
        Qtype.SOA,
        zone.ttl,
        soa_rdata(
            soa.mname, soa.rname, soa.serial, soa.refresh, soa.retry, soa.expire, soa.minimum
        ),
    )
    targets[apex, Qtype.SOA] = RRset((soa_record,), (soa_record,), (), ("SOA",))
    ns_records = tuple(
        record(apex_wire, Qtype.NS, zone.ttl, name_wire(ns.name)) for ns in zone.nameservers
    )
    targets[apex, Qtype.NS] = RRset(
        ns_records, ns_records, (), tuple(ns.name for ns in zone.nameservers)
    )

    def extra(rtype: int, rdata_names: list[str]) -> tuple[bytes, ...]:
        if rtype not in (Qtype.MX, Qtype.SRV):
            return ()
        out: list[bytes] = []
        for name in dict.fromkeys(rdata_names):
            out += addresses.get((name, Qtype.A), []) + addresses.get((name, Qtype.AAAA), [])
        return tuple(out)

    mx_srv_targets: dict[tuple[str, int], list[str]] = {}
    for r in zone.records:
        if isinstance(r, MXRecord | SRVRecord):
            owner = absolute_owner(r.name, apex)
            target = r.exchange if isinstance(r, MXRecord) else r.target
            mx_srv_targets.setdefault((owner, _TYPES[r.type]), []).append(target)

    rrsets: dict[tuple[str, int], RRset] = {}
    any_type: dict[str, int] = {}
    types: dict[str, frozenset[int]] = {}
    cname_target: dict[str, str] = {}
    for owner, by_type in data.items():
        types[owner] = frozenset(by_type)
        if Qtype.CNAME in by_type:
            cname_target[owner] = by_type[Qtype.CNAME][0][2]
            continue
        any_type[owner] = next(iter(by_type))
        owner_wire = name_wire(owner)
        for kind, rows in by_type.items():
            rrset = RRset(
                tuple(record(QUESTION_POINTER, kind, ttl, rdata) for ttl, rdata, _ in rows),
                tuple(record(owner_wire, kind, ttl, rdata) for ttl, rdata, _ in rows),
                extra(kind, mx_srv_targets.get((owner, kind), [])),
                tuple(given for _, _, given in rows),
            )
            rrsets[owner, kind] = rrset
            targets[owner, kind] = rrset

    chains: dict[str, Chain] = {}
    to_services: dict[str, str] = {}
    for owner in cname_target:
        ttl, rdata, target = data[owner][Qtype.CNAME][0]
        first = record(QUESTION_POINTER, Qtype.CNAME, ttl, rdata)
        records, given = [first], [target]
        # Acyclic and short (validated at load); bounded here too, for a topology built
        # without its cross-reference checks.
        while target in cname_target and len(records) <= MAX_CNAME_CHAIN:
            t_ttl, t_rdata, t_target = data[target][Qtype.CNAME][0]
            records.append(record(name_wire(target), Qtype.CNAME, t_ttl, t_rdata))
            given.append(t_target)
            target = t_target
        final = target if in_zone(target, apex) else None
        chains[owner] = Chain(
            first, tuple(records), tuple(given), final, name_wire(target) if final else b""
        )
        if final is not None and final in services:
            to_services[owner] = final
    return StaticZone(rrsets, any_type, chains, targets, types, to_services)
