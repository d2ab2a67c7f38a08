"""The DNS path's memory budget, shared out over its caches and per-client tables.

One figure (``GTM_DNS_CACHE_BUDGET_MB``, per worker process), less a reserve for what no table
holds (:func:`gtm.decision.memos.tables_mb`), becomes an entry limit for each table, from what
one entry costs (measured with tracemalloc on ECS answers for the demo zone:
about 530 bytes a first-level entry, which holds the query's bytes and the whole response, and
about 1,200 a rendered one, which adds its key tuple and an audit record; a rate-limit bucket is
a small list under a tuple key). The memos of the slow path beside them (the parse memos
and sender addresses, :mod:`gtm.geodns.wire`; the decision core's plans, rankings, verdicts,
client networks and GeoIP locations, :mod:`gtm.decision.memos`) are cleared when full, each at
a limit from its own share of the same figure. Every table keeps two
generations (:class:`Generations`): lookups try the young one, then the old one, moving a hit
back into the young one; when the young one is full the old one is dropped and the young one
becomes old. Entries used at least once a generation stay, entries seen once (an attacker's
random subnet or name) leave with their generation, and a table never holds more than its limit:
a flood costs hit rate, never memory (DESIGN.md rule 8).

The audit writer's backlog is the one table a cache cannot bound: every answer must be counted
(rule 2), and a decision for a client network not seen before is a new row. When more new
decisions wait for the writer than :attr:`Budget.audit_records` in one seal window, the
responder counts further ones on folded rows (per decision and client /8, then per decision:
:mod:`gtm.geodns.shapes`) until the writer seals: goodput under a random-subnet flood no longer
follows what the writer can seal, and the rows it must seal stay a few thousand a second.

The ECS path's memo of client subnets (:mod:`gtm.geodns.shapes`: each subnet's answer, with no
GeoIP lookup) is the one table a working set cycled through may outgrow: a large resolver
population, or a flood looping over its subnets, asks for each in turn. Two generations would
then drop every entry before its turn came again; :class:`Admitted` keeps what it took and
hits on that share. The GeoIP memo of decoded records (:mod:`gtm.decision.geoip`,
``GEO_SHARE``), the audit writer's queue of sealed rows (:mod:`gtm.audit.writer`,
``QUEUE_SHARE``) and the slow path's memos come out of the same figure, and the shares add up
to the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from gtm.audit.rows import QUEUE_SHARE
from gtm.decision.geoip import GEO_SHARE
from gtm.decision.memos import MEMO_SHARES, tables_mb
from gtm.geodns.wire import PARSED_SHARE, parsed_entries

K = TypeVar("K")
V = TypeVar("V")

MIB = 1 << 20
# Bytes per entry, rounded up from those measurements.
EXACT_ENTRY_BYTES = 600  # query bytes after the ID, response bytes, _Exact, dict slots
RENDERED_ENTRY_BYTES = 1400  # key tuple, _Cached, template, audit record
RATE_BUCKET_BYTES = 250  # (family, network) key, [tokens, time, count]
# An audit record waiting for the writer (about 750 bytes: tracemalloc on record.py and the
# writer under a flood), with its row while the writer seals it.
AUDIT_RECORD_BYTES = 1000
# The ECS path (gtm.geodns.shapes): an answer rendered for a GeoIP place (its body, key and
# audit records), and a GeoIP network's tally entry with its own audit record.
PLACED_ENTRY_BYTES = 400  # a place's key, pointing at its location class's answer
CLASS_ENTRY_BYTES = 2000  # the answer's body, key and audit records
NETWORK_ENTRY_BYTES = 1500  # with its record's row form, once a seal made it
FOLD_ENTRY_BYTES = 1500  # a folded row's tally entry, audit record and row form
SHAPE_ENTRIES = 4096  # query shapes kept per worker at most: a few per resolver
SHAPE_ENTRY_BYTES = 1000  # the shape's prefix bytes, its parsed query, the dict slot
# A client subnet in the ECS path's memo: its key (an integer past 2**128) and dict slot, about
# 100 bytes (tracemalloc over 200,000 /24s; the faces it points at are shared by thousands).
# At 64 MiB the memo holds 231,000: a population of 200,000 subnets is answered from memory
# (bench/dns/flood.py: sustained goodput half the 5,000-subnet rate; at 200 bytes a subnet,
# which held 134,000, a third).
SUBNET_ENTRY_BYTES = 110
# Shares of the budget: first-level answers are most of the traffic; rendered answers are what
# a miss falls back on; the ECS path's answers per place and tallies per network are what a
# flood of new client subnets is answered from; the rate limiter's buckets are one per client
# network; the audit backlog is the new decisions a flood of distinct clients makes faster
# than the writer seals them (each a row: the audit keeps every client network a decision was
# made for, until it folds them, gtm.geodns.shapes).
_EXACT_SHARE, _RENDERED_SHARE, _RATE_SHARE, _AUDIT_SHARE = 0.10, 0.04, 0.05, 0.02
# The network and placed shares were sized from estimates of their entries; measured under
# ecs-200k at 16 MiB they held 0.7 and 0.3 MiB of their 1.9 and 1.3 (then 0.12 and 0.08),
# and gave the audit writer's queue of sealed rows its share (QUEUE_SHARE).
_PLACED_SHARE, _NETWORK_SHARE, _FOLD_SHARE = 0.06, 0.06, 0.03
# The subnet memo at 0.36 holds a population of 200,000 subnets at 64 MiB (206,000; the GeoIP
# record memo gave it 0.02: a subnet it holds needs no GeoIP lookup at all).
_CLASS_SHARE, _SHAPE_SHARE, _SUBNET_SHARE = 0.04, 0.01, 0.36
# The slow path's memos (gtm.geodns.wire.PARSED_SHARE; gtm.decision.memos): were fixed caps
# outside the budget, some 35 MiB when a flood of queries the fast paths cannot take filled
# them; their shares came out of the rate-limit, network and subnet shares. (Not the
# first-level share: at 0.08 its half, a generation, held fewer than a 5,000-subnet
# population, and that set's goodput fell by a tenth in bench/dns/flood.py.)
# The rest is the GeoIP memos' (gtm.decision.geoip.GEO_SHARE): the DNS path's per-subnet
# lookups, so counted here; and the audit writer's sealed rows waiting for the database
# (gtm.audit.rows.QUEUE_SHARE): the rows the DNS path's new decisions become; and the slow
# path's memos. The shares sum to the whole budget (tests/gtm/geodns/test_budget.py).
SHARES = (
    _EXACT_SHARE, _RENDERED_SHARE, _RATE_SHARE, _AUDIT_SHARE, _PLACED_SHARE, _NETWORK_SHARE,
    _FOLD_SHARE, _CLASS_SHARE, _SHAPE_SHARE, _SUBNET_SHARE, GEO_SHARE, QUEUE_SHARE,
    PARSED_SHARE, *MEMO_SHARES,
)  # fmt: skip
_MIN_ENTRIES = 16  # below this a generation would turn over on every query


@dataclass(frozen=True, slots=True)
class Budget:
    """Entry limits (both generations together) for the DNS path's tables."""

    exact_entries: int
    rendered_entries: int
    rate_buckets: int
    # New decisions (audit records) the responder adds between two seals by the audit writer;
    # past it, answers needing another are counted on folded rows (gtm.geodns.shapes).
    audit_records: int
    placed_entries: int = _MIN_ENTRIES
    class_entries: int = _MIN_ENTRIES
    network_entries: int = _MIN_ENTRIES
    # Folded rows per decision and client /8 (/20) started between two seals; past it, the
    # decision's one row for every client (0.0.0.0/0, ::/0) counts the rest.
    fold_entries: int = _MIN_ENTRIES
    shapes: int = SHAPE_ENTRIES
    # Client subnets the ECS path answers from memory, each by its place's Face.
    subnet_entries: int = _MIN_ENTRIES
    # Entries of each parse memo (names, OPT records, sender addresses: gtm.geodns.wire).
    parsed_entries: int = _MIN_ENTRIES

    @classmethod
    def from_mb(cls, mb: float) -> Budget:
        total = tables_mb(mb) * MIB  # the reserve for what no table holds left out
        return cls(
            exact_entries=max(_MIN_ENTRIES, int(total * _EXACT_SHARE / EXACT_ENTRY_BYTES)),
            rendered_entries=max(_MIN_ENTRIES, int(total * _RENDERED_SHARE / RENDERED_ENTRY_BYTES)),
            rate_buckets=max(_MIN_ENTRIES, int(total * _RATE_SHARE / RATE_BUCKET_BYTES)),
            audit_records=max(_MIN_ENTRIES, int(total * _AUDIT_SHARE / AUDIT_RECORD_BYTES)),
            placed_entries=max(_MIN_ENTRIES, int(total * _PLACED_SHARE / PLACED_ENTRY_BYTES)),
            class_entries=max(_MIN_ENTRIES, int(total * _CLASS_SHARE / CLASS_ENTRY_BYTES)),
            network_entries=max(_MIN_ENTRIES, int(total * _NETWORK_SHARE / NETWORK_ENTRY_BYTES)),
            fold_entries=max(_MIN_ENTRIES, int(total * _FOLD_SHARE / FOLD_ENTRY_BYTES)),
            shapes=max(
                _MIN_ENTRIES, min(SHAPE_ENTRIES, int(total * _SHAPE_SHARE / SHAPE_ENTRY_BYTES))
            ),
            subnet_entries=max(_MIN_ENTRIES, int(total * _SUBNET_SHARE / SUBNET_ENTRY_BYTES)),
            parsed_entries=parsed_entries(mb),
        )


