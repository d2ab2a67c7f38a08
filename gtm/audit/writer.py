"""The batched audit writer: counts on the answering path, writes beside it.

``count()`` is all an answering path needs: a dictionary increment, no I/O, no await. Paths that
answer tens of thousands of times a second keep their own tallies instead (an integer on a cached
answer) and register a source that the writer drains at each flush (:meth:`add_source`). A
background task flushes on an interval, or sooner when many distinct decisions are pending: the
tallies of the window become rows (identical decisions one row with a count), rows are chained,
appended to the local spool, and then drained from the spool into the database (see
:mod:`gtm.audit.spool`).

A flush shares the event loop with the answering paths, so it is built to stay out of their way:

* rows are rendered from per-record templates (:func:`gtm.audit.record.row_form`), a few
  microseconds each, on the loop in slices of a fraction of a millisecond (a thread would hold
  the GIL against the loop for a whole switch interval at a time, and compete for the core);
* a flush allocates a handful of containers however many rows it writes: thousands of row
  objects living through a flush would be promoted to the oldest GC generation and trigger full
  collections, which stall the loop for tens of milliseconds;
* file and database I/O run in threads, the database's in batches small enough that each
  executes in about a millisecond, and at a lower CPU priority than the loop's thread: on a
  core shared with the loop, the kernel then hands the core back to the loop as soon as a
  query arrives instead of letting an insert finish its time slice first;
* the background flushes are paced: after each slice of work (rendering rows, or one insert
  batch) the writer rests several times as long. A flush's hundred milliseconds of work per
  five thousand rows, done in one go, would take the core from the answering paths long enough
  to queue thousands of queries; spread over most of the flush interval it takes a steady
  sliver instead. When a flush takes longer than the interval, the next window is simply
  longer, and identical decisions share rows over it. Explicit flushes (shutdown, tests) are
  not paced.

Between seals, the tally journal (:mod:`gtm.audit.journal`, every ``journal_interval``, 100 ms
in a node) takes what was counted since its last tick into the window and appends it to a file
in the spool directory, so a ``kill -9`` loses about one journal interval of answers instead of
the whole window. Its ticks run in the writer's background task like a flush (in slices, paced),
never on the answering path, and write in a thread of their own, so an fsync of the spool does
not hold them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import structlog
from prometheus_client import Counter
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm import metrics
from gtm.audit.drain import Database
from gtm.audit.journal import JOURNAL_REPLAYED, Journal
from gtm.audit.pacing import Slices, run_in_background
from gtm.audit.record import GENESIS, AuditRecord, row_body, row_form
from gtm.audit.rows import Batch, Window, append_batch, queued_rows, static_params
from gtm.audit.spool import ChainHead, Spool
from gtm.decision.memos import DEFAULT_BUDGET_MB

log = structlog.get_logger(__name__)

# (record, answers, first answer, last answer), times in unix seconds.
Tally = tuple[AuditRecord, int, float, float]
TallySource = Callable[[], Iterator[Tally]]

_MAX_QUEUED_ROWS = queued_rows(DEFAULT_BUDGET_MB)
_REST = 6.0  # paced flushes rest this many times as long as each slice of work took
# Rows read back from the spool per part of a drain: about 7 KiB each as dictionaries with
# their lines (memray: 35 MiB held for a part of 5,000, the largest thing in the heap of a node
# under load; 7 MiB at 1,000, still a tenth of a flooded node's growth). Four insert batches.
_SPOOL_READ_ROWS = 256
# Journal ticks rest only as long as they worked: a tick's work is small (a few microseconds
# per decision answered since the last one), and how long a tick takes is how long its answers
# stay in memory only. Paced like a flush, a tick under a saturated loop took most of a second.
_JOURNAL_REST = 1.0


class AuditWriter:
    def __init__(
        self,
        engine: AsyncEngine,
        node: str,
        spool: Spool,
        *,
        flush_interval: float = 1.0,
        max_pending: int = 10_000,
        clock: Callable[[], float] = time.time,
        spool_max_bytes: int = 1 << 30,
        on_sealed: Callable[[AuditRecord, int], None] | None = None,
        rest: float = _REST,
        journal_interval: float = 0.0,
        max_queued_rows: int = _MAX_QUEUED_ROWS,
        db_timeout_s: float = 10.0,
    ) -> None:
        self.engine = engine
        # Where the drains write (gtm.audit.drain): a drain whose database connection makes no
        # progress for db_timeout_s is abandoned; the rows stay spooled for the next.
        self.database = Database(engine, node, timeout_s=db_timeout_s, clock=clock)
        # The highest sequence the database is known to hold for this node (None: not read
        # yet): sealed rows above it are the spooled rows gtm_audit_spooled_rows counts.
        self._db_seq: int | None = None
        self.max_queued_rows = max_queued_rows
        # Paced work rests this many times as long as each slice took (0: not paced, which
        # bench/audit.py uses to measure the most the writer can take).
        self.rest = rest
        # Told each row sealed, with its answer count: the metrics that break answers down by
        # what a row holds (gtm.answer_labels) count here, once per row rather than per answer.
        self.on_sealed = on_sealed
        self.node = node
        self.spool = spool
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self.spool_max_bytes = spool_max_bytes
        self._clock = clock
        self._node_json = orjson.dumps(node)
        # record -> [count, first answer, last answer (unix seconds)]
        self._pending: dict[AuditRecord, list[Any]] = {}
        self._sources: list[TallySource] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._lock = asyncio.Lock()  # sealing and spooling, window by window
        self._drain_lock = asyncio.Lock()  # the spool to the database, in the same order
        self._drainer: asyncio.Task[None] | None = None  # the background drain, if running
        # Windows sealed while a drain ran, oldest first: the drain takes them on as they are,
        # without reading them back from the spool (which parses every row again, several times
        # the work of the insert: a writer that fell behind used to fall further behind).
        self._queued: deque[Batch] = deque()
        self._behind = False  # windows too many to queue were sealed: only the spool has them
        # Spool appends, reads and truncations in one thread, so they happen in order even when
        # a flush is cancelled while its append is still being written.
        self._io: ThreadPoolExecutor | None = None
        self._seq, self._last_hash, self._answers = spool.chain_head() or ChainHead(0, GENESIS, 0)
        self.counted = 0  # answers counted since start (rule 2 bookkeeping)
        self._counters: dict[str, Counter] = {}  # labelled children, looked up once
        # Whether the spool may hold rows from before this run or from failed flushes; the
        # first flush after start always reads it.
        self._backlog = True
        self.last_error: str | None = None
        # The tally journal (gtm.audit.journal): ticks every journal_interval (0: off; a
        # journal a previous run left is still replayed at start). The window being counted
        # and its generation (one journal file per window); ticks and the seal's swap of the
        # window take turns under _tick_lock.
        self.journal_interval = journal_interval
        self.journal = Journal(spool, node)
        self._window = Window()
        self._generation = spool.journal_sealed + 1
        self._tick_lock = asyncio.Lock()
        self._journal_task: asyncio.Task[None] | None = None
        self._journal_io: ThreadPoolExecutor | None = None
        self._journal_broken = -1  # a generation whose write failed: not journaled further
        self._halt = asyncio.Event()  # wakes the journal's ticks to stop
        self.journal_ticks = 0  # ticks written this run (tests, benchmarks)
        self.journal_replayed = 0  # answers replayed from the journal at start
        # Seals begun: a source drained by a seal sees a new value (a tick's drain, the same),
        # so a budget of what waits to be sealed restarts only when that happens.
        self.seals = 0

    # -- the answering path --------------------------------------------------------------------

    def count(self, record: AuditRecord, n: int = 1) -> None:
        """Count ``n`` answers of ``record``. Never blocks, never raises on I/O."""
        now = self._clock()
        entry = self._pending.get(record)
        if entry is None:
            self._pending[record] = [n, now, now]
            if len(self._pending) >= self.max_pending:
                self._wake.set()
        else:
            entry[0] += n
            entry[2] = now
        self.counted += n

    def add_source(self, source: TallySource) -> None:
        """Drain ``source`` at every flush: it yields the answers it counted since the last
        drain (and forgets them). Called on the event loop, like everything here."""
        self._sources.append(source)

    def remove_source(self, source: TallySource) -> None:
        with contextlib.suppress(ValueError):
            self._sources.remove(source)

    # -- beside it -----------------------------------------------------------------------------

    def head(self) -> ChainHead:
        """The end of the chain as sealed so far (spooled, if not yet in the database)."""
        return ChainHead(self._seq, self._last_hash, self._answers)

    def spool_range(self) -> tuple[int, int] | None:
        """(drained, sealed): the newest row the database is known to hold and the newest
        sealed; the rows between are only in the spool. None until the writer knows what the
        database holds. The node reports it with its status (gtm.audit.verify reads it)."""
        if self._db_seq is None:
            return None
        return min(self._db_seq, self._seq), self._seq

    async def start(self) -> None:
        """Continue this node's chain and replay anything a previous run left in the spool."""
        if self._seq == 0:
            self._seq, self._last_hash, self._answers = await self.database.chain_head()
        await self._recover_journal()
        await self.flush()
        self._stopping = False
        self._halt.clear()
        self._task = asyncio.create_task(self._run(), name="audit-writer")
        if self.journal_interval > 0:
            self._journal_task = asyncio.create_task(self._journal_run(), name="audit-journal")

    async def _recover_journal(self) -> None:
        """Put the answers a previous run journaled and never sealed into this window (the
        flush that follows seals them; their files go once it has)."""
        recovered = await self._in_journal(
            self.journal.recover, self.spool.journal_sealed, self.spool.bound_store()
        )
        # This start's flush seals the recovered window as the generation past every file
        # seen, and so drops them all (refused ones were kept aside by recover()).
        self._generation = max(self._generation, recovered.generation)
        for record, n, first, last in recovered.tallies:
            self._window.add(record, n, first, last)
        if recovered.answers:
            self.journal_replayed = recovered.answers
            JOURNAL_REPLAYED.inc(recovered.answers)
            if recovered.through is not None:
                # Lost from the journal's last tick on, not from the spool's last write: a seal
                # ending after that tick seals the window before it, none of the answers since.
                self.spool.recovered_through = recovered.through
            log.warning(
                "audit.journal_replayed",
                answers=recovered.answers,
                decisions=len(recovered.tallies),
                files=recovered.files,
                through=recovered.through,
            )
        if recovered.problems:
            log.error("audit.journal_refused", lines=len(recovered.problems),
                      kept_in=str(self.spool.rejected_path))  # fmt: skip

    async def stop(self) -> None:
        """Final flush. Whatever the database cannot take stays spooled for the next start."""
        if self._task is not None:
            # Not cancelled: a flush in progress finishes (a cancelled one would leave its
            # sealed rows for the next flush to find in the spool; this is simpler to reason
            # about).
            self._stopping = True
            self._wake.set()
            self._halt.set()
            with contextlib.suppress(Exception):
                await self._task
            self._task = None
        if self._journal_task is not None:
            # Not cancelled either: a tick that took tallies puts them all in the window.
            self._stopping = True
            self._halt.set()
            with contextlib.suppress(Exception):
                await self._journal_task
            self._journal_task = None
        if self._drainer is not None:
            with contextlib.suppress(Exception):
                await self._drainer
            self._drainer = None
        await self.flush()
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._journal_io is not None:
            self._journal_io.submit(self.journal.close)
            self._journal_io.shutdown(wait=True)
            self._journal_io = None

    async def _run(self) -> None:
        """Seal every interval, and drain beside it. Sealing (tallies to chained rows on disk)
        keeps its cadence however slowly the database takes the rows: a window sealed while a
        drain runs waits in the spool, and that drain goes on to read it. A crash therefore
        loses at most the window being counted. (When one flush both sealed and drained, a
        database slower than the interval kept every later window's tallies in memory: a
        kill -9 at 50,000 answers a second lost 97% of four seconds of answers.)"""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.flush_interval)
            self._wake.clear()
            if self._stopping:
                return
            try:
                batch = await self._seal_window(Slices(self._pace()))
            except Exception:  # the writer must outlive one bad flush (a full disk, say)
                log.exception("audit.flush_error")
                continue
            if self._drainer is not None and not self._drainer.done():
                self._queue(batch)
            else:
                self._drainer = asyncio.create_task(self._drain_behind(batch), name="audit-drain")

    def _pace(self) -> float:
        """How long paced work rests, per second of work, now: ``rest``, except while new
        decisions come faster than paced work seals and writes them (the open window past half
        of ``max_pending``, or sealed windows waiting for the database), when it rests no
        longer than it worked: the writer then takes about half the core instead of a seventh,
        and the answering paths answer more slowly rather than shed what it cannot take (a
        random-subnet flood: the DNS responder sheds new decisions past its budget)."""
        if (
            self._queued
            or self._behind
            or len(self._window) + len(self._pending) >= self.max_pending // 2
        ):
            return min(self.rest, 1.0)
        return self.rest

    async def _journal_run(self) -> None:
        """A journal tick every interval until the writer stops."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._halt.wait(), timeout=self.journal_interval)
            if self._stopping:
                return
            try:
                await self._journal_tick(Slices(min(self.rest, _JOURNAL_REST)))
            except Exception:  # the journal must outlive one bad tick
                log.exception("audit.journal_error")

    async def journal_tick(self) -> bool:
        """Journal now what was counted since the last tick (the background task does this
        every ``journal_interval``); whether a line was written."""
        async with self._tick_lock:
            return await self._tick(Slices(0.0), final=False)

    async def _journal_tick(self, slices: Slices) -> None:
        async with self._tick_lock:
            await self._tick(slices, final=False)

    async def _tick(self, slices: Slices, *, final: bool) -> bool:
        """Take what was counted since the last tick into the window, and append it to the
        window's journal file: from then on a kill -9 does not lose it. ``final``: the seal's
        own take, which is journaled too (a seal paced over most of a second would otherwise
        hold the answers of its last moments in memory only, for as long as it runs). Called
        with ``_tick_lock`` held."""
        window, generation = self._window, self._generation
        journaling = generation != self._journal_broken
        if not final:
            if not journaling:
                return False  # a write of this window failed: its seal covers it
            if len(window) >= self.max_pending:
                # Memory stays bounded as before the journal: leave the tallies with their
                # sources (which shed new decisions past their budget) and seal now.
                self._wake.set()
                return False
        at = self._clock()  # every answer counted before this instant is in this tick
        numbers, spans = await window.take_in(self._take(), slices)
        if not numbers or not journaling:
            return False
        store = self.spool.bound_store()
        try:
            for body in self.journal.encode(generation, at, window.records, numbers, spans):
                await self._in_journal(self.journal.write, generation, body, store)
        except OSError as exc:
            self._journal_broken = generation
            log.warning("audit.journal_write_failed", error=str(exc))
            return False
        except BaseException:
            # Cut off part way otherwise (cancelled at a stop, say): the journal counted the
            # definitions on the lines it made as written, so a later tick's lines could refer
            # to decisions the file never defined. This window is journaled no further; its
            # seal covers it, as after a failed write.
            self._journal_broken = generation
            raise
        self.journal_ticks += 1
        if len(window) >= self.max_pending:
            self._wake.set()
        return True

    async def _in_journal(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._journal_io is None:
            # Not lowered in priority like the spool's thread: its work is a MAC and a write()
            # per tick, and while it waits for a core the tick's answers are in memory only.
            self._journal_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-journal")
        return await asyncio.get_running_loop().run_in_executor(self._journal_io, fn, *args)

    async def _in_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._io is None:
            self._io = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="audit-spool", initializer=run_in_background
            )
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def flush(self, *, paced: bool = False) -> int:
        """Turn the tallies of the window into rows, spool them, and drain the spool; returns
        rows committed. ``paced``: spread the work out. (The background task seals every
        interval and drains beside it: :meth:`_run`.)"""
        slices = Slices(self.rest if paced else 0.0)
        batch = await self._seal_window(slices)
        if slices.cancelled:
            self._backlog = True  # sealed and spooled, not drained: the next drain reads it
            raise asyncio.CancelledError
        return await self._drain_window(batch, slices)

    async def _seal_window(self, slices: Slices) -> Batch:
        """The window's tallies as chained rows, appended to the spool (on disk from here on,
        whatever happens to this task)."""
        async with self._lock:
            self.seals += 1
            journaled = self.journal_interval > 0
            async with self._tick_lock:  # a tick in progress finishes first
                if journaled:
                    await self._tick(Slices(min(slices.rest, _JOURNAL_REST)), final=True)
                window, self._window = self._window, Window()
                generation = self._generation
                self._generation += 1
            if not journaled:
                await window.gather(self._take(), slices)
            batch = await self._seal(window.records, window.counts, window.times, slices)
            if len(batch):
                # The rows and, with the chain's end, the journal generation they seal.
                batch.end = await self._in_io(
                    append_batch, self.spool, batch, self._node_json, generation
                )
                if self._db_seq is None:
                    # Not yet read from the database this run: what the spool holds, counted
                    # once (later drains keep it exact).
                    lines = await self._in_io(self.spool.line_count)
                    self._db_seq = max(0, self._seq - lines)
                await self._watch_spool()
            # Sealed (fsynced): the window's journal file is no longer needed. (Dropped in the
            # journal's thread, after any write to it; dropping it before the rows were on
            # disk would lose them to a crash in between.)
            await self._in_journal(self.journal.drop_through, generation)
            return batch

    def _queue(self, batch: Batch) -> None:
        """Keep a window sealed while a drain runs for that drain to take next."""
        if not len(batch) or self._behind:
            return  # nothing to insert; or the spool is read next anyway, this window with it
        if sum(map(len, self._queued)) + len(batch) > self.max_queued_rows:
            # Memory stays bounded however far the database lags: the spool has them all.
            self._queued.clear()
            self._behind = True
            return
        self._queued.append(batch)

    async def _drain_window(
        self, batch: Batch | None, slices: Slices, *, oldest: bool = False
    ) -> int:
        """The spool to the database, in sealing order: just ``batch`` when nothing sealed
        before it waits (``oldest``: the caller took it off the front of the queue), else
        everything the spool holds (``batch`` None: read it anyway)."""
        async with self._drain_lock:
            backlog = (
                batch is None
                or self._backlog
                or self._behind
                or (bool(self._queued) and not oldest)
                # An earlier window not in yet (its drain has not run): this one first would
                # make the database skip its rows for good (it skips what it holds already).
                or batch.first_seq > (self._db_seq or 0) + 1
            )
            if backlog:
                self._behind = False  # a read of the spool takes every window sealed so far
            # Until this drain succeeds, the spool may hold rows no drain took.
            self._backlog = True
            return await self._drain(None if backlog else batch, slices)

    async def _drain_behind(self, batch: Batch) -> None:
        """A background drain: this window, then the windows sealed meanwhile, in order."""
        try:
            await self._drain_window(batch, Slices(self._pace()))
            while (self._queued or self._behind) and not self._stopping and not self._backlog:
                if self._queued:
                    oldest = self._queued.popleft()
                    await self._drain_window(oldest, Slices(self._pace()), oldest=True)
                else:
                    await self._drain_window(None, Slices(self._pace()))
            # A drain that failed leaves the rest queued: the next one reads the spool.
        except Exception:  # the writer must outlive one bad drain; the spool keeps the rows
            log.exception("audit.flush_error")

    def _take(self) -> Iterator[Tally]:
        pending, self._pending = self._pending, {}
        for record, (n, first, last) in pending.items():
            yield record, n, first, last
        for source in tuple(self._sources):
            for tally in source():
                self.counted += tally[1]
                yield tally

    async def _seal(
        self, records: list[AuditRecord], counts: array[int], times: array[float], slices: Slices
    ) -> Batch:
        """Rows for the gathered tallies, chained."""
        seq, prev = self._seq, self._last_hash
        batch = Batch(seq + 1, prev, self._answers + sum(counts))
        forms, numbers, hashes = batch.forms, batch.numbers, batch.hashes
        node_json = self._node_json
        channels: dict[str, int] = {}
        clock = time.perf_counter
        for i, record in enumerate(records):
            form = record._form or row_form(record, static_params)
            n = counts[i]
            seq += 1
            first_us, last_us = int(times[2 * i] * 1_000_000), int(times[2 * i + 1] * 1_000_000)
            body = row_body(form, n, first_us, last_us, node_json, seq)
            prev = hashlib.sha256(prev.encode() + body).hexdigest()
            forms.append(form)
            numbers.extend((n, first_us, last_us))
            hashes.append(prev)
            channels[record.channel] = channels.get(record.channel, 0) + n
            if clock() > slices.deadline:
                await slices.next()
        self._seq, self._last_hash, self._answers = seq, prev, batch.answers
        for channel, n in channels.items():
            counter = self._counters.get(channel)
            if counter is None:
                counter = self._counters[channel] = metrics.DECISIONS_COUNTED.labels(channel)
            counter.inc(n)
        if self.on_sealed is not None:
            for record, n in zip(records, counts, strict=True):
                self.on_sealed(record, n)
        return batch

    async def _drain(self, batch: Batch | None, slices: Slices) -> int:
        """Insert the sealed rows (``batch``, or what the spool holds when it may hold more),
        then empty the spool. One transaction per insert batch, so a paced drain holds no write
        lock while it rests: a crash in between leaves committed rows that the replay skips.
        The spool is read back :data:`_SPOOL_READ_ROWS` rows at a time: a writer far behind (a
        flood of new decisions, a database back after an outage) read it whole, hundreds of
        megabytes of row dictionaries at once."""
        if batch is not None:
            return (await self._drain_part(batch, slices))[0]
        written = 0
        while True:
            self._backlog = True  # until this part is in, the spool holds rows no drain took
            part, more = await self._drain_part(None, slices)
            written += part
            if not more:
                return written

    async def _drain_part(self, batch: Batch | None, slices: Slices) -> tuple[int, bool]:
        """:meth:`_drain` for ``batch``, or for the spool's next rows: rows written, and
        whether the spool may hold more after them."""
        rows: list[dict[str, Any]] = []
        if batch is None:
            rows, end = await self._in_io(self.spool.pending_through, _SPOOL_READ_ROWS)
        else:
            end = batch.end
        more = batch is None and len(rows) >= _SPOOL_READ_ROWS
        if not (len(rows) if batch is None else len(batch)):
            # Nothing in the spool, nor sealed: the next flush need not read the spool back.
            # (Leaving the flag set made the flush after every quiet interval replay the whole
            # spool, parsing each row back from JSON, on the answering path's core.)
            self._backlog = False
            metrics.AUDIT_SPOOLED_ROWS.set(0)
            return 0, False
        done = await self.database.write(batch, rows, slices)
        if done.had is not None:
            self._db_seq = max(done.had, self._db_seq or 0)
        metrics.AUDIT_ROWS_WRITTEN.inc(done.rows)
        if done.error is not None:
            self.last_error = f"{type(done.error).__name__}: {done.error}".splitlines()[0]
            metrics.AUDIT_FLUSH_FAILURES.inc()
            log.warning("audit.flush_failed", spooled=self._spooled(), error=self.last_error)
            await self._watch_spool()
            return 0, False
        await self._in_io(self.spool.discard_through, end)
        while self._queued and self._queued[0].end <= end:
            self._queued.popleft()  # read back from the spool with the rest, and committed
        last = rows[-1]["node_seq"] if batch is None else batch.first_seq + len(batch) - 1
        self._db_seq = max(self._db_seq or 0, int(last))
        self._backlog = False
        self.last_error = None
        await self._watch_spool()
        return done.rows, more

    def _spooled(self) -> int:
        """Rows sealed (in the spool) that the database is not known to hold yet."""
        return max(0, self._seq - (self._db_seq or 0)) if self._db_seq is not None else 0

    async def _watch_spool(self) -> None:
        """The spool's gauges as they stand: every row sealed and not yet in the database,
        and the file's size (after each seal and each drain, failed or not)."""
        metrics.AUDIT_SPOOLED_ROWS.set(self._spooled())
        size = await self._in_io(self.spool.size)
        metrics.AUDIT_SPOOL_BYTES.set(size)
        over = size > self.spool_max_bytes
        metrics.AUDIT_SPOOL_OVER_CAP.set(1 if over else 0)
        if over:
            log.error("audit.spool_over_cap", bytes=size, cap=self.spool_max_bytes)
