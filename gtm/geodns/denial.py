"""Compact denial of existence (RFC 9824, "black lies"): the NSEC of a negative answer.

A name that does not exist is answered NOERROR with an NSEC at the name whose next name is
``\\000.name`` and whose types are RRSIG, NSEC and NXNAME; a name without the type asked
(NODATA, the fail-closed NODATA of a policy included) gets an NSEC at the name listing the types
it has (``ZoneData.types_at``), never the type asked. An NSEC that covers only the name itself
says nothing about any other name, so nothing can be walked or synthesised from it.
"""

from __future__ import annotations

import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from gtm.decision.topology import in_zone
from gtm.geodns.splice import ANY, CNAME, SOA, TO_QUESTION, Record, from_wire, make_record, to_wire
from gtm.geodns.wire import Query, name_to_text
from gtm.geodns.zone import ZoneData

DNSKEY = int(dns.rdatatype.DNSKEY)
NSEC = int(dns.rdatatype.NSEC)
RRSIG = int(dns.rdatatype.RRSIG)
NXNAME = 128  # RFC 9824: the NSEC of a name that does not exist says so with this type
_NEVER_BELOW_APEX = frozenset({int(dns.rdatatype.NS), int(dns.rdatatype.SOA), DNSKEY, 43})  # DS
BLACK_LIE = "+NXNAME"  # the audit's response label of a name denied NOERROR (RFC 9824)


def type_bitmap(types: set[int]) -> bytes:
    """An NSEC type bitmap (RFC 4034 §4.1.2): per 256-type window, its number, length and
    bits, trailing zero octets left out."""
    windows: dict[int, bytearray] = {}
    for t in types:
        window, bit = divmod(t, 256)
        windows.setdefault(window, bytearray(32))[bit // 8] |= 0x80 >> (bit % 8)
    out = b""
    for window in sorted(windows):
        bits = bytes(windows[window]).rstrip(b"\x00")
        out += bytes([window, len(bits)]) + bits
    return out


def following(name: bytes) -> bytes:
    """``\\000.name``: the next name of a compact NSEC (the name itself when there is no room
    for another label)."""
    return b"\x01\x00" + name if len(name) + 2 <= 255 else name


def denial(
    qname: bytes,
    qtype: int,
    rcode: int,
    answer_records: list[Record],
    authority: list[Record],
    zone: ZoneData,
) -> tuple[Record, int, str] | None:
    """The NSEC of a negative answer (NXDOMAIN made NOERROR, RFC 9824), the response code and
    the audit label's suffix; None for a positive answer or a referral."""
    name = qname
    # Follow a CNAME chain in the answer: the denial is about where it ends.
    for _ in range(len(answer_records)):
        target = next(
            (r[5] for r in answer_records if r[2] == name and r[3] == CNAME and qtype != CNAME),
            None,
        )
        if target is None:
            break
        name = target.lower()
    if any(r[2] == name and qtype in (r[3], ANY) for r in answer_records):
        return None  # a positive answer
    soa = next((r for r in authority if r[3] == SOA), None)
    text = name_to_text(name)
    if soa is None or not in_zone(text, zone.apex):
        return None  # a referral or a CNAME out of the zone: nothing to deny here
    if rcode == 3:
        types = {RRSIG, NSEC, NXNAME}
        rcode, suffix = 0, BLACK_LIE
    else:
        types = listed(text, qtype, zone) | {RRSIG, NSEC}
        suffix = ""
    rdata = following(name) + type_bitmap(types)
    owner = TO_QUESTION if name == qname else name
    return make_record(owner, name, NSEC, soa[4], rdata), rcode, suffix  # RFC 9077: the SOA's TTL


def listed(text: str, qtype: int, zone: ZoneData) -> set[int]:
    """The types a NODATA's NSEC lists at ``text``: what is there, never the type asked."""
    return _present(text, zone) - {qtype}


def own_types(text: str, zone: ZoneData, exists: bool) -> set[int]:
    """The types of the NSEC that is at ``text`` under compact denial, the one a query of type
    NSEC is answered with: the name's types, RRSIG and NSEC (the NSEC and its signature are
    there); for a name that does not exist, RRSIG, NSEC and NXNAME (RFC 9824 §3.1: the name
    is said to exist and to hold that NSEC alone)."""
    if not exists:
        return {RRSIG, NSEC, NXNAME}
    return _present(text, zone) | {RRSIG, NSEC}


def nsec_rdata(name: bytes, types: set[int]) -> bytes:
    """The data of the compact NSEC at ``name`` (lower case, uncompressed wire form)."""
    return following(name) + type_bitmap(types)


def _present(text: str, zone: ZoneData) -> set[int]:
    present = set(zone.types_at(text))
    if text == zone.apex:
        present.add(DNSKEY)
    else:
        present -= _NEVER_BELOW_APEX
    return present


def deny_message(msg: dns.message.Message, query: Query, zone: ZoneData) -> str:
    """:func:`denial` on a parsed message (the general path)."""
    name = msg.question[0].name
    qtype = query.qtype
    for _ in range(len(msg.answer)):
        cname = next(
            (
                r
                for r in msg.answer
                if r.name == name and r.rdtype == dns.rdatatype.CNAME and qtype != r.rdtype
            ),
            None,
        )
        if cname is None:
            break
        name = cname[0].target
    if any(r.name == name and (qtype in (r.rdtype, ANY)) for r in msg.answer):
        return ""
    soa = next((r for r in msg.authority if r.rdtype == dns.rdatatype.SOA), None)
    text = name.to_text().lower()
    if soa is None or not in_zone(text, zone.apex):
        return ""
    if msg.rcode() == dns.rcode.NXDOMAIN:
        msg.set_rcode(dns.rcode.NOERROR)
        types, suffix = {RRSIG, NSEC, NXNAME}, BLACK_LIE
    else:
        types, suffix = listed(text, qtype, zone) | {RRSIG, NSEC}, ""
    msg.authority.append(nsec_rrset(name, soa.ttl, types))
    return suffix


def nsec_rrset(name: dns.name.Name, ttl: int, types: set[int]) -> dns.rrset.RRset:
    """The NSEC at ``name`` whose next name is ``\\000.name`` (RFC 9824 §3): it covers no name
    but ``name`` itself. The next name is lower case: an NSEC's rdata is signed as given
    (RFC 6840 §5.1), and the same record must not differ with the question's letter case."""
    lower = to_wire(name.canonicalize())
    rdata = following(lower) + type_bitmap(types)
    rrset = dns.rrset.RRset(name, dns.rdataclass.IN, dns.rdatatype.NSEC)
    rrset.update_ttl(ttl)
    rrset.add(from_wire(NSEC, rdata))
    return rrset
