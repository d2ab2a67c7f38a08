"""The responder's ECS path (gtm.geodns.shapes): a query of a shape its sender sent before,
answered from the rendering of its GeoIP place's location class, without parsing or deciding
again; and the shapes it learns from the queries the full path answers. A part of
:class:`gtm.geodns.responder.Responder` (its base class), apart for its size: the tables it
reads are the responder's, made in its ``__init__``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING

from gtm.audit.record import FOLD_V4, FOLD_V6, AuditRecord
from gtm.decision.geoip import Location
from gtm.decision.plan import location_class
from gtm.decision.routing import residency_basis, resolver_place, resolver_place_on
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Service
from gtm.geodns.budget import Admitted, Budget, Generations
from gtm.geodns.entries import Exact
from gtm.geodns.precision import holds_network_wide, patchable
from gtm.geodns.render import rcode_name
from gtm.geodns.shapes import Face, Placed, Shape, network_text, with_client
from gtm.geodns.stats import DnsStats
from gtm.geodns.wire import Query, parse_query
from gtm.geodns.zone import Answer, stats_qtype

IPAddress = IPv4Address | IPv6Address

# Under a GeoIP place's key (gtm.geodns.shapes): its answers differ by network, or do not end
# with the ECS echo: the slow path answers them.
_UNPLACED = Placed(b"", False, None, None, ("", "", ""), False)  # type: ignore[arg-type]
_NO_FACE = _UNPLACED.face(0, 32)  # in the memo: a subnet of such a place


class EcsPath:
    """The ECS path's methods of :class:`~gtm.geodns.responder.Responder`. What they read of
    the responder is declared here; the responder sets and defines it."""

    stats: DnsStats
    budget: Budget
    clock: Callable[[], float]
    _services: Mapping[str, Service]
    _tallied: list[Exact]
    _new_decisions: int
    _shapes: dict[str, dict[bytes, Shape]]
    _shape_count: int
    _sizes: tuple[int, ...]
    _placed: Generations[tuple[Shape, tuple[object, ...]], Placed]
    _subnets: Admitted[int, Face]
    _networks: Generations[int, Exact]
    _face_folds: dict[int, Exact]
    _renderings: int
    _serials: itertools.count[int]
    _classes: Generations[tuple[Shape, tuple[object, ...]], Placed]

    if TYPE_CHECKING:

        def _holding(self, now: float) -> Snapshot | None: ...

        def _keep(self, udp: bool, sender: str | IPAddress, key: bytes, exact: Exact) -> None: ...

        def _render(
            self,
            query: Query,
            client: IPAddress,
            snapshot: Snapshot,
            now: float,
            limit: int | None,
        ) -> Answer: ...

        def _intern(self, blank: AuditRecord) -> AuditRecord: ...

        def _fold(
            self,
            blank: AuditRecord,
            stats_key: tuple[str, str, str],
            truncated: bool,
            family: int,
            address: int,
            ecs: bool = True,
        ) -> Exact: ...

    def _shaped(
        self, shapes: dict[bytes, Shape], wire: bytes, host: str, known_only: bool = False
    ) -> bytes | None:
        """The ECS path (:mod:`gtm.geodns.shapes`): the response to a query of a shape this
        sender has sent before, from the answer rendered for its GeoIP place; None to answer it
        the long way. ``known_only``: None too for a subnet the memo does not hold (its GeoIP
        lookup is slow-path work, admitted per sender: gtm.geodns.admission)."""
        for size in self._sizes:
            shape = shapes.get(wire[2:-size])
            # The shape's own address length only: a query of a shorter one with bytes
            # appended can match a longer one's key (an IPv4 /24 with 4 octets more ends with
            # the 7 of an IPv6 /56). Its message is longer than the shape's: malformed.
            if shape is not None and shape.size == size:
                break
        else:
            return None
        now = self.clock()
        snapshot = self._holding(now)
        if snapshot is None:
            return None
        octets = wire[-size:]
        subnet = int.from_bytes(octets, "big")
        if subnet & shape.mask:
            return None  # bits past the source prefix: malformed, the long way says so
        face = self._subnets.map.get(shape.tag + subnet)
        known = face is not None
        if face is None:
            if known_only:
                return None
            face = self._face(shape, wire, subnet, snapshot, now)
        if face is _NO_FACE:
            return None
        value = subnet << shape.pad
        networks = self._networks
        net_key = face.base | (value >> face.shift)
        # Generations.get inlined for the young generation.
        entry = networks.young.get(net_key) or networks.get(net_key)
        if entry is None:
            known = False
            bucket = value >> (32 - FOLD_V4 if shape.family == 1 else 128 - FOLD_V6)
            entry = self._face_folds.get(face.base | bucket)
            if entry is None:
                entry = self._unrowed(face, shape, value, net_key, bucket)
            else:
                self.stats.folded += 1
        entry.tally(now, self._tallied)
        out = wire[:2] + face.head + octets
        if known:
            # A subnet asked for again, of a network with a row of its own: a resolver's
            # steady population, not a flood's entropy; these bytes get a first-level entry.
            self._keep(
                True,
                host,
                wire[2:],
                Exact(out[2:], entry.record, entry.stats_key, entry.truncated),
            )
        return out

    def _face(self, shape: Shape, wire: bytes, subnet: int, snapshot: Snapshot, now: float) -> Face:
        """The :class:`Face` a subnet not in the memo is answered from (its place's answer,
        rendered if its location class is new), kept in the memo; :data:`_NO_FACE` when
        answers differ by network there (the slow path answers)."""
        place, prefix_len = snapshot.geo.where(shape.version, subnet << shape.pad)
        if prefix_len > shape.source:
            # A GeoIP network narrower than the subnet: the subnet is located by its first
            # address, as the slow path does, and is itself the unit of the answer's scope and
            # of its audit row (gtm.geodns.precision).
            prefix_len = shape.source
        key = (shape, place)
        placed = self._placed.get(key)
        if placed is None:
            placed = self._place(shape, wire, place, snapshot, now, key)
        face = _NO_FACE if placed is _UNPLACED else placed.face(prefix_len, shape.bits)
        self._subnets.put(shape.tag + subnet, face)
        return face

    def _unrowed(self, face: Face, shape: Shape, value: int, net_key: int, bucket: int) -> Exact:
        """The entry for an answer from ``face`` to a network without a row of its own: a new
        row if the audit budget has room for a new decision this seal window, else the
        window's folded row for its decision and the subnet's client bucket."""
        placed = face.placed
        if self._new_decisions < self.budget.audit_records:
            text = network_text(shape.version, value, face.prefix_len)
            record = with_client(placed.record, text, text)
            entry = Exact(b"", record, placed.stats_key, placed.truncated)
            self._networks.put(net_key, entry)
            self._new_decisions += 1
            return entry
        self.stats.folded += 1
        entry = self._fold(placed.blank, placed.stats_key, placed.truncated, shape.family, value)
        if len(self._face_folds) < self.budget.fold_entries * 4:
            self._face_folds[face.base | bucket] = entry
        return entry

    def _place(
        self,
        shape: Shape,
        wire: bytes,
        place: tuple[str | None, str | None, float | None, float | None],
        snapshot: Snapshot,
        now: float,
        key: tuple[Shape, tuple[object, ...]],
    ) -> Placed:
        """The shape's answer for a GeoIP place not seen yet: the one of its location class
        (:func:`gtm.decision.plan.location_class`), rendered from this query if the class is
        new too; :data:`_UNPLACED` when answers differ by network within it."""
        placed = _UNPLACED
        service = self._services.get(shape.query.qname_text)
        ecs = shape.query.edns.ecs if shape.query.edns is not None else None
        if service is not None and ecs is not None:
            loc = Location(*place, None)
            if shape.basis is None:
                shape.basis = residency_basis(snapshot, shape.client, ecs.network)
            resolver = resolver_place_on(snapshot, shape.client, shape.basis, loc)
            cls = (shape, location_class(snapshot, service, loc, resolver))
            found = self._classes.get(cls)
            if found is None:
                found = self._render_class(shape, wire, snapshot, now)
                self._classes.put(cls, found)
            placed = found
        self._placed.put(key, placed)
        return placed

    def _render_class(self, shape: Shape, wire: bytes, snapshot: Snapshot, now: float) -> Placed:
        """Render a shape's answer for a location class from this query (of the shape)."""
        parsed = parse_query(wire)
        if not (isinstance(parsed, Query) and parsed.edns is not None and parsed.edns.ecs):
            return _UNPLACED
        self.stats.cache_misses += 1
        client, limit = shape.client, shape.limit
        result = self._render(parsed, client, snapshot, now, limit)
        return self._placed_from(shape, parsed, result)

    def _placed_from(self, shape: Shape, query: Query, result: Answer) -> Placed:
        """The shape's answer for a location class, from one rendered for a query of it;
        :data:`_UNPLACED` unless it holds for every network of the class."""
        decision = result.decision
        net = decision.location.network if decision is not None else None
        ecs = query.edns.ecs if query.edns is not None else None
        if (
            decision is None
            or net is None
            or ecs is None
            or decision.by_network
            or not holds_network_wide(decision, net)
            or not patchable(result.wire, ecs, decision.scope_prefix)
        ):
            return _UNPLACED
        record = result.record
        blank = self._intern(with_client(record, "", None))
        self._renderings += 1
        if self._renderings > 2 * self.budget.class_entries:
            # The memo's faces keep their renderings alive after _classes has let them go:
            # past twice its budget of them (many shapes, say), the memo starts afresh.
            self._subnets.clear()
            self._renderings = 0
        return Placed(
            result.wire[2 : -shape.size - 1],
            decision.scope_prefix > 0,
            record,
            blank,
            ("udp", stats_qtype(query.qtype), record.response or rcode_name(result.rcode)),
            bool(result.wire[2] & 0x02),
            next(self._serials),
        )

    def _seed(self, shape: Shape, query: Query, result: Answer, snapshot: Snapshot) -> None:
        """Keep an answer the slow path rendered for a query of ``shape`` as its location
        class's, so the ECS path does not render it again."""
        decision = result.decision
        ecs = query.edns.ecs if query.edns is not None else None
        service = self._services.get(query.qname_text)
        if decision is None or ecs is None or service is None:
            return
        loc = decision.location
        resolver = resolver_place(snapshot, shape.client, ecs.network, loc)
        cls = (shape, location_class(snapshot, service, loc, resolver))
        if self._classes.get(cls) is None:
            self._classes.put(cls, self._placed_from(shape, query, result))

    def _add_shape(
        self, host: str, wire: bytes, query: Query, client: IPAddress, limit: int
    ) -> Shape | None:
        """The shape of a query the slow path answers for a service name, kept for the ECS
        path to answer its kind from now on; None when the ECS path cannot take it."""
        by_prefix = self._shapes.get(host)
        if by_prefix is not None:
            for n in self._sizes:
                known = by_prefix.get(wire[2:-n])
                if known is not None and known.size == n:
                    return known
        shape = Shape.of(wire, query, client, limit)
        if shape is None:
            return None
        # Above any ECS address (16 octets at most): the shape's subnets key the memo apart.
        shape.tag = next(self._serials) << 128
        if self._shape_count >= self.budget.shapes:
            self._shapes, self._shape_count = {}, 0  # bounded; busy senders come back at once
            self._subnets.clear()  # keyed by those shapes' tags: never asked for again
        by_prefix = self._shapes.get(host)
        if by_prefix is None:
            by_prefix = self._shapes[host] = {}
        by_prefix[wire[2 : -shape.size]] = shape
        self._shape_count += 1
        if shape.size not in self._sizes:
            self._sizes = (*self._sizes, shape.size)
        return shape
