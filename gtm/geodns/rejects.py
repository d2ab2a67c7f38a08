"""Answers that are not the zone's: to packets the parser rejected (FORMERR, NOTIMP, BADVERS)
and the rate limiter's slips (an empty, truncated answer asking the client to retry over TCP).
Each is counted on an aggregated audit row (gtm.geodns.zone.aggregated_record)."""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv6Address

from gtm.geodns.render import OptOut, rcode_name, response, udp_limit, with_option
from gtm.geodns.stats import DnsStats
from gtm.geodns.wire import NSID_CODE, Query, Rcode, Reject, name_to_text
from gtm.geodns.zone import aggregated_record, stats_qtype, zone_data
from gtm.runtime import Runtime

IPAddress = IPv4Address | IPv6Address
_CD = 0x0010


def reject_response(
    runtime: Runtime,
    stats: DnsStats,
    reject: Reject,
    client: IPAddress,
    udp: bool,
    server_id: str | None = None,
) -> bytes | None:
    """The answer to a packet the parser rejected (FORMERR, NOTIMP, BADVERS), counted; None
    to send nothing (no readable header, or a response). ``server_id``: the NSID a query
    with a readable OPT asking for it gets (RFC 5001 §2.2: in every response with an OPT)."""
    if reject.drop:
        stats.dropped += 1
        return None
    question = None
    if reject.qname is not None:
        question = reject.qname + struct.pack("!HH", reject.qtype, reject.qclass)
    opt = OptOut(reject.edns.do, None) if reject.edns is not None else None
    flags = reject.flags
    if reject.rcode == Rcode.NOTIMP:
        # An opcode not implemented: RD echoed (RFC 1035 §4.1.1), CD not: it asks for
        # DNSSEC processing of a query that had none (Knot clears it too).
        flags &= ~_CD
    limit = udp_limit(reject.edns) if udp else None
    wire = response(
        reject.id or 0,
        flags,
        reject.rcode,
        authoritative=False,
        question=question,
        opt=opt,
        limit=limit,
    )
    if server_id is not None and reject.edns is not None and reject.edns.nsid:
        with_nsid = with_option(wire, NSID_CODE, server_id.encode())
        # Left out only when it alone would not fit, as on answers (Responder._render).
        if with_nsid is not None and (limit is None or len(with_nsid) <= limit):
            wire = with_nsid
    snapshot = runtime.store.current
    name = "-"
    if reject.qname is not None:
        name = name_to_text(reject.qname)[:255]
    runtime.count(
        aggregated_record(
            outcome="malformed" if reject.rcode == 1 else "rejected",
            name=name,
            apex=zone_data(snapshot.topology).apex,
            client=client,
            qtype=reject.qtype if reject.qname else None,
            response=rcode_name(reject.rcode),
            answer=(reject.reason[:200],),
            versions=snapshot.versions,
        )
    )
    stats.queries["udp" if udp else "tcp", "-", rcode_name(reject.rcode)] += 1
    return wire


def slip_response(runtime: Runtime, stats: DnsStats, query: Query, client: IPAddress) -> bytes:
    """A rate-limited query's slip: its question, empty and truncated (TC), counted."""
    edns = query.edns
    opt = OptOut(edns.do, None) if edns is not None else None
    question = query.qname + struct.pack("!HH", query.qtype, query.qclass)
    wire = response(
        query.id, query.flags, 0, authoritative=True, question=question, opt=opt, limit=0
    )  # limit 0: always cut to the question (TC)
    snapshot = runtime.store.current
    runtime.count(
        aggregated_record(
            outcome="rate-limited",
            name=query.qname_text,
            apex=zone_data(snapshot.topology).apex,
            client=client,
            qtype=query.qtype,
            response="NOERROR+TC",
            answer=(),
            versions=snapshot.versions,
        )
    )
    stats.queries["udp", stats_qtype(query.qtype), "NOERROR+TC"] += 1
    stats.truncated += 1
    return wire
