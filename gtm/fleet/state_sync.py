"""Keeping one node in step with the fleet through the shared database.

Every ``interval_s`` (0.5 s by default) a node writes its own health observations and any
region events it has queued, then reads its peers' fresh observations, the operators'
overrides and the id of the newest published documents; the
:class:`~gtm.fleet.region_state.RegionBook` then composes the state in force and the runtime swaps a
snapshot if it changed. Version polling rather than PostgreSQL LISTEN/NOTIFY: one code path for
SQLite and PostgreSQL, a bound on how late a change arrives (one interval) that meets the 2-second
target, and nothing to re-arm after a lost connection.

When the database is away the node keeps answering from what it has: its own probes go on
deciding (its peers' observations age out, so it decides alone), queued events wait in memory,
and ``age_s`` (exported as ``gtm_state_sync_age_seconds``) says how old its view of the fleet is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.cancelling import cancel_within, run_bounded
from gtm.control.log import ControlLog, LogRefused
from gtm.fleet import shared_state
from gtm.fleet.operator import overrides_of
from gtm.fleet.region_state import Composed, Observation, RegionBook, RegionEvent
from gtm.fleet.shared_state import NodeStatus, Published

log = structlog.get_logger(__name__)

# Events kept in memory while the database is away; beyond this the oldest are dropped (and
# counted): a region flapping through a day-long outage must not exhaust memory.
MAX_PENDING_EVENTS = 10_000


def round_timeout_s(interval_s: float) -> float:
    """How long one round's database calls may take before the round counts as failed: so a
    node cut off notices within this plus one interval (gtm.fleet.roster dates fences by it)."""
    return max(2.0, 2 * interval_s)


# Rounds given up while still stuck on I/O, at most (each holds a connection).
MAX_STUCK_ROUNDS = 3


def round_bound_s(interval_s: float) -> float:
    """How long the loop waits for one round: its two phases, each bounded by
    :func:`round_timeout_s`, and an interval of slack. Past it the round is stuck in a
    cancellation (a close waiting on a silent peer) and is given up."""
    return 2 * round_timeout_s(interval_s) + interval_s


def fence_slack_s(interval_s: float) -> float:
    """How long after its bound a cut-off node may still be unfenced: its fence is checked after
    every phase of a round, and one phase hangs at most :func:`round_timeout_s`, after a sleep
    of one interval (one more for a busy loop's lateness)."""
    return round_timeout_s(interval_s) + 2 * interval_s


class StateSync:
    def __init__(
        self,
        engine: AsyncEngine,
        book: RegionBook,
        *,
        interval_s: float,
        own_observations: Callable[[float], list[Observation]],
        on_compose: Callable[[Composed], None],
        on_documents: Callable[[list[Published]], None],
        own_status: Callable[[float], NodeStatus] | None = None,
        clock: Callable[[], float] = time.time,
        control: ControlLog | None = None,
        cut: Callable[[], int] | None = None,
    ) -> None:
        self.engine = engine
        # Shuts every socket of ``engine`` (the fleet exchanges' own:
        # gtm.audit.deadline.EngineSockets), ending a round stuck on a silent peer; None:
        # nothing can (SQLite, a local file, never silent).
        self._cut = cut
        self.book = book
        self.interval_s = interval_s
        self.own_observations = own_observations
        self.on_compose = on_compose
        self.on_documents = on_documents
        self.own_status = own_status
        # Operator overrides come from the verified control log, never from their table.
        self.control = control if control is not None else ControlLog({})
        self._clock = clock
        self.pending: deque[RegionEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        self._in_flight = 0  # events taken off ``pending`` by an append not yet committed
        self.dropped_events = 0
        self.document_id: int | None = None
        self.last_ok: float | None = None
        self.started_at = clock()
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        # Rounds given up while still stuck (see _loop): at most MAX_STUCK_ROUNDS at once.
        self._stuck: set[asyncio.Task[bool]] = set()
        self._down_since: float | None = None
        self._composed_at = clock()

    @property
    def age_s(self) -> float:
        """Seconds since the node last heard from the shared database."""
        return self._clock() - (self.last_ok if self.last_ok is not None else self.started_at)

    async def start(self) -> None:
        # The clock first: a fence must come on time even if this first round hangs.
        self._ticker = asyncio.create_task(self._keep_composing(), name="state-compose")
        await self.sync_once()  # start from the fleet's state and documents when reachable
        self._task = asyncio.create_task(self._loop(), name="state-sync")

    async def stop(self) -> None:
        for task in (self._task, self._ticker):
            if task is not None:
                # Bounded: a round cancelled inside a database call through a silent network
                # may never end (gtm.cancelling).
                await cancel_within(task)
        for stuck in self._stuck:
            stuck.cancel()  # not waited for: they are stuck on I/O (gtm.cancelling)
        self._stuck.clear()
        self._task = self._ticker = None
        # One last try: events of the final seconds (a drain on shutdown) reach the database.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._flush_events()

    @property
    def unsent(self) -> int:
        """Events not yet in the database: queued, or in an append still under way."""
        return len(self.pending) + self._in_flight

    def queue(self, events: tuple[RegionEvent, ...] | list[RegionEvent]) -> None:
        for event in events:
            if len(self.pending) == self.pending.maxlen:
                self.dropped_events += 1
            self.pending.append(event)

    def recompose(self, now: float | None = None) -> Composed:
        """Compose the state in force now and hand it to the runtime (no I/O)."""
        self._composed_at = self._clock() if now is None else now
        composed = self.book.compose(self._composed_at)
        self.queue(composed.events)
        for event in composed.events:
            log.info(
                "region.in_force" if event.kind == "in_force" else "region.override",
                region=event.region,
                state=event.state,
                previous=event.previous,
                detail=event.detail,
            )
        self.on_compose(composed)
        return composed

    async def _keep_composing(self) -> None:
        """Compose at least every other interval, on a clock of its own: a round whose
        database call hangs (a silent network: the driver's cancellation can itself wait on
        the peer) must not hold back the fence, which the fleet dates from this node's last
        report (gtm.fleet.roster), nor an override's lapse."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self._clock() - self._composed_at >= self.interval_s:
                try:
                    self.recompose()
                except Exception:  # the clock must outlive any single failure
                    log.exception("state_sync.compose_failed")

    async def _loop(self) -> None:
        # Each round in a task of its own, waited for a bounded time: a round can stay stuck
        # in the driver's shielded close of a connection whose peer went silent (the rollback
        # as it goes back to the pool waits on the peer, and no deadline reaches it). The loop
        # must not stay with it, nor may the next rounds wait for the control log's lock it
        # holds, or the node never hears from the fleet again after the network comes back.
        # Past the bound its connections are cut (gtm.cancelling.run_bounded); a round that
        # outlives even that (no socket to cut) is given up, left to end on its own; while
        # MAX_STUCK_ROUNDS are, no new one starts (each holds a connection), and the clock of
        # _keep_composing keeps the fence.
        bound = round_bound_s(self.interval_s)
        while True:
            await asyncio.sleep(self.interval_s)
            self._stuck = {task for task in self._stuck if not task.done()}
            if len(self._stuck) >= MAX_STUCK_ROUNDS:
                continue
            round_ = await run_bounded(
                self.sync_once(), within_s=bound, cut=self._cut, name="state-sync-round"
            )
            if not round_.done():
                self._stuck.add(round_)
                self.failures += 1
                log.warning("state_sync.round_abandoned", stuck=len(self._stuck), after_s=bound)
                continue
            if not round_.cancelled() and round_.exception() is not None:
                # The loop must outlive any single failure.
                log.error("state_sync.failed", exc_info=round_.exception())

    async def sync_once(self) -> bool:
        now = self._clock()
        own = self.own_observations(now)
        for observation in own:
            self.book.observe(observation)
        published: list[Published] = []
        try:
            async with asyncio.timeout(round_timeout_s(self.interval_s)):
                await shared_state.write_observations(self.engine, own)
                await self._flush_events()
                peers = await shared_state.read_observations(self.engine, now - self.book.max_age_s)
                with contextlib.suppress(LogRefused):  # refused loudly; last good kept
                    await self.control.refresh(self.engine)
                newest = await shared_state.newest_document_id(self.engine)
                if newest is not None and newest != self.document_id:
                    published = await shared_state.read_published_after(
                        self.engine, self.document_id
                    )
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            self.failures += 1
            if self._down_since is None:
                self._down_since = now
                log.warning("state_sync.database_unreachable", error=f"{type(exc).__name__}")
            self.recompose(now)  # own probes keep deciding; peers' views age out
            return False
        if self._down_since is not None:
            log.info("state_sync.database_back", after_s=round(now - self._down_since, 1))
            self._down_since = None
        self.book.replace_peers(peers)
        try:
            # A log refused now keeps the last good overrides (refresh returned them); one
            # never accepted holds none, and gtm_control_log_broken says so.
            self.book.set_overrides(overrides_of(self.control.good))
        except LogRefused:
            self.book.set_overrides([])
        if published:
            # Every row since the last look is offered: the newest one may be refused (not
            # signed, a replay) while an earlier one of them is the version to put in force.
            self.document_id = max(p.id for p in published)
            self.on_documents(published)
        self.recompose(now)
        if self.own_status is not None:
            # After applying: what this node reports is what it now answers with (the admin
            # service reports an activation done when every member says so). Heard from the
            # fleet means reported to it, too: the fleet dates this node's fence from its last
            # report (gtm.fleet.roster), so a node that can read but not report must not count
            # itself heard from any later than that.
            try:
                async with asyncio.timeout(round_timeout_s(self.interval_s)):
                    await shared_state.write_node_status(self.engine, self.own_status(now))
            except (SQLAlchemyError, OSError, TimeoutError) as exc:
                self.failures += 1
                log.warning("state_sync.status_not_written", error=f"{type(exc).__name__}")
                self.recompose()  # the fence is checked after every phase that can hang
                return False
        silent_s = self.age_s
        self.last_ok = now
        if silent_s > self.interval_s:
            self.recompose(now)  # heard from again: lift a fence now, not a round later
        return True

    async def _flush_events(self) -> None:
        if not self.pending:
            return
        # Taken before the await: a second sync running meanwhile (a caller's sync_once beside
        # the loop's) neither appends the same events again nor pops what it did not take.
        batch = list(self.pending)
        self.pending.clear()
        self._in_flight += len(batch)
        try:
            await shared_state.append_events(self.engine, batch)
        except BaseException:
            self.pending.extendleft(reversed(batch))  # back in front, in order, for the next try
            raise
        finally:
            self._in_flight -= len(batch)
