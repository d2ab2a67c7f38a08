"""The DNS answering path: a query's wire bytes in, the response's wire bytes out, from memory.

:meth:`Responder.answer_udp` and :meth:`Responder.answer_tcp` are the whole answering path and
never await: rate limit (UDP), look the exact query up, else (UDP, an ECS query of a shape this
sender sent before: :mod:`gtm.geodns.shapes`) take the answer rendered for the subnet's location
class, else parse, look the rendered answer up (or render it), patch in the ID, flags and
question case, count it towards the audit. Rendered answers are reused per (name, type, EDNS
shape, UDP limit, client network, GeoIP bucket) within one decision epoch (successor snapshots
that decide alike: routine capacity reports keep the caches, :mod:`gtm.decision.answer_window`),
and only until the next instant at which a decision can change with time alone: when one of
the snapshot's capacity reports goes stale. A name that does not exist is keyed as every other
such name of its length: their answers differ only in the question
(:func:`gtm.geodns.zone.nonexistent`; the length, because compressed names after the question
point past it), so a random-name flood renders at most one per length.

Answers given from the exact-query cache (nearly all of them) are tallied on the cache entry, an
integer increment, and the audit writer drains the tallies at each flush (the responder is one
of its sources): counting through the writer per answer cost a fifth of the answering path.
Their response counters are folded into :class:`DnsStats` at the same time. The sockets are
:mod:`gtm.geodns.server`'s.

Beside this module: the ECS path (:mod:`gtm.geodns.ecs_path`, the responder's base class), the
cache entries (:mod:`gtm.geodns.entries`), the second level's keys (:mod:`gtm.geodns.answer_key`)
and the answers to rejected packets and rate-limit slips (:mod:`gtm.geodns.rejects`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from enum import Enum
from ipaddress import IPv4Address, IPv6Address
from typing import Any

import structlog

from gtm.audit.record import FOLD_V4, FOLD_V6, AuditRecord
from gtm.audit.writer import Tally
from gtm.decision.answer_window import AnswerWindow
from gtm.decision.memos import DEFAULT_BUDGET_MB
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Service
from gtm.geodns.answer_key import answer_key
from gtm.geodns.budget import Admitted, Budget, Generations
from gtm.geodns.cookies import OPTION_LEN, Checked, ServerCookies, with_cookie
from gtm.geodns.dnssec import Signer
from gtm.geodns.ecs_path import EcsPath
from gtm.geodns.entries import SPLIT, Cached, Exact, takes_name
from gtm.geodns.guards import PROVEN_NETWORKS, Guards
from gtm.geodns.identity import QCLASS_CH, ServerIdentity
from gtm.geodns.precision import holds_network_wide, patchable, widened
from gtm.geodns.ratelimit import Limit, ResponseRateLimiter
from gtm.geodns.render import compress, rcode_name, udp_limit
from gtm.geodns.shapes import Face, Placed, Shape, fold_bucket, with_client
from gtm.geodns.stats import DnsStats
from gtm.geodns.wire import Query, Reject, parse_query, peer_address
from gtm.geodns.zone import Answer, answer, nonexistent, stats_qtype, zone_data
from gtm.runtime import Runtime

log = structlog.get_logger(__name__)

IPAddress = IPv4Address | IPv6Address


class Slow(Enum):
    """:meth:`Responder.answer_cached`'s verdict when no cache holds the answer."""

    SLOW = "slow"


SLOW = Slow.SLOW
DEFAULT_BUDGET = Budget.from_mb(DEFAULT_BUDGET_MB)
_COPIED = 0x0110  # RD and CD: the only query flags a cached answer takes from each query
_ANSWER = Limit.ANSWER  # a global: an enum member through its class costs more


