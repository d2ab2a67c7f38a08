"""Writing DNS responses: header, question, the few record types an authority for GTM serves,
the OPT record, and truncation.

Hand-written rather than dnspython's renderer because a response costs microseconds here, not a
quarter of a millisecond; the set of record types is small (SOA, NS, A, AAAA, OPT, and the static
records' CNAME, TXT, CAA, MX, SRV; names in RDATA are written uncompressed). Records
owned by the question name point back to it (compression pointer to offset 12, RFC 1035 §4.1.4),
which also echoes the question's letter case into the answer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from gtm.geodns.wire import HEADER, OPT, ClientSubnet, Rcode

QUESTION_POINTER = b"\xc0\x0c"
QR, AA, TC = 0x8000, 0x0400, 0x0200
# Copied from the query: the opcode (so NOTIMP names what was not implemented), RD and CD
# (RFC 1035 §4.1.1, RFC 6840 §5.9). RA, Z and AD are always clear (RFC 8906 §6).
COPIED_FLAGS = 0x7800 | 0x0100 | 0x0010

_RR = struct.Struct("!HHIH")
_SOA_TAIL = struct.Struct("!IIIII")
_U16 = struct.Struct("!H")
_SRV = struct.Struct("!HHH")
OUR_UDP_SIZE = 1232  # DNS flag day 2020: fits an IPv6 path without fragmentation


def name_wire(name: str) -> bytes:
    """An absolute presentation name ("a.b.") in uncompressed wire form."""
    if name == ".":
        return b"\x00"
    labels = name.rstrip(".").split(".")
    return b"".join(bytes([len(label)]) + label.encode("ascii") for label in labels) + b"\x00"


def record(owner: bytes, rtype: int, ttl: int, rdata: bytes, rclass: int = 1) -> bytes:
    return owner + _RR.pack(rtype, rclass, ttl, len(rdata)) + rdata


def a_rdata(address: str) -> bytes:
    return IPv4Address(address).packed


def aaaa_rdata(address: str) -> bytes:
    return IPv6Address(address).packed


def soa_rdata(
    mname: str, rname: str, serial: int, refresh: int, retry: int, expire: int, minimum: int
) -> bytes:
    return (
        name_wire(mname)
        + name_wire(rname)
        + _SOA_TAIL.pack(serial, refresh, retry, expire, minimum)
    )


def txt_rdata(strings: tuple[bytes, ...]) -> bytes:
    """Character-strings, each at most 255 octets, each after its length octet (RFC 1035
    §3.3.14)."""
    return b"".join(bytes([len(s)]) + s for s in strings)


def caa_rdata(flags: int, tag: str, value: str) -> bytes:
    """RFC 8659 §4.1: flags, tag length, tag, value (to the end of the RDATA)."""
    return bytes([flags, len(tag)]) + tag.encode("ascii") + value.encode("ascii")


def mx_rdata(preference: int, exchange: str) -> bytes:
    return _U16.pack(preference) + name_wire(exchange)


def srv_rdata(priority: int, weight: int, port: int, target: str) -> bytes:
    # RFC 2782: the target is never compressed.
    return _SRV.pack(priority, weight, port) + name_wire(target)


@dataclass(frozen=True, slots=True)
class OptOut:
    """The OPT record of a response: present exactly when the query had one."""

    do: bool
    ecs: ClientSubnet | None  # echoed with ``scope`` when the query carried one
    scope: int = 0

    def wire(self, rcode: int) -> bytes:
        options = b""
        if self.ecs is not None:
            body = struct.pack("!HBB", self.ecs.family, self.ecs.source, self.scope)
            body += self.ecs.address
            options = struct.pack("!HH", 8, len(body)) + body
        # Extended rcode high bits, version 0, only the DO flag echoed (RFC 6891 §6.1.4).
        ttl = ((rcode >> 4) << 24) | (0x8000 if self.do else 0)
        return b"\x00" + _RR.pack(OPT, OUR_UDP_SIZE, ttl, len(options)) + options


def response(
    qid: int,
    query_flags: int,
    rcode: int,
    *,
    authoritative: bool,
    question: bytes | None,
    answer: list[bytes] | tuple[bytes, ...] = (),
    authority: list[bytes] | tuple[bytes, ...] = (),
    additional: list[bytes] | tuple[bytes, ...] = (),
    opt: OptOut | None = None,
    limit: int | None = None,
    optional_additional: bool = False,
) -> bytes:
    """A complete response. ``question`` is the question section as bytes (name + type + class)
    or None; with ``limit`` (UDP), a response that does not fit is cut to its question and OPT
    with TC set, so the client retries over TCP (RFC 1035 §4.2.1, RFC 7766).
    ``optional_additional``: the additional records are extra help (addresses of MX and SRV
    targets); when only they do not fit they are left out and TC stays clear (RFC 2181 §9)."""
    if optional_additional and additional and limit is not None:
        full = response(
            qid,
            query_flags,
            rcode,
            authoritative=authoritative,
            question=question,
            answer=answer,
            authority=authority,
            additional=additional,
            opt=opt,
        )
        if len(full) <= limit:
            return full
        additional = ()
    flags = QR | (query_flags & COPIED_FLAGS) | (rcode & 0xF)
    if authoritative:
        flags |= AA
    opt_wire = opt.wire(rcode) if opt is not None else b""
    qd = 1 if question else 0
    body = (question or b"") + b"".join(answer) + b"".join(authority) + b"".join(additional)
    wire = (
        HEADER.pack(
            qid,
            flags,
            qd,
            len(answer),
            len(authority),
            len(additional) + (1 if opt is not None else 0),
        )
        + body
        + opt_wire
    )
    if limit is not None and len(wire) > limit:
        wire = (
            HEADER.pack(qid, flags | TC, qd, 0, 0, 1 if opt is not None else 0)
            + (question or b"")
            + opt_wire
        )
    return wire


def rcode_name(rcode: int) -> str:
    try:
        return Rcode(rcode).name
    except ValueError:
        return str(rcode)
