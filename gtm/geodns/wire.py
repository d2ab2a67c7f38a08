"""Parsing DNS queries from the wire: the one parse function every listener (and the fuzzer) uses.

:func:`parse_query` turns a datagram or TCP message into a :class:`Query`, or says what to do
with a packet that is not one: drop it (no readable header, or a response) or answer it with
FORMERR / NOTIMP, with the ID echoed. It never raises on any input, and bounds every loop
(compression pointers can only point backwards, a name is at most 255 octets, counts are
checked against the bytes actually present), so no packet can crash or stall a listener.

RFC references: 1035 §4 (message format), 6891 (EDNS0, OPT), 7871 (Client Subnet), 6840 §5.9
(CD is copied), 8906 (what a server must do with unknown bits, types and options).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from typing import NamedTuple

from gtm.decision.memos import DEFAULT_BUDGET_MB, tables_mb

IPAddress = IPv4Address | IPv6Address

HEADER = struct.Struct("!HHHHHH")
_U16 = struct.Struct("!H")
_OPTION = struct.Struct("!HH")  # an EDNS option's code and length
_RR_FIXED = struct.Struct("!HHIH")  # type, class, ttl, rdlength
_Q_FIXED = struct.Struct("!HH")

MAX_NAME = 255
OPT = 41
NSID_CODE = 3
ECS_CODE = 8
COOKIE_CODE = 10


class Rcode(IntEnum):
    NOERROR = 0
    FORMERR = 1
    SERVFAIL = 2
    NXDOMAIN = 3
    NOTIMP = 4
    REFUSED = 5
    BADVERS = 16  # extended: upper 8 bits in the OPT TTL
    BADCOOKIE = 23  # extended (RFC 7873 §8)


class Qtype(IntEnum):
    A = 1
    NS = 2
    CNAME = 5
    SOA = 6
    MX = 15
    TXT = 16
    AAAA = 28
    SRV = 33
    OPT = 41
    NXNAME = 128
    TKEY = 249
    TSIG = 250
    IXFR = 251
    AXFR = 252
    MAILB = 253
    MAILA = 254
    ANY = 255
    CAA = 257


QCLASS_IN = 1
QCLASS_ANY = 255


@dataclass(frozen=True, slots=True)
class ClientSubnet:
    """An EDNS Client Subnet option as received (RFC 7871 §6)."""

    family: int  # 1 IPv4, 2 IPv6
    source: int  # source prefix length
    address: bytes  # exactly ceil(source / 8) octets, bits past the prefix zero
    network: IPv4Network | IPv6Network


@dataclass(frozen=True, slots=True)
class Edns:
    udp_size: int
    version: int
    do: bool
    ecs: ClientSubnet | None
    nsid: bool = False  # the query asked for the server's identity (RFC 5001)
    # The COOKIE option's data (RFC 7873): a client cookie, and a server cookie when the
    # client has one of ours; its length checked (cookie_well_formed).
    cookie: bytes | None = None


class Query(NamedTuple):
    """A parsed query. A NamedTuple: built for every packet, and cheap to build."""

    id: int
    flags: int  # the query's flags word, as received
    qname: bytes  # the question name in wire form, case as asked, uncompressed
    qname_text: str  # lower-cased, absolute ("chat.gtm.example.")
    qtype: int
    qclass: int
    edns: Edns | None

    @property
    def rd(self) -> bool:
        return bool(self.flags & 0x0100)

    @property
    def cd(self) -> bool:
        return bool(self.flags & 0x0010)


@dataclass(frozen=True, slots=True)
class Reject:
    """A packet that gets an error answer (FORMERR, NOTIMP, BADVERS) or none at all."""

    id: int | None  # None: no readable header, drop silently
    flags: int
    rcode: Rcode
    reason: str
    # What of the question could be read, so the error can echo it (RFC 1035 §4.1.1).
    qname: bytes | None = None
    qtype: int = 0
    qclass: int = 0
    edns: Edns | None = None

    @property
    def drop(self) -> bool:
        return self.id is None


class _Malformed(Exception):
    """Internal: the packet breaks the format at this point."""


class _MalformedOption(_Malformed):
    """Internal: the OPT record itself is sound but one of its options is not (a bad ECS
    option, say). The FORMERR still carries an OPT (RFC 6891 §6.1.1: a responder that
    understood the query's OPT answers with one), so the record's own fields come along."""

    def __init__(self, reason: str, edns: Edns) -> None:
        super().__init__(reason)
        self.edns = edns


# Labels read (pointers followed included) in one packet's names, at most. A pointer can make
# every 6-octet question or 12-octet record re-read a 127-label name: 10,000 such questions in
# a 64 KB message cost 0.3 s to parse. No query needs more than a few names.
LABEL_BUDGET = 1024


def _read_name(wire: bytes, offset: int, budget: list[int]) -> tuple[bytes, int]:
    """A possibly compressed name: (uncompressed wire form, offset after it in the packet).
    ``budget``: labels the packet may still have read (:data:`LABEL_BUDGET`), decreased."""
    labels: list[bytes] = []
    length = 0
    end: int | None = None
    pos = offset
    # Pointers must point strictly backwards (before the label that holds them): that makes a
    # loop impossible, whatever the packet says.
    limit = offset
    while True:
        if pos >= len(wire):
            raise _Malformed("name runs past the end of the packet")
        budget[0] -= 1
        if budget[0] < 0:
            raise _Malformed("more names than a query holds")
        n = wire[pos]
        kind = n & 0xC0
        if kind == 0xC0:
            if pos + 1 >= len(wire):
                raise _Malformed("truncated compression pointer")
            target = ((n & 0x3F) << 8) | wire[pos + 1]
            if target >= limit:
                raise _Malformed("compression pointer does not point backwards")
            if end is None:
                end = pos + 2
            pos = limit = target
            continue
        if kind:
            raise _Malformed("unknown label type")
        if n == 0:
            length += 1
            if length > MAX_NAME:
                raise _Malformed("name longer than 255 octets")
            labels.append(b"\x00")
            return b"".join(labels), (end if end is not None else pos + 1)
        if pos + 1 + n > len(wire):
            raise _Malformed("label runs past the end of the packet")
        length += 1 + n
        if length > MAX_NAME:
            raise _Malformed("name longer than 255 octets")
        labels.append(wire[pos : pos + 1 + n])
        pos += 1 + n


def name_to_text(name: bytes) -> str:
    """Lower-cased presentation form of a wire name ("." for the root)."""
    out: list[str] = []
    pos = 0
    while name[pos]:
        n = name[pos]
        out.append(name[pos + 1 : pos + 1 + n].decode("latin-1").lower())
        pos += 1 + n
    return ".".join(out) + "." if out else "."


def _parse_ecs(data: bytes) -> ClientSubnet:
    if len(data) < 4:
        raise _Malformed("ECS option shorter than 4 octets")
    # data[3] is the scope, which queries must send as 0 (RFC 7871 §6); a resolver that
    # does not is answered anyway, its scope ignored.
    family, source = _U16.unpack_from(data)[0], data[2]
    address = data[4:]
    if family not in (1, 2):
        raise _Malformed(f"ECS family {family} is unknown")
    bits = 32 if family == 1 else 128
    if source > bits:
        raise _Malformed("ECS source prefix longer than the address")
    if len(address) != (source + 7) // 8:
        raise _Malformed("ECS address length does not match the source prefix")
    value = int.from_bytes(address, "big") << (bits - 8 * len(address)) if address else 0
    if source < bits and value & ((1 << (bits - source)) - 1):
        raise _Malformed("ECS address has bits set beyond the source prefix")
    network: IPv4Network | IPv6Network = (
        IPv4Network((value, source)) if family == 1 else IPv6Network((value, source))
    )
    return ClientSubnet(family, source, address, network)


def cookie_well_formed(length: int) -> bool:
    """Whether a COOKIE option of ``length`` octets is one (RFC 7873 §5.2.2): a client cookie
    alone (8), or with a server cookie of 8 to 32 octets; anything else is FORMERR.

    >>> [n for n in range(0, 42) if cookie_well_formed(n)] == [8, *range(16, 41)]
    True
    """
    return length == 8 or 16 <= length <= 40


def cookie_option(wire: bytes) -> bytes | None:
    """The COOKIE option of a plain query (one uncompressed question, an OPT record alone in
    the additional section), read without parsing the rest; None for any other packet, or
    one without a well-formed option. Where a full parse would cost too much: every datagram
    of a protected socket behind a flood (gtm.geodns.udp). Any query it reads a cookie from,
    :func:`parse_query` reads the same cookie from (tests/gtm/geodns/test_wire.py).

    >>> import dns.edns, dns.message
    >>> q = dns.message.make_query("a.example.", "A", use_edns=0,
    ...     options=[dns.edns.GenericOption(10, b"cookie!!")])
    >>> cookie_option(q.to_wire()), cookie_option(q.to_wire()[:-1])
    (b'cookie!!', None)
    """
    size = len(wire)
    if size < 28 or wire[2] & 0xF8 or wire[4:12] != b"\x00\x01\x00\x00\x00\x00\x00\x01":
        return None  # QR set, an opcode other than QUERY, or not one question and an OPT
    pos = 12
    while pos < size:
        n = wire[pos]
        if n == 0 or n > 63:
            break
        pos += n + 1
    if pos >= size or wire[pos] or pos - 11 > MAX_NAME:
        return None
    pos += 5  # the root label, QTYPE and QCLASS: the OPT record's owner next
    if pos + 11 > size or wire[pos : pos + 3] != b"\x00\x00\x29":
        return None
    end = pos + 11 + _U16.unpack_from(wire, pos + 9)[0]
    if end != size:
        return None
    pos += 11
    cookie: bytes | None = None
    while pos + 4 <= end:
        code, length = _OPTION.unpack_from(wire, pos)
        pos += 4
        if pos + length > end:
            return None
        if code == COOKIE_CODE:
            if cookie is not None or not cookie_well_formed(length):
                return None
            cookie = wire[pos : pos + length]
        pos += length
    return cookie if pos == end else None


def _parse_opt(wire: bytes, rr_class: int, ttl: int, rdata_start: int, rdlength: int) -> Edns:
    version = (ttl >> 16) & 0xFF
    do = bool(ttl & 0x8000)
    # Advertised sizes below 512 are treated as 512 (RFC 6891 §6.2.5).
    udp_size = max(rr_class, 512)
    ecs: ClientSubnet | None = None
    nsid = False
    cookie: bytes | None = None
    cookie_error = False  # the COOKIE option itself is malformed: none is echoed
    # The first option found malformed: the others are still walked (while their framing
    # holds), so that a FORMERR for a bad ECS option answers an NSID asked after it too, and
    # carries the cookie a well-formed COOKIE option brought (RFC 7873 §5.2: every response
    # to a query with a client cookie holds one, except when that option is the fault).
    error: str | None = None
    pos, end = rdata_start, rdata_start + rdlength
    while pos < end:
        if pos + 4 > end:
            error = error or "truncated EDNS option header"
            break
        code, length = struct.unpack_from("!HH", wire, pos)
        pos += 4
        if pos + length > end:
            error = error or "EDNS option length runs past the OPT record"
            break
        if code == ECS_CODE:
            if ecs is not None or error is not None:
                error = error or "more than one ECS option"
            else:
                try:
                    ecs = _parse_ecs(wire[pos : pos + length])
                except _Malformed as exc:
                    error = str(exc)
        elif code == NSID_CODE:
            nsid = True  # its payload, empty in a query (RFC 5001 §2.1), is not read
        elif code == COOKIE_CODE:
            # Any other length, or a second COOKIE option, is FORMERR (RFC 7873 §5.2.2).
            if cookie is not None:
                error = error or "more than one COOKIE option"
                cookie_error = True
            elif cookie_well_formed(length):
                cookie = wire[pos : pos + length]
            else:
                error = error or f"COOKIE option of {length} octets"
                cookie_error = True
        # Other options (padding, unknown codes) are ignored and never echoed
        # (RFC 6891 §6.1.2, RFC 8906 §8.2.3).
        pos += length
    if error is not None:
        kept = None if cookie_error else cookie
        raise _MalformedOption(error, Edns(udp_size, version, do, None, nsid, kept))
    return Edns(udp_size, version, do, ecs, nsid, cookie)


_NAMES: dict[bytes, str] = {}
_OPTS: dict[bytes, Edns] = {}
# Decoded names and OPT records (an ECS OPT holds a network object: ~450 bytes), and sender
# addresses: each memo at most ``_memo_limit`` entries, a share of the DNS budget set at start
# (bound_memos; gtm.geodns.budget counts PARSED_SHARE among its tables'), as random names,
# subnets and spoofed senders would otherwise fill them (DESIGN.md rule 8).
PARSED_ENTRY_BYTES = 750  # a name, an OPT record and a sender address: an entry in each memo
PARSED_SHARE = 0.015
_MIN_PARSED = 16


def parsed_entries(budget_mb: float) -> int:
    """Entries of each parse memo under a DNS budget of ``budget_mb`` MiB."""
    entries = tables_mb(budget_mb) * (1 << 20) * PARSED_SHARE / PARSED_ENTRY_BYTES
    return max(_MIN_PARSED, int(entries))


_memo_limit = parsed_entries(DEFAULT_BUDGET_MB)  # until bound_memos()
_ADDRESSES: dict[str, IPAddress] = {}


def bound_memos(entries: int) -> None:
    """Bound each parse memo to ``entries`` (once at start; a memo past it is cleared at its
    next insertion)."""
    global _memo_limit
    _memo_limit = entries


def peer_address(host: str) -> IPAddress:
    """A sender's address from the host string its socket gives (memoised; zone id dropped)."""
    addr = _ADDRESSES.get(host)
    if addr is None:
        if len(_ADDRESSES) >= _memo_limit:
            _ADDRESSES.clear()
        addr = _ADDRESSES[host] = ip_address(host.split("%", 1)[0])
    return addr


def parse_query(wire: bytes) -> Query | Reject:
    """Parse one query; never raises. See the module docstring for what is rejected.

    Nearly every query has one uncompressed question, empty answer and authority sections and
    at most an OPT record; those take a short path that reuses the decoded name and OPT record
    of earlier identical bytes. Anything else takes the general path, which gives the same
    result for these packets too (the test suite checks that on fuzzed input).
    """
    if (
        len(wire) >= 17
        and wire[4:9] == b"\x00\x01\x00\x00\x00"
        and wire[9] == 0
        and wire[10] == 0
        and wire[11] <= 1
        and not wire[2] & 0xF8
    ):
        # QDCOUNT 1, ANCOUNT 0, NSCOUNT 0, ARCOUNT <= 1, QR 0, opcode 0.
        pos, size = 12, len(wire)
        while pos < size:
            n = wire[pos]
            if n == 0 or n > 63:
                break
            pos += n + 1
        if pos < size and wire[pos] == 0 and pos - 11 <= MAX_NAME and pos + 5 <= size:
            qname = wire[12 : pos + 1]
            rest = wire[pos + 5 :]
            edns: Edns | None = None
            if wire[11] == 1:
                edns = _OPTS.get(rest)
                if edns is None:
                    return _parse_general(wire)  # first sight of this OPT, or not an OPT
            elif rest:
                return _parse_general(wire)
            if edns is None or edns.version == 0:
                text = _NAMES.get(qname)
                if text is None:
                    if len(_NAMES) >= _memo_limit:
                        _NAMES.clear()
                    text = _NAMES[qname] = name_to_text(qname)
                qtype, qclass = _Q_FIXED.unpack_from(wire, pos + 1)
                return Query(
                    _U16.unpack_from(wire)[0],
                    _U16.unpack_from(wire, 2)[0],
                    qname,
                    text,
                    qtype,
                    qclass,
                    edns,
                )
    return _parse_general(wire)


def _remember_opt(record: bytes, edns: Edns) -> None:
    if len(_OPTS) >= _memo_limit:
        _OPTS.clear()
    _OPTS[record] = edns


def _parse_general(wire: bytes) -> Query | Reject:
    if len(wire) < HEADER.size:
        return Reject(None, 0, Rcode.FORMERR, "shorter than a header")
    qid, flags, qdcount, ancount, nscount, arcount = HEADER.unpack_from(wire)
    if flags & 0x8000:
        return Reject(None, flags, Rcode.FORMERR, "a response, not a query")  # never answer
    opcode = (flags >> 11) & 0xF
    qname: bytes | None = None
    qtype = qclass = 0
    edns: Edns | None = None
    opt_record: bytes | None = None
    budget = [LABEL_BUDGET]
    try:
        # Every question is read, so that the records after them are too: a FORMERR for a
        # QDCOUNT other than 1 carries the query's OPT when it is readable (RFC 6891 §7), as
        # Knot's does. Only a single question is echoed.
        pos = HEADER.size
        for index in range(qdcount):
            name, pos = _read_name(wire, pos, budget)
            if pos + 4 > len(wire):
                raise _Malformed("truncated question")
            if qdcount == 1 and index == 0:
                qname = name
                qtype, qclass = _Q_FIXED.unpack_from(wire, pos)
            pos += 4
        for section, count in (
            ("answer", ancount),
            ("authority", nscount),
            ("additional", arcount),
        ):
            for _ in range(count):
                rr_start = pos
                owner, pos = _read_name(wire, pos, budget)
                if pos + _RR_FIXED.size > len(wire):
                    raise _Malformed(f"truncated {section} record")
                rr_type, rr_class, ttl, rdlength = _RR_FIXED.unpack_from(wire, pos)
                pos += _RR_FIXED.size
                if pos + rdlength > len(wire):
                    raise _Malformed(f"{section} record data runs past the end")
                if rr_type == OPT:
                    if section != "additional" or owner != b"\x00":
                        raise _Malformed(
                            "OPT record outside the additional section or not at the root"
                        )
                    if edns is not None:
                        raise _Malformed("more than one OPT record")
                    edns = _parse_opt(wire, rr_class, ttl, pos, rdlength)
                    opt_record = wire[rr_start : pos + rdlength]
                pos += rdlength
        if pos != len(wire):
            raise _Malformed("trailing bytes after the last record")
        if opcode == 0 and qdcount != 1:
            raise _Malformed(f"QDCOUNT is {qdcount}, not 1")
        if (
            opcode == 0
            and opt_record is not None
            and arcount == 1
            and opt_record == wire[-len(opt_record) :]
        ):
            _remember_opt(opt_record, edns)  # type: ignore[arg-type]
    except _Malformed as exc:
        if isinstance(exc, _MalformedOption) and edns is None:
            edns = exc.edns
        if opcode == 0:
            return Reject(qid, flags, Rcode.FORMERR, str(exc), qname, qtype, qclass, edns)
    if opcode != 0:
        # An opcode this server does not implement: NOTIMP whatever follows the header (its
        # format is the opcode's), with the question and OPT when they could be read, as
        # Knot answers. The flags echoed are trimmed where the response is written.
        return Reject(qid, flags, Rcode.NOTIMP, f"opcode {opcode}", qname, qtype, qclass, edns)
    if edns is not None and edns.version > 0:
        return Reject(
            qid, flags, Rcode.BADVERS, f"EDNS version {edns.version}", qname, qtype, qclass, edns
        )
    assert qname is not None  # QDCOUNT 1 was read, or the parse raised
    return Query(qid, flags, qname, name_to_text(qname), qtype, qclass, edns)
