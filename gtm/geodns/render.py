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

from gtm.geodns.wire import HEADER, OPT, ClientSubnet, Edns, Rcode

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


# Record types whose data may hold compressed names (RFC 1035's, RFC 3597 §4: no other type's
# may be compressed; SRV's target never is, RFC 2782), and where their names are: the offset of
# the first, and how many follow one another (SOA: MNAME, RNAME, then five integers).
_NAMES_IN_DATA = {2: (0, 1), 5: (0, 1), 12: (0, 1), 15: (2, 1), 6: (0, 2)}


def _read_name(wire: bytes, pos: int) -> tuple[bytes, int]:
    """A name of a message this module wrote (pointers only backwards): its uncompressed wire
    form and the offset after it where it was read."""
    labels: list[bytes] = []
    end = -1
    while True:
        n = wire[pos]
        if n >= 0xC0:
            if end < 0:
                end = pos + 2
            target = ((n & 0x3F) << 8) | wire[pos + 1]
            if target >= pos:
                raise ValueError("compression pointer does not point backwards")
            pos = target
            continue
        labels.append(wire[pos : pos + 1 + n])
        if n == 0:
            return b"".join(labels), (end if end >= 0 else pos + 1)
        pos += 1 + n


def _write_name(out: bytearray, name: bytes, offsets: dict[bytes, int]) -> None:
    """``name`` at the end of ``out``: its longest suffix written before as a pointer to it,
    the labels in front written out (and kept as suffixes later names may point to)."""
    pos = 0
    while name[pos]:
        suffix = name[pos:].lower()
        at = offsets.get(suffix)
        if at is not None:
            out += (0xC000 | at).to_bytes(2, "big")
            return
        if len(out) < 0x4000:  # a pointer holds 14 bits
            offsets[suffix] = len(out)
        out += name[pos : pos + 1 + name[pos]]
        pos += 1 + name[pos]
    out.append(0)


def compress(wire: bytes) -> bytes:
    """A response with every name compressed (RFC 1035 §4.1.4): owner names, and the names in
    the data of the types that allow it (:data:`_NAMES_IN_DATA`). An NS answer with its glue
    goes from 246 octets to 164, as NSD, Knot and BIND send it; a signed answer fits a
    512-octet client that it did not fit uncompressed.

    Of the question, only its whole name is pointed to, never a suffix of it: the responder
    answers one name with the rendering of another of the same length (a name that does not
    exist, another letter case; gtm.geodns.responder), and a pointer into a suffix would then
    read another name's labels. Letter case is the first writing's: a pointer to the question
    echoes the asker's case, as a pointer to offset 12 always did here."""
    qdcount, ancount, nscount, arcount = HEADER.unpack_from(wire)[2:]
    out = bytearray(wire[:12])
    offsets: dict[bytes, int] = {}
    pos = 12
    for _ in range(qdcount):
        name, end = _read_name(wire, pos)
        if name != b"\x00" and name.lower() not in offsets:
            offsets[name.lower()] = len(out)
        out += name + wire[end : end + 4]
        pos = end + 4
    for _ in range(ancount + nscount + arcount):
        owner, pos = _read_name(wire, pos)
        rtype, rclass, ttl, rdlength = _RR.unpack_from(wire, pos)
        pos += _RR.size
        rdata = wire[pos : pos + rdlength]
        _write_name(out, owner, offsets)
        where = _NAMES_IN_DATA.get(rtype)
        if where is None:
            out += _RR.pack(rtype, rclass, ttl, rdlength) + rdata
        else:
            start, count = where
            head = len(out)
            out += _RR.pack(rtype, rclass, ttl, 0) + rdata[:start]
            at = pos + start
            for _ in range(count):
                name, at = _read_name(wire, at)
                _write_name(out, name, offsets)
            out += wire[at : pos + rdlength]
            struct.pack_into("!H", out, head + 8, len(out) - head - _RR.size)
        pos += rdlength
    if pos != len(wire):
        raise ValueError("bytes after the last record")
    return bytes(out)


def with_option(wire: bytes, code: int, data: bytes) -> bytes | None:
    """``wire`` with one more EDNS option, first in its OPT record (an ECS echo stays last, as
    the responder's ECS path needs); None when the OPT is not the message's last record (every
    response written here ends with it)."""
    counts = HEADER.unpack_from(wire)[2:]
    pos = 12
    for _ in range(counts[0]):
        pos = _read_name(wire, pos)[1] + 4
    start = -1
    for _ in range(sum(counts[1:])):
        start = pos
        pos = _read_name(wire, pos)[1]
        rdlength = _U16.unpack_from(wire, pos + 8)[0]
        pos += _RR.size + rdlength
    if start < 0 or wire[start] != 0 or _U16.unpack_from(wire, start + 1)[0] != OPT:
        return None
    rdlength = _U16.unpack_from(wire, start + 9)[0]
    option = struct.pack("!HH", code, len(data)) + data
    head = wire[: start + 9] + _U16.pack(rdlength + len(option))
    return head + option + wire[start + 11 :]


def udp_limit(edns: Edns | None) -> int:
    """The size a UDP response to a query with ``edns`` is cut to: never more than 1232
    whatever the client advertises (DNS flag day 2020); 512 without EDNS (RFC 1035 §4.2.1)."""
    return min(edns.udp_size, OUR_UDP_SIZE) if edns is not None else 512


def rcode_name(rcode: int) -> str:
    try:
        return Rcode(rcode).name
    except ValueError:
        return str(rcode)
