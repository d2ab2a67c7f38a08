"""The ECS path: answers for new client subnets without parsing or deciding again.

A resolver asks for the same few names over and over, each time with another client subnet.
Its queries then differ only in the ID and the ECS address, which ends the message (the ECS
option is the OPT record's last, and the OPT record the message's). Such a query's bytes after
the ID and before the address are its :class:`Shape`, kept per sender once the slow path has
answered one (:meth:`Shape.of`). Another query with the same shape needs no parsing: the
address is its last bytes.

What a decision depends on, for a client subnet, is where the GeoIP database places it
(country, continent, coordinates) unless a re-admission or spill share splits clients by their
network (``Decision.by_network``). So a shape's answers are rendered once per GeoIP *place*
(:class:`Placed`): a random-subnet flood of 200,000 /24s lands in some 97,000 GeoIP networks
but only about 23,000 places, and the answer for every subnet of a place is that rendering with
the query's ID, its ECS address and the scope of its own GeoIP network patched in. Residency is
the same decision's: the place holds the country and continent the rules read, and the shape
belongs to one sender, so an untrusted resolver's own place is judged as the slow path does.

A subnet asked for again is answered from memory: the responder keeps each (shape, subnet)'s
:class:`Face` (the answer of its place for its GeoIP network's prefix length), so it needs no
GeoIP lookup, and looks its network up among those counted on rows of their own by one integer
(:attr:`Face.base` and the network number).

The audit keeps each answer's client at its GeoIP network's precision (the row the slow path
would write, :mod:`gtm.geodns.precision`) while the audit writer keeps up. When new rows would
outrun it (more new decisions since the last seal than the budget's ``audit_records``), answers
are counted per decision and coarse client bucket instead (:func:`fold_bucket`: the IPv4 /8,
the IPv6 /20) until the next seal: every answer is still counted (DESIGN.md rule 2), on a few
hundred rows rather than one per attacker subnet, and nothing is shed. A folded row names the
bucket as its client network and ECS prefix; a replay says it stands for the bucket.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from gtm.audit.record import FOLD_V4, FOLD_V6, AuditRecord
from gtm.decision.model import Basis
from gtm.geodns.wire import ClientSubnet, Query, parse_query

IPAddress = IPv4Address | IPv6Address

# The client networks a query's shape may carry: at most the precision the audit records (the
# ECS source is then at least as wide as any client network recorded). A source that is not a
# whole octet (/20, /36) leaves bits in the address's last octet that must be zero (RFC 7871
# §6); Shape.mask names them, and a query with any set goes the long way (FORMERR).
_MAX_SOURCE = {1: 24, 2: 56}
SCOPES = [bytes((i,)) for i in range(129)]  # the ECS echo's scope octet, prebuilt


@dataclass(slots=True, eq=False)
class Shape:
    """One sender's query, but for its ID and ECS address (hashed by identity)."""

    query: Query  # the first query of the shape, parsed
    client: IPAddress  # the sender
    limit: int  # the UDP size the response is cut to
    family: int
    source: int
    size: int  # octets of ECS address ending the message
    pad: int  # bits past the address in a full-length address
    mask: int  # bits of the address octets past the source prefix (0 for whole octets)
    # Whose address residency is judged on, for this sender (worked out on first use; the
    # shape goes with the snapshot's policy, gtm.geodns.responder drops shapes with it).
    basis: Basis | None = None
    # Added to a subnet's address (its ECS octets as an integer) to key the subnet in the
    # responder's memo: unique per shape (the responder's count of shapes, above any address).
    tag: int = 0

    @classmethod
    def of(cls, wire: bytes, query: Query, client: IPAddress, limit: int) -> Shape | None:
        """The shape of ``wire`` (parsed as ``query``), or None when the ECS path cannot take
        its kind: no ECS, a source length it does not take, an ECS not ending the message, or
        a DNS cookie."""
        ecs: ClientSubnet | None = query.edns.ecs if query.edns is not None else None
        if ecs is None or not 0 < ecs.source <= _MAX_SOURCE[ecs.family]:
            return None
        if query.edns is not None and query.edns.cookie is not None:
            # Its response carries a cookie for this client and time (gtm.geodns.cookies),
            # which a rendering per place cannot: such queries take the slow path.
            return None
        size = len(ecs.address)
        mask = (1 << (8 * size - ecs.source)) - 1
        # The message's last bytes must be the address the parser read, not other bytes that
        # look alike (another option ending the message may carry a copy of the ECS option):
        # parse the query once with them changed (the prefix's bits; the rest stay zero).
        prefix_bits = ((1 << 8 * size) - 1) & ~mask
        value = int.from_bytes(ecs.address, "big") ^ prefix_bits
        flipped = value.to_bytes(size, "big")
        probe = parse_query(wire[:-size] + flipped)
        if not isinstance(probe, Query) or probe.edns is None or probe.edns.ecs is None:
            return None
        if probe.edns.ecs.address != flipped:
            return None
        bits = 32 if ecs.family == 1 else 128
        return cls(query, client, limit, ecs.family, ecs.source, size, bits - 8 * size, mask)

    @property
    def version(self) -> int:
        return 4 if self.family == 1 else 6

    @property
    def bits(self) -> int:
        return 32 if self.family == 1 else 128


