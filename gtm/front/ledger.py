"""Every response of the front counted towards the audit store (DESIGN.md rule 2), and the
decision id each names.

Responses are tallied on the object that stands for their audit record (an integer), and the
audit writer drains the tallies at each flush (:meth:`Ledger.drain`): nothing is done per
response beyond the increment. The answer cache's answers are tallies themselves
(:class:`gtm.front.answers.Answer`); the general path's records are memoised here
(:meth:`Ledger.count`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

from gtm.audit.decision_id import id_tail, render_id
from gtm.audit.record import AuditRecord, record_of
from gtm.audit.writer import Tally as Drained
from gtm.decision.model import Decision, IPAddress
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot
from gtm.front.metrics import FrontStats
from gtm.runtime import Runtime

NO_HOST = ""  # the audit name of a request whose host could not be read
_RECORDS_LIMIT = 100_000


class Tally:
    """Responses counted towards one audit record since the audit writer last drained them:
    how many, and the first and last one's time."""

    __slots__ = ("first", "last", "n", "record")

    def __init__(self, record: AuditRecord) -> None:
        self.record = record
        self.n = 0
        self.first = self.last = 0.0


class _Counted(Tally):
    """A tally of the general path (refusals, rejections, proxied exchanges)."""

    __slots__ = ("decision",)

    def __init__(self, record: AuditRecord, decision: Decision) -> None:
        super().__init__(record)
        self.decision = decision  # keeps the ids in the memo key from being reused


class Ledger:
    """The tallies of one front app, its decision ids and its response counters."""

    def __init__(self, runtime: Runtime, stats: FrontStats) -> None:
        self.runtime = runtime
        self.stats = stats
        self.clock: Callable[[], float] = time.time
        # Tallies counted since the audit writer last drained them. They stay here when the
        # caches are dropped, so no count is lost to a new snapshot.
        self.tallied: list[Tally] = []
        self.responses = 0  # responses to traffic since start (rule 2 bookkeeping)
        # Decision ids (gtm.audit.decision_id): unique per response (a serial), and leading
        # to the audit row that counts it (node, time, client network and name).
        self.now = 0.0  # the time the answer cache last answered at: its ids' time
        self._ids = itertools.count(1)
        self._node_b = runtime.settings.node_id.encode() + b"~"
        # The general path's records, memoised (see count).
        self._records: dict[tuple[object, ...], _Counted] = {}
        self._closed = False
        runtime.writer.add_source(self.drain)

    def cached_id(self, tail: bytes) -> bytes:
        """The id of a response the answer cache has just given (at ``now``); ``tail`` is its
        answer's :func:`~gtm.audit.decision_id.id_tail`."""
        return render_id(self._node_b, self.now, tail, next(self._ids))

    def decision_id(self, decision: Decision, name: str, at: float) -> bytes:
        """The id of a response the general path gives at ``at`` (the time it is counted
        with, so that its audit row's time span holds the id's time)."""
        tail = id_tail(str(decision.client_network), name)
        return render_id(self._node_b, at, tail, next(self._ids))

    def count(
        self,
        decision: Decision,
        host: str,
        tenant: str | None,
        method: str,
        status: int,
        answer: str | None,
        response: str | None = None,
        *,
        at: float | None = None,
    ) -> None:
        """Count a response of the general path; ``at``: the time its decision id names
        (default now)."""
        self.stats.count(status)
        # The record is memoised: building one walks every candidate and costs more than the
        # decision itself, and almost every response repeats a recent one. The parts of a
        # decision that come from the snapshot's memos are keyed by identity; the entry holds
        # them, so an id cannot be reused by another object while its entry exists.
        key = (
            id(decision.candidates),
            id(decision.location),
            id(decision.client_network),
            id(decision.versions),
            id(decision.matched_rules),
            id(decision.residency_classes),
            decision.outcome,
            decision.region,
            decision.service,
            decision.ttl,
            host,
            tenant,
            method,
            status,
            response,
            answer,
        )
        entry = self._records.get(key)
        if entry is None:
            record = record_of(
                decision,
                channel="http",
                name=host,
                tenant=tenant,
                query_type=method,
                response=response or str(status),
                answer=(answer,) if answer else (),
            )
            if len(self._records) >= _RECORDS_LIMIT:
                self._records.clear()  # tallies being counted stay in self.tallied
            entry = self._records[key] = _Counted(record, decision)
        now = self.clock() if at is None else at
        if entry.n:
            entry.n += 1
            # Responses counted at their decision's time (``at``) can end out of order (a
            # long proxied exchange decided first): the row must span every one of them.
            if now < entry.first:
                entry.first = now
            if now > entry.last:
                entry.last = now
        else:
            entry.n = 1
            entry.first = entry.last = now
            self.tallied.append(entry)
        self.responses += 1

    def count_rejected(
        self, snapshot: Snapshot, peer: IPAddress, host: str | None, method: str, status: int
    ) -> None:
        """Count a response that no decision stood behind (bad input, unknown host): the
        audit row holds a no-service decision for the peer, so these answers add up too."""
        decision = decide(DecisionRequest(Channel.HTTP, peer, "", host or NO_HOST), snapshot, 0.0)
        self.count(decision, host or NO_HOST, None, method, status, None)

    def drain(self) -> Iterator[Drained]:
        """The audit writer's source: the responses counted since the last drain. Runs on the
        loop, interleaved with answering (the writer slices its flush): a tally counted again
        before its turn here is drained with that count too, and one counted after its turn
        is listed again for the next drain."""
        tallied, self.tallied = self.tallied, []
        for tally in tallied:
            n = tally.n
            if n:
                tally.n = 0
                yield tally.record, n, tally.first, tally.last
        if self._closed and not self.tallied:
            self.runtime.writer.remove_source(self.drain)

    def close(self) -> None:
        """No more responses: drop the memo. What was counted stays with the audit writer's
        next drain (the runtime's stop flushes), after which the source removes itself."""
        self._closed = True
        self._records.clear()


__all__ = ["NO_HOST", "Ledger", "Tally"]
