"""Records of a response in wire form, for the signer to splice RRSIGs and NSECs into an
unsigned response without parsing and rendering it again (:mod:`gtm.geodns.dnssec`), and the
RRSIG of an RRset whose data is its own canonical form, framed and signed here.

A response is split into its records (:func:`split`) only when every owner name is the question
(a pointer to it) or written out, and no record data holds a compressed name: then each record's
bytes mean the same in any message, and can be reassembled (:func:`assemble`) with others.
"""

from __future__ import annotations

import struct

import dns.name
import dns.rdata
import dns.rdataclass
import dns.rdatatype
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from gtm.geodns.dnssec_keys import ALGORITHM, ZoneKey

NSEC = int(dns.rdatatype.NSEC)
HEADER = struct.Struct("!HHHHHH")
RR = struct.Struct("!HHIH")
TO_QUESTION = b"\xc0\x0c"  # a compression pointer to the question name
NS, SOA, CNAME, OPT, ANY = 2, 6, 5, 41, 255
# Record types whose data holds no domain name (their bytes mean the same in any message), and
# where the names are in those that do: checked to be uncompressed before the bytes are reused.
_NO_NAMES = frozenset({1, 13, 16, 28, 43, 44, 48, 50, 51, 52, 53, 64, 65, 99, 256, 257})
_NAMES_AT = {2: 0, 5: 0, 12: 0, 39: 0, 15: 2, 33: 6, 47: 0}

# Types whose data is its own canonical form (RFC 4034 §6.2 lower-cases names in the data of
# the others; RFC 6840 §5.1 took NSEC off that list): their RRSIGs are framed by frame_and_sign.
CANONICAL = _NO_NAMES | {NSEC}
_ECDSA = ec.ECDSA(hashes.SHA256(), deterministic_signing=True)  # RFC 6979, as dnspython signs
_RRSIG_FIXED = struct.Struct("!HBBIIIH")  # type covered .. key tag (RFC 4034 §3.1)
_RR_FIXED = struct.Struct("!HHI")


def _labels(name: bytes) -> int:
    """The RRSIG's label count of an owner in wire form: its labels, a leading "*" left out
    (RFC 4034 §3.1.3)."""
    count = pos = 0
    while name[pos]:
        count += 1
        pos += name[pos] + 1
    return count - 1 if name[:2] == b"\x01*" else count


def frame_and_sign(
    key: ZoneKey,
    name: bytes,
    rtype: int,
    ttl: int,
    rdatas: list[bytes],
    signer: bytes,
    inception: int,
    expiration: int,
) -> bytes:
    """The RRSIG rdata over an RRset whose data is canonical as given (RFC 4034 §3.1.8.1: the
    RRSIG's fields and signer, then each record in canonical form and order, signed with
    ECDSA P-256 SHA-256 by ``cryptography``, the signature as r and s, RFC 6605 §4). ``name``
    and ``signer``: lower case, uncompressed. The same bytes as :func:`dns.dnssec.sign`
    (deterministic ECDSA); the tests compare them."""
    head = (
        _RRSIG_FIXED.pack(
            rtype,
            ALGORITHM,
            _labels(name),
            ttl,
            expiration & 0xFFFFFFFF,
            inception & 0xFFFFFFFF,
            key.tag,
        )
        + signer
    )
    fixed = name + _RR_FIXED.pack(rtype, 1, ttl)
    signed = head + b"".join(fixed + len(r).to_bytes(2, "big") + r for r in sorted(set(rdatas)))
    r, s = decode_dss_signature(key.private.sign(signed, _ECDSA))
    return head + r.to_bytes(32, "big") + s.to_bytes(32, "big")


# One record: (whole record, owner as written, owner lower case uncompressed, type, TTL, data).
Record = tuple[bytes, bytes, bytes, int, int, bytes]


def _name_end(wire: bytes, pos: int) -> int | None:
    """Where the uncompressed name at ``pos`` ends; None for a compressed or broken one."""
    size = len(wire)
    while pos < size:
        n = wire[pos]
        if n == 0:
            return pos + 1
        if n & 0xC0:
            return None
        pos += n + 1
    return None


def _plain_names(rtype: int, rdata: bytes) -> bool:
    """Whether the names in this record's data are uncompressed (trivially, for types without
    names); False for a type not known here."""
    if rtype in _NO_NAMES:
        return True
    at = _NAMES_AT.get(rtype)
    if at is not None:
        return _name_end(rdata, at) is not None
    if rtype == SOA:
        first = _name_end(rdata, 0)
        second = _name_end(rdata, first) if first is not None else None
        return second is not None and second + 20 == len(rdata)
    return False


def split(
    wire: bytes,
) -> tuple[bytes, int, list[Record], list[Record], list[Record], bytes] | None:
    """(question name lower case, end of the question, answer, authority, additional records,
    the OPT record) of a response the wire path can take, else None."""
    try:
        qdcount, ancount, nscount, arcount = HEADER.unpack_from(wire)[2:]
        qend = _name_end(wire, 12)
        if qdcount != 1 or qend is None:
            return None
        qname = wire[12:qend].lower()  # length octets are below 64: never changed by lower()
        pos = qend + 4
        sections: list[list[Record]] = [[], [], []]
        opt = b""
        for index, count in enumerate((ancount, nscount, arcount)):
            for _ in range(count):
                start = pos
                if wire[pos : pos + 2] == TO_QUESTION:
                    owner_end, name = pos + 2, qname
                else:
                    end = _name_end(wire, pos)
                    if end is None:
                        return None
                    owner_end, name = end, wire[pos:end].lower()
                rtype, rclass, ttl, rdlength = RR.unpack_from(wire, owner_end)
                pos = owner_end + 10 + rdlength
                if pos > len(wire):
                    return None
                if rtype == OPT:
                    opt = wire[start:pos]
                    continue
                rdata = wire[owner_end + 10 : pos]
                if rclass != 1 or not _plain_names(rtype, rdata):
                    return None
                sections[index].append(
                    (wire[start:pos], wire[start:owner_end], name, rtype, ttl, rdata)
                )
        if pos != len(wire):
            return None
    except (struct.error, IndexError):
        return None
    return qname, qend + 4, sections[0], sections[1], sections[2], opt


def make_record(owner: bytes, name: bytes, rtype: int, ttl: int, rdata: bytes) -> Record:
    return (owner + RR.pack(rtype, 1, ttl, len(rdata)) + rdata, owner, name, rtype, ttl, rdata)


def assemble(
    qid: int,
    flags: int,
    question: bytes,
    an: list[bytes],
    ns: list[bytes],
    ar: list[bytes],
    opt: bytes,
) -> bytes:
    counts = HEADER.pack(qid, flags, 1, len(an), len(ns), len(ar) + (1 if opt else 0))
    return counts + question + b"".join(an) + b"".join(ns) + b"".join(ar) + opt


def to_wire(thing: dns.rdata.Rdata | dns.name.Name) -> bytes:
    """Uncompressed wire form, letter case kept."""
    out = thing.to_wire()
    assert out is not None
    return out


def from_wire(rtype: int, data: bytes) -> dns.rdata.Rdata:
    return dns.rdata.from_wire(
        dns.rdataclass.IN, dns.rdatatype.RdataType.make(rtype), data, 0, len(data)
    )