class Responder(EcsPath, Guards):
    """Answers DNS messages from memory, in two levels of cache over :func:`answer`.

    First level (:meth:`answer_udp`, :meth:`answer_tcp`): per transport and sender, the exact
    query bytes after the ID. They fix name, type, flags, letter case and ECS, and the sender
    fixes the location when there is no ECS, so the whole response but its ID is known: no
    parsing, no allocation beyond the key and the response. Second level: the rendered answer
    per (name, type, EDNS shape, UDP limit, client bucket, GeoIP network), patched with the ID,
    flags and question case of each query. Both are dropped with the decision epoch they came
    from, and at the next instant a decision can change with time alone.
    """

    def __init__(
        self,
        runtime: Runtime,
        stats: DnsStats,
        rate_limiter: ResponseRateLimiter | None = None,
        clock: Callable[[], float] = time.time,
        budget: Budget = DEFAULT_BUDGET,
        signer: Signer | None = None,
        identity: ServerIdentity | None = None,
        cookies: ServerCookies | None = None,
        require_cookie: bool = False,
    ) -> None:
        self.runtime = runtime
        self.cookies = cookies  # gtm.geodns.guards
        self._proven: Generations[Hashable, float] = Generations(PROVEN_NETWORKS)
        self._cookied: Generations[Hashable, float] = Generations(PROVEN_NETWORKS)
        self.require_cookie = require_cookie and cookies is not None
        # id.server. and version.bind. in class CHAOS, when configured (gtm.geodns.identity).
        self.identity = identity
        # DNSSEC online signing (gtm.geodns.dnssec), when the zone is signed: it signs answers
        # on a rendered-cache miss and bounds how long the caches keep signed answers.
        self.signer = signer
        self._store = runtime.store
        self.stats = stats
        self.rrl = rate_limiter
        self.clock = clock  # replaceable, as in tests
        # The snapshot the caches below answer for, and until when (gtm.decision.answer_window).
        self._window = AnswerWindow()
        self.budget = budget
        # Second level: rendered answers, in two generations (gtm.geodns.budget).
        self._cache: Generations[tuple[object, ...], Cached] = Generations(budget.rendered_entries)
        # First level, per sender: the query bytes after the ID -> the entry. UDP senders by
        # the host string the transport gives (cheaper to hash than an address object). Two
        # generations here too, counted together over every sender (``_entries``: the young
        # generation's entries and sender tables): a hit in the old one moves back.
        self._udp: dict[str, dict[bytes, Exact]] = {}
        self._tcp: dict[IPAddress, dict[bytes, Exact]] = {}
        self._udp_old: dict[str, dict[bytes, Exact]] = {}
        self._tcp_old: dict[IPAddress, dict[bytes, Exact]] = {}
        self._entries = 0
        self._exact_half = max(1, budget.exact_entries // 2)
        # New decisions counted since the audit writer last drained this responder for a seal;
        # past the budget's audit_records, answers needing another are counted on folded rows.
        self._new_decisions = 0
        self._drained_seals = -1  # the writer's seal count at the last drain
        self._services: Mapping[str, Service] = {}
        # Entries answered from since the last drain. They stay here when the caches are
        # dropped, so no tally is lost to a new snapshot.
        self._tallied: list[Exact] = []
        # The ECS path (gtm.geodns.shapes): per UDP sender, its query shapes by their bytes
        # after the ID up to the ECS address; the address lengths any shape has; answers per
        # (shape, GeoIP place); tallies per (answer, GeoIP network), and per (decision, client
        # bucket) when folded.
        self._shapes: dict[str, dict[bytes, Shape]] = {}
        self._shape_count = 0
        self._sizes: tuple[int, ...] = ()
        self._placed: Generations[tuple[Shape, tuple[object, ...]], Placed] = Generations(
            budget.placed_entries
        )
        # Per (shape, client subnet): its Face, the answer it is given without a GeoIP lookup.
        self._subnets: Admitted[int, Face] = Admitted(budget.subnet_entries)
        # The networks counted on rows of their own, by Face.base and network number.
        self._networks: Generations[int, Exact] = Generations(budget.network_entries)
        # This seal window's folded rows by (face, client bucket): Face.base | bucket.
        self._face_folds: dict[int, Exact] = {}
        # Renderings (Placed) made since the memo was last emptied: what its faces may keep
        # alive past the tables that bound them (_classes, _placed, _shapes).
        self._renderings = 0
        self._serials = itertools.count(1)  # of shapes and renderings (Shape.tag, Face.base)
        self._classes: Generations[tuple[Shape, tuple[object, ...]], Placed] = Generations(
            budget.class_entries
        )
        # Folded rows started since the writer last sealed: at most the budget's fold_entries.
        self._folds: dict[tuple[AuditRecord, int, int, bool], Exact] = {}
        # The same entries across seal windows: a flood's folded rows are mostly the same
        # from one window to the next, and a kept record is rendered as a row only once.
        self._fold_kept: Generations[tuple[AuditRecord, int, int, bool], Exact] = Generations(
            budget.fold_entries
        )
        self._blanks: dict[AuditRecord, AuditRecord] = {}
        # Names that do not exist, by sender and query bytes, asked once so far (_asked_again):
        # keys only, an eighth of the first level's entries (a few percent of its share).
        self._absent_seen: Generations[tuple[str | IPAddress, bytes], bool] = Generations(
            max(16, budget.exact_entries // 8)
        )
        runtime.writer.add_source(self.drain_tallies)

    def drain_tallies(self) -> Iterator[Tally]:
        """The audit writer's source: the answers given from cached entries since the last
        drain. Runs on the loop, interleaved with answering (the writer slices its flush): an
        entry answered from again before its turn here is drained with that answer too, and
        one answered from after its turn is listed again for the next drain. The response
        counters of these answers are folded into :class:`DnsStats` here too."""
        tallied, self._tallied = self._tallied, []
        # The writer takes its pending records along with these tallies: the backlog the
        # budget bounds starts again from here when a seal takes them. (The tally journal's
        # ticks drain more often, into the writer's open window: memory all the same.)
        seals = self.runtime.writer.seals
        if seals != self._drained_seals:
            self._drained_seals = seals
            self._new_decisions = 0
            # Folded rows live one seal window (entries with answers not yet drained stay in
            # _tallied): each window's are bounded, and the next starts with room.
            self._folds = {}
            self._face_folds = {}
        stats = self.stats
        queries = stats.queries
        for entry in tallied:
            n = entry.n
            entry.n = 0
            queries[entry.stats_key] += n
            stats.cache_hits += n
            if entry.truncated:
                stats.truncated += n
            yield entry.record, n, entry.first, entry.last

    def answer_cached(self, wire: bytes, host: str) -> bytes | Slow | None:
        """The response to a datagram from ``host`` if a cache holds it (or the rate limiter
        decides it), else :data:`SLOW`: the query needs the slow path (parsing, a GeoIP lookup,
        a rendering), which :mod:`gtm.geodns.admission` admits per sender network. Never
        raises on input. Run on every datagram as it is read, so only cheap work is done here:
        the first level, and the ECS path for a subnet its memo holds."""
        rrl = self.rrl
        if rrl is not None:
            verdict = rrl.check_host(host)
            if verdict is not _ANSWER:
                return self._limited(wire, host, verdict)
        out = self._repeat(self._udp.get(host), wire)
        if out is None and self._promote(True, host, wire):
            out = self._repeat(self._udp.get(host), wire)
        if out is None and self._shape_count:
            shapes = self._shapes.get(host)
            if shapes is not None:
                out = self._shaped(shapes, wire, host, known_only=True)
        return SLOW if out is None else out

    def answer_udp(
        self, wire: bytes, host: str, exact_missed: bool = False, checked: bool = False
    ) -> bytes | None:
        """The response to a datagram from ``host`` (the address as the transport gives it), or
        None to send nothing. Never raises on input.

        Nearly every query takes the first lines: these exact bytes from this sender answered
        before, in this snapshot. Answering then is a dictionary lookup, a tally on the entry
        (the audit writer drains it) and the ID put in front of the stored response.
        ``exact_missed``: the caller looked these bytes up in the young generation already
        (:mod:`gtm.geodns.server` does, inline) and found nothing. ``checked``: the rate
        limiter passed this datagram already (:meth:`answer_cached` did, when it was read)."""
        rrl = self.rrl
        if rrl is not None and not checked:
            verdict = rrl.check_host(host)
            if verdict is not _ANSWER:
                return self._limited(wire, host, verdict)
        out = None if exact_missed else self._repeat(self._udp.get(host), wire)
        if out is None and self._promote(True, host, wire):
            out = self._repeat(self._udp.get(host), wire)
        if out is None and self._shape_count:
            shapes = self._shapes.get(host)
            if shapes is not None:
                out = self._shaped(shapes, wire, host)
        return out if out is not None else self._answer(wire, peer_address(host), True, host)

    def answer_tcp_cached(self, wire: bytes, client: IPAddress) -> bytes | Slow:
        """The response to one TCP message if the first level holds it, else :data:`SLOW`
        (gtm.geodns.tcp admits the rest per sender network)."""
        out = self._repeat(self._tcp.get(client), wire)
        if out is None and self._promote(False, client, wire):
            out = self._repeat(self._tcp.get(client), wire)
        return SLOW if out is None else out

    def answer_tcp(self, wire: bytes, client: IPAddress) -> bytes | None:
        """The response to one message over TCP (never rate limited), or None to send nothing
        (the connection is then closed). Never raises on input."""
        out = self._repeat(self._tcp.get(client), wire)
        if out is None and self._promote(False, client, wire):
            out = self._repeat(self._tcp.get(client), wire)
        return out if out is not None else self._answer(wire, client, False, client)

    def _promote(self, udp: bool, sender: str | IPAddress, wire: bytes) -> bool:
        """Move this sender's entry for these bytes from the old generation to the young one;
        False when the old one has none."""
        old: dict[Any, dict[bytes, Exact]] = self._udp_old if udp else self._tcp_old
        by_query = old.get(sender)
        if by_query is None:
            return False
        exact = by_query.pop(wire[2:], None)
        if exact is None:
            return False
        self._keep(udp, sender, wire[2:], exact)
        return True

    def _keep(self, udp: bool, sender: str | IPAddress, key: bytes, exact: Exact) -> None:
        """Store a first-level entry in the young generation, turning the generations over
        first when it is full (the old one, and whatever in it was not used since, goes)."""
        if self._entries >= self._exact_half:
            self._udp_old, self._tcp_old = self._udp, self._tcp
            self._udp, self._tcp, self._entries = {}, {}, 0
        senders: dict[Any, dict[bytes, Exact]] = self._udp if udp else self._tcp
        by_query = senders.get(sender)
        if by_query is None:
            by_query = senders[sender] = {}
            self._entries += 1  # a sender's table costs about an entry
        by_query[key] = exact
        self._entries += 1

    def cached_entries(self) -> tuple[int, int]:
        """(first-level entries and sender tables, rendered answers) held now, both
        generations: never more than the budget's limits."""
        exact = sum(len(t) + 1 for gen in (self._udp, self._tcp) for t in gen.values())
        exact += sum(len(t) + 1 for gen in (self._udp_old, self._tcp_old) for t in gen.values())
        return exact, len(self._cache)

    def _repeat(self, by_query: dict[bytes, Exact] | None, wire: bytes) -> bytes | None:
        """The stored response to these exact bytes from this sender, tallied, while the answer
        window holds (moved on to a successor in the same decision epoch if need be); None to
        answer them the long way."""
        if by_query is None:
            return None
        exact = by_query.get(wire[2:])
        if exact is None:
            return None
        now = self.clock()
        if self._holding(now) is None or not exact.tally(now, self._tallied):
            return None
        return wire[:2] + exact.tail

    def _holding(self, now: float) -> Snapshot | None:
        """The current snapshot if the caches' answer window holds at ``now`` (moved on to a
        successor in the same decision epoch if need be); None when the caches were dropped
        and the query must be answered the long way."""
        snapshot = self._store.current
        window = self._window
        if (now < window.until and snapshot is window.snapshot) or self._advance(snapshot, now):
            return snapshot
        return None

    def _advance(self, snapshot: Snapshot, now: float) -> bool:
        """Move the answer window to ``snapshot``, dropping the caches unless they still hold
        (a successor in the same decision epoch: a routine capacity report). True when kept."""
        kept = self._window.advance(snapshot, now)
        if self.signer is not None:  # no cached answer outlives its signatures' freshness
            kept = self.signer.bound_window(self._window, now, kept)
        if kept:
            return True
        self._cache.clear()
        self._udp, self._tcp, self._entries = {}, {}, 0
        self._udp_old, self._tcp_old = {}, {}
        self._shapes, self._shape_count, self._sizes = {}, 0, ()
        self._placed.clear()
        self._classes.clear()
        self._subnets.clear()
        self._networks.clear()
        self._folds = {}
        self._fold_kept.clear()
        self._face_folds = {}
        self._renderings = 0
        self._blanks = {}
        self._services = zone_data(snapshot.topology).services
        return False

    def _fold(
        self,
        blank: AuditRecord,
        stats_key: tuple[str, str, str],
        truncated: bool,
        family: int,
        address: int,
        ecs: bool = True,
    ) -> Exact:
        """The tally entry counting answers of the decision ``blank`` stands for in the client
        bucket of ``address`` while the audit writer is behind (gtm.geodns.shapes). Past the
        budget's ``fold_entries`` in one seal window, in the bucket of every client (0.0.0.0/0,
        ::/0): at most one row per decision, so even then nothing is dropped."""
        shift = 32 - FOLD_V4 if family == 1 else 128 - FOLD_V6
        key = (blank, family, address >> shift, ecs)
        entry = self._folds.get(key)
        if entry is None:
            if len(self._folds) >= self.budget.fold_entries:
                key = (blank, family, -1, ecs)
                entry = self._folds.get(key)
                if entry is not None:
                    return entry
                text = "0.0.0.0/0" if family == 1 else "::/0"
            else:
                text = fold_bucket(family, address)
            entry = self._fold_kept.get(key)
            if entry is None:
                # The bucket stands for the ECS too when the answers had one (never claimed
                # for queries without).
                record = with_client(blank, text, text if ecs else None)
                entry = Exact(b"", record, stats_key, truncated)
                self._fold_kept.put(key, entry)
            self._folds[key] = entry
        return entry

    def _answer_folded(
        self,
        query: Query,
        client: IPAddress,
        snapshot: Snapshot,
        now: float,
        limit: int | None,
        udp: bool,
    ) -> bytes:
        """The slow path's answer to a query needing a new decision while the writer is
        behind: rendered, counted on a folded row, kept in no cache (its row is not its
        own)."""
        result = self._render(query, client, snapshot, now, limit)
        record = result.record
        # The type as metric labels say it ("other" past the known ones): a sender cycling
        # through 65,536 types must not make a folded row each (gtm.geodns.zone.stats_qtype).
        blank = dataclasses.replace(
            with_client(record, "", None), query_type=stats_qtype(query.qtype)
        )
        blank = self._intern(blank)
        ecs = query.edns.ecs if query.edns is not None else None
        located = ecs.network.network_address if ecs is not None and ecs.source else client
        stats_key = (
            "udp" if udp else "tcp",
            stats_qtype(query.qtype),
            record.response or rcode_name(result.rcode),
        )
        truncated = bool(result.wire[2] & 0x02)
        family = 1 if located.version == 4 else 2
        entry = self._fold(blank, stats_key, truncated, family, int(located), ecs is not None)
        self.stats.folded += 1
        self.stats.cache_misses += 1
        entry.tally(now, self._tallied)
        return result.wire

    def _render(
        self, query: Query, client: IPAddress, snapshot: Snapshot, now: float, limit: int | None
    ) -> Answer:
        """The response to ``query`` (signed when a signer is set), its names compressed
        (:func:`gtm.geodns.render.compress`), cut for ``limit`` only when the compressed whole
        does not fit: rendered whole first, and again for the limit only then."""
        identity = self.identity
        if identity is not None and query.qclass == QCLASS_CH:
            chaos = identity.answer(query, client, snapshot, limit)
            if chaos is not None:
                return chaos
        sign = self.signer.answer if self.signer is not None else answer
        result = sign(query, client, snapshot, now, None)
        wire = compress(result.wire)
        if identity is not None:
            wire = identity.with_nsid(query, wire)
        if limit is not None and len(wire) > limit:
            result = sign(query, client, snapshot, now, limit)
            wire = compress(result.wire)
            if identity is not None:
                with_nsid = identity.with_nsid(query, wire)
                # The NSID is left out only when it alone would not fit.
                wire = with_nsid if len(with_nsid) <= limit else wire
        return dataclasses.replace(result, wire=wire)

    def _intern(self, blank: AuditRecord) -> AuditRecord:
        """One object per distinct blank record (fold keys then compare by identity); an
        interning table only, so emptied when it reaches its bound."""
        if len(self._blanks) >= self.budget.class_entries * 4:
            self._blanks = {}
        return self._blanks.setdefault(blank, blank)

    def _answer(
        self, wire: bytes, client: IPAddress, udp: bool, sender: str | IPAddress
    ) -> bytes | None:
        """The first level missed: parse, look the rendered answer up (or render it), keep the
        whole response as this sender's entry for these bytes, count it."""
        snapshot = self._store.current
        now = self.clock()
        if not self._window.holds(snapshot, now):
            self._advance(snapshot, now)
        parsed = parse_query(wire)
        if isinstance(parsed, Reject):
            return self._rejected(parsed, client, udp, now)
        query = parsed
        limit = udp_limit(query.edns) if udp else None
        ecs = query.edns.ecs if query.edns is not None else None
        checked: Checked | None = None
        if self.cookies is not None and query.edns is not None and query.edns.cookie is not None:
            checked = self._check_cookie(query.edns.cookie, client, now)
            if udp and self.require_cookie and not checked.valid:
                return self._bad_cookie(query, client, checked)
            if limit is not None:
                limit -= OPTION_LEN  # the answer is rendered with room for the cookie
        # A name that does not exist gets the rendering of any other such name (with its own
        # question), counted on the same aggregated row: a random-name flood is answered
        # without rendering each name, and keeps no entry per name in the first level unless a
        # sender asks for it again (_asked_again). Not when signing: each such name's denial
        # is signed for that name (gtm.geodns.dnssec).
        absent = self.signer is None and nonexistent(query, zone_data(snapshot.topology))
        key, network, network_key = answer_key(
            query, client, limit, snapshot, self._services, absent
        )
        cached = None
        rendered: Answer | None = None
        if network_key is not None:
            cached = self._cache.get(network_key)
            if cached is SPLIT:
                network_key, cached = None, None
        if cached is None:
            cached = self._cache.get(key)
            if absent and cached is not None and not takes_name(cached, len(query.qname), limit):
                cached = None  # this name would not fit where that one did: rendered for it
        if cached is None:
            if (
                self._new_decisions >= self.budget.audit_records
                and query.qname_text in self._services
            ):
                # A new decision would be a new audit row, and the writer is that far behind:
                # answered, counted on a folded row, kept in no cache (gtm.geodns.shapes).
                out = self._answer_folded(query, client, snapshot, now, limit, udp)
                return out if checked is None else with_cookie(out, checked)
            self.stats.cache_misses += 1
            result = self._render(query, client, snapshot, now, limit)
            rendered = result
            decision, record, patch = result.decision, result.record, 0
            keep = True  # under network_key or key (below)
            if decision is not None:
                self._new_decisions += 1
                if network_key is not None and network is not None:
                    # Held by the whole GeoIP network: one rendering and one audit row for it.
                    if ecs is not None and holds_network_wide(decision, network):
                        patch = patchable(result.wire, ecs, decision.scope_prefix)
                    if patch:
                        record = widened(record, network)
                    else:
                        self._cache.put(network_key, SPLIT)
            elif absent and ecs is not None:
                # Keyed without the ECS address (_key): the echo ends the response and each
                # query's own address is patched in. A response that does not end with it is
                # not kept under that key; with source 0 there is no address to patch.
                patch = patchable(result.wire, ecs, 0)
                keep = bool(patch) or not ecs.address
            template = (
                b"\x00\x00"
                + (int.from_bytes(result.wire[2:4], "big") & ~_COPIED).to_bytes(2, "big")
                + result.wire[4:]
            )
            truncated = bool(result.wire[2] & 0x02)
            cached = Cached(
                template,
                int.from_bytes(template[2:4], "big"),
                record,
                record.response or rcode_name(result.rcode),
                truncated,
                patch,
                len(query.qname),
            )
            if keep:
                self._cache.put(network_key if patch and network_key is not None else key, cached)
            out = result.wire
        else:
            self.stats.cache_hits += 1
            template = cached.template
            out = (
                query.id.to_bytes(2, "big")
                + (cached.flags | (query.flags & _COPIED)).to_bytes(2, "big")
                + template[4:12]
                + query.qname
                + template[12 + cached.name_len :]
            )
            if cached.patch:
                out = out[: -cached.patch] + ecs.address  # type: ignore[union-attr]
        if checked is not None:
            out = with_cookie(out, checked)
        if (
            udp
            and ecs is not None
            and isinstance(sender, str)
            and limit is not None
            and query.qname_text in self._services
        ):
            shape = self._add_shape(sender, wire, query, client, limit)
            if shape is not None and rendered is not None:
                self._seed(shape, query, rendered, snapshot)
        stats_key = ("udp" if udp else "tcp", stats_qtype(query.qtype), cached.rcode_name)
        if not absent or self._asked_again(sender, wire):
            # Entries dropped with their generation while their answers are not yet drained
            # stay listed in self._tallied: no answer goes uncounted.
            exact = Exact(
                out[2:],
                cached.record,
                stats_key,
                cached.truncated,
                math.inf if checked is None else checked.until,
            )
            self._keep(udp, sender, wire[2:], exact)
        # Counted at once, like the rare answers below: only repeats are tallied on the entry.
        self.runtime.count(cached.record)
        self.stats.queries[stats_key] += 1
        if cached.truncated:
            self.stats.truncated += 1
        return out

    def _asked_again(self, sender: str | IPAddress, wire: bytes) -> bool:
        """Whether this sender asked these bytes (a name that does not exist) before: only
        then do they get a first-level entry. A random-name flood asks each name once, and its
        entries would push out those of the names that are asked for; a resolver asking for a
        missing name again (a typo, a name without negative caching) gets the first level's
        speed from the second time on."""
        key = (sender, wire[2:])
        if self._absent_seen.get(key) is not None:
            return True
        self._absent_seen.put(key, True)
        return False
