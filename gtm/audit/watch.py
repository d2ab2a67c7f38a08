"""Scheduled verification: the store checked against its checkpoints on a schedule, each pass
going on from where the last one ended.

A node serving the admin API runs it (every ``GTM_AUDIT_VERIFY_INTERVAL_S``; 0 turns it off).
The first pass reads every chain from its start (or its retention cut); each later pass starts
every chain at the newest checkpoint the passes before matched, so it reads only what was
written since. A pass that finds a break counts ``gtm_audit_verify_failures_total``, logs every
break, and does not move on: the next pass checks the same rows again, and the alert stays
until someone looks. ``gtm_audit_verified_through_seconds`` is the time of the newest checkpoint
through which every chain verified: it stops moving when verification fails or when nothing
signs checkpoints any more, which is what the "no checkpoint for N minutes" alert watches.

A pass runs in a thread of its own with its own event loop and database connection, at a lower
CPU priority: hashing every row is CPU work, and the node's loop answers queries meanwhile.
A row edited after a pass verified it sits behind where the next pass starts, so resuming
alone would never see it. So every ``GTM_AUDIT_VERIFY_FULL_EVERY_S`` (6 hours by default; 0:
every pass) a pass reads every chain from its start again, and ``gtm_audit_full_verified_at``
says when one last succeeded: an edit behind the resume points is found within that period. A
full ``gtm audit verify`` remains the auditor's own check.

The outcome of the latest pass is also kept in memory (:attr:`VerificationWatch.last_pass`), which
the admin API shows (``GET /v1/audit/chains``): the admin process runs the watch, so it needs no
table of its own, and no one with database access can make a failed pass look clean. Each admin
node reports its own passes; a restarted node has none until its first pass, which starts at
once.

An erased store does not wait for a full pass. The threat is someone holding the database
password (not the keys, not the sink) who deletes every row, resets the heads and gives the store
a new id, so that the database looks freshly migrated. Every pass, resumed or full, reads every
checkpoint in the sink, and :func:`gtm.audit.verify.verify` reports the sink's checkpoints of a
store that is not the database's (and a store id the sink does not know) as breaks; a chain
resumed at a checkpoint whose row is gone is a break too. So an erased store is reported by the
first pass that starts after the erasure: within ``GTM_AUDIT_VERIFY_INTERVAL_S`` (60 s by
default) plus one pass, which reads only what was written since the last (measured: about 1 s
from the wipe to the failed pass at a 1 s interval on SQLite and PostgreSQL, the test
``test_the_scheduled_verification_reports_an_erased_store_at_its_next_pass``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gtm import metrics
from gtm.audit.checkpoints import Checkpoint, CheckpointSink
from gtm.audit.database import make_async_engine
from gtm.audit.pacing import run_in_background
from gtm.audit.record import ChainBreak
from gtm.audit.verify import Verification, verify

log = structlog.get_logger(__name__)

_KEPT_BREAKS = 100  # a pass's breaks kept for the API; the count is always whole


@dataclass(frozen=True, slots=True)
class PassRecord:
    """What the latest pass found, or why it could not run (``error``)."""

    started_at: float
    finished_at: float
    ok: bool  # ran, and every chain verified
    rows: int = 0  # decision rows read (a later pass reads only what came after the last)
    full: bool = False  # read every chain from its start (see full_every_s)
    chains: int = 0
    breaks: tuple[ChainBreak, ...] = ()  # the first of them
    break_count: int = 0
    gaps: int = 0
    cuts: int = 0
    unanchored: int = 0  # rows after their chain's newest checkpoint
    verified_through: float | None = None  # the newest checkpoint every chain verified through
    error: str | None = None


@dataclass
class VerificationWatch:
    database_url: str
    sink: CheckpointSink
    clock: Callable[[], float] = time.time
    # chain -> the newest checkpoint a pass matched: where the next pass starts it
    starts: dict[str, Checkpoint] = field(default_factory=dict)
    passes: int = 0
    failures: int = 0
    last: Verification | None = None
    last_pass: PassRecord | None = None
    verified_through: float | None = None  # gtm_audit_verified_through_seconds
    interval_s: float | None = None  # while :meth:`run` runs
    # A pass from the start of every chain this often (0: every pass), and when one last ran
    # through clean.
    full_every_s: float = 6 * 3600.0
    full_at: float | None = None
    # The fleet's liveness bound: a missing tail a node reported within it as still in its
    # spool is late, not a break (gtm.audit.spool_reports). None: no spool counts.
    live_within_s: float | None = None

    halt: threading.Event = field(default_factory=threading.Event)

    def full_due(self) -> bool:
        """Whether the next pass reads every chain from its start (see the module docstring):
        none has run clean yet, or the last one is ``full_every_s`` old."""
        return self.full_at is None or self.clock() - self.full_at >= self.full_every_s

    async def _verify(self, start: dict[str, Checkpoint]) -> Verification:
        engine = make_async_engine(self.database_url)
        try:
            spools_since = None if self.live_within_s is None else self.clock() - self.live_within_s
            task = asyncio.create_task(
                verify(engine, self.sink, start=start, spools_since=spools_since)
            )
            # A node stopping must not wait for a long pass: it sets ``halt``.
            while not task.done():
                await asyncio.wait({task}, timeout=0.1)
                if self.halt.is_set():
                    task.cancel()
            return await task
        finally:
            await engine.dispose()

    def _in_thread(self, start: dict[str, Checkpoint]) -> Verification:
        run_in_background()
        return asyncio.run(self._verify(start))

    async def once(self) -> Verification:
        """One pass; updates the metrics, the start points and :attr:`last_pass`."""
        started = self.clock()
        full = self.full_due()
        start = {} if full else dict(self.starts)
        try:
            result = await asyncio.to_thread(self._in_thread, start)
        except asyncio.CancelledError:
            self.halt.set()
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.last_pass = PassRecord(started, self.clock(), ok=False, full=full, error=error)
            raise
        self.passes += 1
        self.last = result
        metrics.AUDIT_VERIFY_BREAKS.set(len(result.breaks))
        metrics.AUDIT_VERIFY_PASSES.inc()
        if result.breaks:
            self.failures += 1
            self.last_pass = self._record(started, result, full)
            metrics.AUDIT_VERIFY_FAILURES.inc()
            for b in result.breaks:
                log.error("audit.verify_break", chain=b.node, seq=b.node_seq, problem=b.problem)
            return result
        for chain, checked in result.chains.items():
            if checked.anchored is not None:
                self.starts[chain] = checked.anchored
        if result.spooled:
            # Not broken, not verified through either: a tail still in a node's spool is read
            # by a later pass (from the checkpoint each chain matched), which then moves on.
            self.last_pass = self._record(started, result, full)
            log.info("audit.verify_spooled",
                     chains={c: r.spooled for c, r in sorted(result.spooled.items())})  # fmt: skip
            return result
        if result.newest_at is not None:
            self.verified_through = result.newest_at
            metrics.AUDIT_VERIFIED_THROUGH.set(result.newest_at)
        if full:
            self.full_at = started
            metrics.AUDIT_FULL_VERIFIED_AT.set(started)
        self.last_pass = self._record(started, result, full)
        log.info(
            "audit.verified",
            full=full,
            rows=result.rows,
            chains=len(result.chains),
            through=result.newest_at,
            unanchored=sum(result.unanchored.values()),
        )
        return result

    def _record(self, started: float, result: Verification, full: bool) -> PassRecord:
        return PassRecord(
            started_at=started,
            finished_at=self.clock(),
            ok=not result.breaks,
            full=full,
            rows=result.rows,
            chains=len(result.chains),
            breaks=tuple(result.breaks[:_KEPT_BREAKS]),
            break_count=len(result.breaks),
            gaps=len(result.gaps),
            cuts=len(result.cuts),
            unanchored=sum(result.unanchored.values()),
            verified_through=self.verified_through,
        )

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """A pass every ``interval_s`` until ``stop`` is set."""
        self.interval_s = interval_s
        while not stop.is_set():
            try:
                await self.once()
            except Exception:  # a database away, a sink unreadable: try again next time
                metrics.AUDIT_VERIFY_FAILURES.inc()
                log.exception("audit.verify_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


__all__ = ["PassRecord", "VerificationWatch"]