class Admitted(Generic[K, V]):
    """A bounded map for a working set that may be larger than it: it takes entries until it
    is full, then keeps what it holds, and starts afresh once twice as many lookups have missed as
    it holds (the population moved on; what is used comes back first). Two generations hit
    never on a working set cycled through that is larger than they hold; this hits in
    proportion to the share it holds (the ECS path's memo of client subnets: a large
    resolver population, or a random-subnet flood, asks for them in turn). Lookups are
    ``map.get``, inlined by the answering path."""

    __slots__ = ("limit", "map", "misses")

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.map: dict[K, V] = {}
        self.misses = 0

    def put(self, key: K, value: V) -> None:
        table = self.map
        if len(table) < self.limit:
            table[key] = value
            return
        self.misses += 1
        if self.misses >= 2 * self.limit:
            self.map = {key: value}
            self.misses = 0

    def __len__(self) -> int:
        return len(self.map)

    def clear(self) -> None:
        self.map = {}
        self.misses = 0


class Generations(Generic[K, V]):
    """A bounded map that keeps what is used: two dicts, young and old (see the module
    docstring). At most ``limit`` entries in all; a hit costs one dict lookup while the entry is
    young, two and a move when it is old. The answering path inlines :meth:`get` on
    ``young``; everything else goes through here."""

    __slots__ = ("half", "old", "young")

    def __init__(self, limit: int) -> None:
        self.half = max(1, limit // 2)
        self.young: dict[K, V] = {}
        self.old: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        value = self.young.get(key)
        if value is None:
            value = self.old.pop(key, None)
            if value is not None:
                self.put(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        young = self.young
        if len(young) >= self.half and key not in young:
            self.old = young
            young = self.young = {}
        young[key] = value

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def clear(self) -> None:
        self.young = {}
        self.old = {}