@dataclass(slots=True, eq=False)
class Placed:
    """A shape's answer for one GeoIP place, rendered once (hashed by identity)."""

    body: bytes  # the response after its ID, up to the ECS echo's scope octet
    scoped: bool  # the scope is the client's GeoIP network (else 0: the same everywhere)
    record: AuditRecord  # the audit record of the subnet it was rendered for
    blank: AuditRecord  # the same, its client left out: equal for equal decisions
    stats_key: tuple[str, str, str]
    truncated: bool
    serial: int = 0  # unique per rendering: its networks' keys start with it (Face.base)
    # Its faces by prefix length, held weakly: a face holds its rendering, and a strong link
    # back would make each pair a reference cycle. The heap keeper freezes what survives a
    # young collection (gtm.heap), so a rendering dropped by the responder's tables would stay
    # until the next full collection, minutes away: under a random-subnet flood, thousands of
    # them a minute outside the memory budget. Held weakly, a rendering and its faces go as
    # soon as the memo's last subnet of them does.
    faces: dict[int, weakref.ref[Face]] = field(default_factory=dict)

    def face(self, prefix_len: int, bits: int) -> Face:
        """This answer for the client networks of ``prefix_len`` (of ``bits``-bit addresses)."""
        held = self.faces.get(prefix_len)
        face = held() if held is not None else None
        if face is None:
            face = Face(self, prefix_len, bits)
            self.faces[prefix_len] = weakref.ref(face)
        return face


class Face:
    """A shape's answer as the subnets of GeoIP networks of one prefix length in one place get
    it: the response up to the ECS address (the rendering and the networks' scope), and how
    a subnet's network is keyed among those counted on rows of their own. The ECS path's memo
    maps each client subnet to its face: a few thousand faces for 200,000 subnets."""

    __slots__ = ("__weakref__", "base", "head", "placed", "prefix_len", "shift")

    def __init__(self, placed: Placed, prefix_len: int, bits: int) -> None:
        self.placed = placed
        self.prefix_len = prefix_len
        self.head = placed.body + SCOPES[prefix_len if placed.scoped else 0]
        # A network's key: one integer, cheaper to hash and keep than a tuple.
        self.base = (placed.serial << 136) | (prefix_len << 128)
        self.shift = bits - prefix_len


def with_client(record: AuditRecord, network: str, ecs: str | None) -> AuditRecord:
    """``record`` for another client network (and ECS prefix). Field by field: several times
    cheaper than :func:`dataclasses.replace`, and made for every new network of a flood."""
    r = record
    return AuditRecord(
        r.channel,
        r.query_type,
        r.response,
        network,
        ecs,
        r.country,
        r.continent,
        r.name,
        r.service,
        r.residency_classes,
        r.tenant,
        r.matched_rules,
        r.snapshot_version,
        r.topology_version,
        r.policy_version,
        r.geoip_build,
        r.candidates,
        r.region,
        r.answer,
        r.outcome,
        r.ttl,
    )


def network_text(version: int, value: int, prefix_len: int) -> str:
    """The network of ``prefix_len`` holding an address (version and integer), as text."""
    shift = (32 if version == 4 else 128) - prefix_len
    network: IPv4Network | IPv6Network = (
        IPv4Network((value >> shift << shift, prefix_len))
        if version == 4
        else IPv6Network((value >> shift << shift, prefix_len))
    )
    return str(network)


def fold_bucket(family: int, address: int) -> str:
    """The bucket a folded row counts a client in, as text, from the integer of a
    full-length address."""
    if family == 1:
        shift = 32 - FOLD_V4
        return str(IPv4Network((address >> shift << shift, FOLD_V4)))
    shift = 128 - FOLD_V6
    return str(IPv6Network((address >> shift << shift, FOLD_V6)))
