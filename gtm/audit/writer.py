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
import operator
import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import psycopg
import structlog
from prometheus_client import Counter
from sqlalchemy import JSON, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm import metrics
from gtm.audit import deadline, partitions
from gtm.audit.journal import JOURNAL_REPLAYED, Journal
from gtm.audit.record import GENESIS, AuditRecord, RowForm, row_body, row_form, shared
from gtm.audit.schema import decisions
from gtm.audit.spool import ChainHead, Spool
from gtm.decision.memos import DEFAULT_BUDGET_MB, tables_mb

log = structlog.get_logger(__name__)

# (record, answers, first answer, last answer), times in unix seconds.
Tally = tuple[AuditRecord, int, float, float]
TallySource = Callable[[], Iterator[Tally]]

_INSERT_BATCH = 64  # about a millisecond of SQLite work per statement
# Sealed rows kept in memory for the drain while it inserts earlier ones; beyond, it reads
# them back from the spool, which has them all. A queued row holds its record's form, three
# numbers and a hash (about 1,500 bytes under a random-subnet flood, where forms are rarely
# shared: the drain task's batch measured 3.7 MiB for some 2,500 rows). Their bound is a share
# of the node's memory budget (gtm.geodns.budget counts QUEUE_SHARE among its tables'): a
# fixed 25,000 came to some 37 MiB, more than half of the default budget, whenever the
# database fell behind.
QUEUED_ROW_BYTES = 1500
QUEUE_SHARE = 0.06
_MIN_QUEUED_ROWS = 256


def queued_rows(budget_mb: float) -> int:
    """Sealed rows the writer keeps for the drain under a budget of ``budget_mb`` MiB."""
    rows = tables_mb(budget_mb) * (1 << 20) * QUEUE_SHARE / QUEUED_ROW_BYTES
    return max(_MIN_QUEUED_ROWS, int(rows))


_MAX_QUEUED_ROWS = queued_rows(DEFAULT_BUDGET_MB)
_PARTITIONS_EVERY_S = 3600.0  # how often the days ahead are checked for partitions
_PARTITIONS_RETRY_S = 60.0
_BACKGROUND_NICE = 10  # added to the thread's nice value (capped at 19, the lowest priority)
_SLICE_S = 0.0003  # the longest row rendering holds the loop before it answers again
_REST = 6.0  # paced flushes rest this many times as long as each slice of work took
_MAX_REST_S = 0.05  # ...but never longer than this at once
# Journal ticks rest only as long as they worked: a tick's work is small (a few microseconds
# per decision answered since the last one), and how long a tick takes is how long its answers
# stay in memory only. Paced like a flush, a tick under a saturated loop took most of a second.
_JOURNAL_REST = 1.0
_COLUMNS = [str(c.name) for c in decisions.c if c.name != "id"]
_JSON_COLUMNS = frozenset(str(c.name) for c in decisions.c if isinstance(c.type, JSON))
_PER_ROW = ("node", "node_seq", "first_at_us", "last_at_us", "count", "prev_hash", "row_hash")
_STATIC = tuple(c for c in _COLUMNS if c not in _PER_ROW)
# A row's parameters are assembled as (per-row values) + (the record's static values); this
# picks them into the table's column order (None: already in order).
_ORDER = tuple(
    _PER_ROW.index(c) if c in _PER_ROW else len(_PER_ROW) + _STATIC.index(c) for c in _COLUMNS
)
_PICK = None if tuple(range(len(_ORDER))) == _ORDER else operator.itemgetter(*_ORDER)


def _insert_sql(paramstyle: str) -> str:
    # Straight to the driver's executemany: SQLAlchemy's per-row parameter processing cost
    # more than the insert itself at thousands of rows per flush.
    mark = "?" if paramstyle == "qmark" else "%s"
    return (
        f"INSERT INTO decisions ({', '.join(_COLUMNS)}) "
        f"VALUES ({', '.join([mark] * len(_COLUMNS))})"
    )


# Rows read back from the spool per part of a drain: about 7 KiB each as dictionaries with
# their lines (memray: 35 MiB held for a part of 5,000, the largest thing in the heap of a node
# under load; 7 MiB at 1,000, still a tenth of a flooded node's growth). Four insert batches.
_SPOOL_READ_ROWS = 256
# The COPY path calls psycopg itself: an error there may reach us unwrapped by SQLAlchemy.
_DB_ERRORS = (SQLAlchemyError, OSError, psycopg.Error)
# Text COPY. Binary COPY takes 15% more rows a second raw (bench/audit.py's baselines) but did
# nothing for the writer, whose own CPU is the bound (0.9x over four interleaved rounds, within
# their spread), so the simpler format stays.
_COPY_SQL = f"COPY decisions ({', '.join(_COLUMNS)}) FROM STDIN"


def _value(column: str, value: Any) -> Any:
    return orjson.dumps(value).decode() if column in _JSON_COLUMNS else value


def _params(row: dict[str, Any]) -> tuple[Any, ...]:
    """Insert parameters of a row read back from the spool."""
    return tuple(_value(c, row[c]) for c in _COLUMNS)


def _static_params(row: dict[str, Any]) -> tuple[Any, ...]:
    """The parameters every row of one record shares (memoised in its :class:`RowForm`). The
    JSON ones (the candidates: most of them) are the same for every record of one answer, and
    kept once (:func:`gtm.audit.record.shared`)."""
    return tuple(shared(_value(c, row[c])) if c in _JSON_COLUMNS else row[c] for c in _STATIC)


class _Batch:
    """The rows one flush sealed, compact until the database has them: per row its record's
    form, three integers and its hash; spool lines and parameters are built as they are
    written (a window's lines, held from its seal to its append, were the largest thing the
    writer kept: about 1.2 KB a row, thousands of rows a window under a flood)."""

    __slots__ = ("answers", "end", "first_seq", "forms", "hashes", "numbers")

    def __init__(self, first_seq: int, prev_hash: str, answers: int) -> None:
        self.first_seq = first_seq
        self.end = 0  # the spool's logical offset after this batch (Spool.discard_through)
        self.answers = answers  # the chain's answers through this batch's last row
        self.forms: list[RowForm] = []
        self.numbers = array("q")  # count, first_at_us, last_at_us of each row
        self.hashes = [prev_hash]  # row i chains hashes[i] -> hashes[i + 1]

    def __len__(self) -> int:
        return len(self.forms)

    def lines(self, node_json: bytes) -> Iterator[bytes]:
        """The spool line of each row: the row as JSON (its hashed body, as the seal rendered
        it, plus the chain columns), one newline-terminated line each."""
        numbers, hashes, seq = self.numbers, self.hashes, self.first_seq
        for i, form in enumerate(self.forms):
            n, first_us, last_us = numbers[3 * i], numbers[3 * i + 1], numbers[3 * i + 2]
            body = row_body(form, n, first_us, last_us, node_json, seq + i)
            yield b'%s,"prev_hash":"%s","row_hash":"%s"}\n' % (
                body[:-1],
                hashes[i].encode(),
                hashes[i + 1].encode(),
            )

    def params(self, node: str, start: int, stop: int) -> list[tuple[Any, ...]]:
        out = []
        numbers, hashes = self.numbers, self.hashes
        for i in range(start, stop):
            values = (
                node,
                self.first_seq + i,
                numbers[3 * i + 1],
                numbers[3 * i + 2],
                numbers[3 * i],
                hashes[i],
                hashes[i + 1],
                *self.forms[i].columns,
            )
            out.append(values if _PICK is None else _PICK(values))
        return out


class _Window:
    """The tallies of one window merged by record, in order of first appearance: what the
    journal's ticks took so far, and then what the seal takes. The shape a seal needs (records,
    answer counts, first and last answer times), and few containers, so thousands of records do
    not become thousands of objects the garbage collector has to walk."""

    __slots__ = ("counts", "index", "records", "times")

    def __init__(self) -> None:
        self.index: dict[AuditRecord, int] = {}
        self.records: list[AuditRecord] = []
        self.counts = array("q")
        self.times = array("d")

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: AuditRecord, n: int, first: float, last: float) -> int:
        """Merge one tally; returns the record's index in the window."""
        i = self.index.get(record)
        if i is None:
            i = self.index[record] = len(self.records)
            self.records.append(record)
            self.counts.append(n)
            self.times.extend((first, last))
        else:
            self.counts[i] += n
            times = self.times
            if first < times[2 * i]:
                times[2 * i] = first
            if last > times[2 * i + 1]:
                times[2 * i + 1] = last
        return i


class _Slices:
    """The time slices of one flush's work: :meth:`next` hands the loop back to the answering
    paths (and, when paced, rests). A cancellation that arrives meanwhile is remembered, not
    raised, and the rest runs without yielding: tallies once taken must all become rows."""

    __slots__ = ("cancelled", "deadline", "rest", "started", "watch")

    def __init__(self, rest: float) -> None:
        self.cancelled = False
        self.rest = rest
        self.started = time.perf_counter()
        self.deadline = self.started + _SLICE_S
        self.watch: deadline.Watch | None = (
            None  # the database connection's deadline, while one is used
        )

    async def next(self) -> None:
        if not self.cancelled:
            try:
                # Bounded: a slice that took long was waiting (on the database), not working,
                # and resting six times a wait made a writer that hung 92 s rest 9 minutes
                # after the network was back (issue 33).
                worked = time.perf_counter() - self.started
                await asyncio.sleep(min(self.rest * worked, _MAX_REST_S))
            except asyncio.CancelledError:
                self.cancelled = True
        if self.watch is not None:
            self.watch.progress()  # a slice done is progress: the deadline moves on
        self.started = time.perf_counter()
        self.deadline = self.started + _SLICE_S


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
        # A drain whose database connection makes no progress for this long is abandoned and
        # the connection discarded (gtm.audit.deadline); the rows stay spooled for the next.
        self.db_timeout_s = db_timeout_s
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
        self._queued: deque[_Batch] = deque()
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
        self._backgrounded: set[int] = set()  # driver threads already lowered in priority
        self._partitions_due = 0.0  # when the days ahead are next checked (PostgreSQL)
        # The tally journal (gtm.audit.journal): ticks every journal_interval (0: off; a
        # journal a previous run left is still replayed at start). The window being counted
        # and its generation (one journal file per window); ticks and the seal's swap of the
        # window take turns under _tick_lock.
        self.journal_interval = journal_interval
        self.journal = Journal(spool, node)
        self._window = _Window()
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
            self._seq, self._last_hash, self._answers = await self._chain_state_from_db()
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
        before = self.spool.last_written_at()
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
                self.spool.recovered_through = max(before or 0.0, recovered.through)
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
                batch = await self._seal_window(_Slices(self._pace()))
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
                await self._journal_tick(_Slices(min(self.rest, _JOURNAL_REST)))
            except Exception:  # the journal must outlive one bad tick
                log.exception("audit.journal_error")

    async def journal_tick(self) -> bool:
        """Journal now what was counted since the last tick (the background task does this
        every ``journal_interval``); whether a line was written."""
        async with self._tick_lock:
            return await self._tick(_Slices(0.0), final=False)

    async def _journal_tick(self, slices: _Slices) -> None:
        async with self._tick_lock:
            await self._tick(slices, final=False)

    async def _tick(self, slices: _Slices, *, final: bool) -> bool:
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
        # Per decision answered since the last tick: its index in the window and answers, and
        # its first and last answer. Arrays, written out in one call each: this loop runs for
        # every such decision ten times a second, so it is kept to the merge and four appends.
        numbers = array("q")
        spans = array("d")
        index, counts, times = window.index, window.counts, window.times
        clock = time.perf_counter
        for record, n, first, last in self._take():
            if n > 0:
                i = index.get(record)
                if i is None:
                    i = window.add(record, n, first, last)
                else:
                    counts[i] += n
                    if first < times[2 * i]:
                        times[2 * i] = first
                    if last > times[2 * i + 1]:
                        times[2 * i + 1] = last
                numbers.append(i)
                numbers.append(n)
                spans.append(first)
                spans.append(last)
            if clock() > slices.deadline:
                await slices.next()
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
        slices = _Slices(self.rest if paced else 0.0)
        batch = await self._seal_window(slices)
        if slices.cancelled:
            self._backlog = True  # sealed and spooled, not drained: the next drain reads it
            raise asyncio.CancelledError
        return await self._drain_window(batch, slices)

    async def _seal_window(self, slices: _Slices) -> _Batch:
        """The window's tallies as chained rows, appended to the spool (on disk from here on,
        whatever happens to this task)."""
        async with self._lock:
            self.seals += 1
            journaled = self.journal_interval > 0
            async with self._tick_lock:  # a tick in progress finishes first
                if journaled:
                    await self._tick(_Slices(min(slices.rest, _JOURNAL_REST)), final=True)
                window, self._window = self._window, _Window()
                generation = self._generation
                self._generation += 1
            if not journaled:
                await self._gather(self._take(), slices, window)
            batch = await self._seal(window.records, window.counts, window.times, slices)
            if len(batch):
                # The rows and, with the chain's end, the journal generation they seal.
                batch.end = await self._in_io(
                    _append, self.spool, batch, self._node_json, generation
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

    def _queue(self, batch: _Batch) -> None:
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
        self, batch: _Batch | None, slices: _Slices, *, oldest: bool = False
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
            )
            if backlog:
                self._behind = False  # a read of the spool takes every window sealed so far
            # Until this drain succeeds, the spool may hold rows no drain took.
            self._backlog = True
            return await self._drain(None if backlog else batch, slices)

    async def _drain_behind(self, batch: _Batch) -> None:
        """A background drain: this window, then the windows sealed meanwhile, in order."""
        try:
            await self._drain_window(batch, _Slices(self._pace()))
            while (self._queued or self._behind) and not self._stopping and not self._backlog:
                if self._queued:
                    oldest = self._queued.popleft()
                    await self._drain_window(oldest, _Slices(self._pace()), oldest=True)
                else:
                    await self._drain_window(None, _Slices(self._pace()))
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

    async def _gather(self, tallies: Iterator[Tally], slices: _Slices, window: _Window) -> None:
        """The tallies merged by record into ``window`` (identical decisions share a row)."""
        add = window.add
        clock = time.perf_counter
        for record, n, first, last in tallies:
            add(record, n, first, last)
            if clock() > slices.deadline:
                await slices.next()

    async def _seal(
        self, records: list[AuditRecord], counts: array[int], times: array[float], slices: _Slices
    ) -> _Batch:
        """Rows for the gathered tallies, chained."""
        seq, prev = self._seq, self._last_hash
        batch = _Batch(seq + 1, prev, self._answers + sum(counts))
        forms, numbers, hashes = batch.forms, batch.numbers, batch.hashes
        node_json = self._node_json
        channels: dict[str, int] = {}
        clock = time.perf_counter
        for i, record in enumerate(records):
            form = record._form or row_form(record, _static_params)
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

    async def _drain(self, batch: _Batch | None, slices: _Slices) -> int:
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

    async def _drain_part(self, batch: _Batch | None, slices: _Slices) -> tuple[int, bool]:
        """:meth:`_drain` for ``batch``, or for the spool's next rows: rows written, and
        whether the spool may hold more after them."""
        rows: list[dict[str, Any]] = []
        if batch is None:
            rows, end = await self._in_io(self.spool.pending_through, _SPOOL_READ_ROWS)
        else:
            end = batch.end
        more = batch is None and len(rows) >= _SPOOL_READ_ROWS
        total = len(rows) if batch is None else len(batch)
        if not total:
            # Nothing in the spool, nor sealed: the next flush need not read the spool back.
            # (Leaving the flag set made the flush after every quiet interval replay the whole
            # spool, parsing each row back from JSON, on the answering path's core.)
            self._backlog = False
            metrics.AUDIT_SPOOLED_ROWS.set(0)
            return 0, False
        written = 0
        await self._ensure_partitions()
        try:
            async with (
                self.engine.connect() as conn,
                deadline.watched(conn, self.db_timeout_s) as watch,
            ):
                slices.watch = watch
                await self._driver_in_background(conn)
                # Replays after a crash may repeat rows the database already committed.
                have = await conn.scalar(
                    select(func.coalesce(func.max(decisions.c.node_seq), 0)).where(
                        decisions.c.node == self.node
                    )
                )
                await conn.commit()
                have = int(have or 0)
                self._db_seq = max(have, self._db_seq or 0)
                watch.progress()
                sql = _insert_sql(conn.dialect.paramstyle)
                if batch is not None and conn.dialect.name == "postgresql":
                    start = min(total, max(0, have - batch.first_seq + 1))
                    written = await self._copy(
                        conn,
                        (
                            batch.params(self.node, i, min(total, i + _INSERT_BATCH))
                            for i in range(start, total, _INSERT_BATCH)
                        ),
                        slices,
                    )
                elif conn.dialect.name == "postgresql":
                    # The spool's rows (a replay, or windows sealed while a drain ran) in one
                    # COPY too: INSERT batches here made a writer that fell behind slower still.
                    written = await self._copy(
                        conn,
                        (
                            [
                                _params(r)
                                for r in rows[i : i + _INSERT_BATCH]
                                if r["node_seq"] > have
                            ]
                            for i in range(0, total, _INSERT_BATCH)
                        ),
                        slices,
                    )
                elif batch is not None:
                    start = min(total, max(0, have - batch.first_seq + 1))
                    for i in range(start, total, _INSERT_BATCH):
                        stop = min(total, i + _INSERT_BATCH)
                        await conn.exec_driver_sql(sql, batch.params(self.node, i, stop))
                        await conn.commit()
                        written += stop - i
                        await slices.next()
                else:
                    # A batch at a time, between rests, like the sealed rows: a replay after an
                    # outage may hold many thousands. Rows the database has are skipped.
                    for i in range(0, total, _INSERT_BATCH):
                        part = [
                            _params(r) for r in rows[i : i + _INSERT_BATCH] if r["node_seq"] > have
                        ]
                        if part:
                            await conn.exec_driver_sql(sql, part)
                            await conn.commit()
                            written += len(part)
                        await slices.next()
        except _DB_ERRORS as exc:
            self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            metrics.AUDIT_FLUSH_FAILURES.inc()
            metrics.AUDIT_ROWS_WRITTEN.inc(written)
            log.warning("audit.flush_failed", spooled=self._spooled(), error=self.last_error)
            deadline.release(exc)
            await self._watch_spool()
            return 0, False
        finally:
            slices.watch = None
        await self._in_io(self.spool.discard_through, end)
        while self._queued and self._queued[0].end <= end:
            self._queued.popleft()  # read back from the spool with the rest, and committed
        last = rows[-1]["node_seq"] if batch is None else batch.first_seq + len(batch) - 1
        self._db_seq = max(self._db_seq or 0, int(last))
        self._backlog = False
        self.last_error = None
        metrics.AUDIT_ROWS_WRITTEN.inc(written)
        await self._watch_spool()
        return written, more

    def _spooled(self) -> int:
        """Rows sealed (in the spool) that the database is not known to hold yet."""
        return max(0, self._seq - (self._db_seq or 0)) if self._db_seq is not None else 0

    async def _copy(
        self, conn: AsyncConnection, chunks: Iterator[list[tuple[Any, ...]]], slices: _Slices
    ) -> int:
        """PostgreSQL: rows in one COPY, one transaction (several times the rows per second of
        INSERT batches, and all of a flush or none of it). Rows are written a chunk of a few
        dozen at a time between slices of the loop, like every other part of a flush."""
        raw = await conn.get_raw_connection()
        pg = raw.driver_connection
        assert pg is not None
        written = 0
        try:
            async with pg.cursor() as cursor, cursor.copy(_COPY_SQL) as copy:
                for chunk in chunks:
                    for row in chunk:
                        await copy.write_row(row)
                    written += len(chunk)
                    await slices.next()
            await pg.commit()
        except BaseException:
            await pg.rollback()
            raise
        return written

    async def _ensure_partitions(self) -> None:
        """PostgreSQL: the days ahead have their partitions (:mod:`gtm.audit.partitions`),
        checked at the first drain and about hourly after. Rows of a day without one go to the
        default partition, so a failure here costs a warning and a retry, never a row."""
        now = self._clock()
        if now < self._partitions_due or self.engine.dialect.name != "postgresql":
            return
        self._partitions_due = now + _PARTITIONS_EVERY_S
        try:
            async with (
                self.engine.connect() as conn,
                deadline.watched(conn, self.db_timeout_s),
            ):
                made = await partitions.ensure(conn, now)
        except _DB_ERRORS as exc:
            self._partitions_due = now + _PARTITIONS_RETRY_S
            log.warning("audit.partitions_not_made", error=str(exc).splitlines()[0])
            return
        if made:
            log.info("audit.partitions_made", days=made)

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

    async def _driver_in_background(self, conn: AsyncConnection) -> None:
        """Lower the priority of the driver's own thread, if it has one (aiosqlite runs each
        connection in a thread; psycopg's async connections run on the loop and have none)."""
        raw = await conn.get_raw_connection()
        thread = getattr(raw.driver_connection, "_thread", None)
        tid = getattr(thread, "native_id", None)
        if isinstance(tid, int) and tid not in self._backgrounded:
            self._backgrounded.add(tid)
            _set_nice(tid)

    async def _chain_state_from_db(self) -> ChainHead:
        try:
            async with self.engine.connect() as conn:
                row = (
                    await conn.execute(
                        select(decisions.c.node_seq, decisions.c.row_hash)
                        .where(decisions.c.node == self.node)
                        .order_by(decisions.c.node_seq.desc())
                        .limit(1)
                    )
                ).first()
                answers = await conn.scalar(
                    select(func.coalesce(func.sum(decisions.c.count), 0)).where(
                        decisions.c.node == self.node
                    )
                )
        except (SQLAlchemyError, OSError) as exc:
            # No local state and no database: start a chain; verification will show the gap if
            # this node name had rows before.
            log.warning("audit.chain_state_unavailable", error=str(exc).splitlines()[0])
            return ChainHead(0, GENESIS, 0)
        if row is None:
            return ChainHead(0, GENESIS, 0)
        return ChainHead(row.node_seq, row.row_hash, int(answers or 0))


def _append(spool: Spool, batch: _Batch, node_json: bytes, journal: int) -> int:
    """Append a batch's lines to the spool (the rows as :meth:`Spool.append` would write
    them, rendered as they are written) and the journal generation they seal; where they end."""
    return spool.append_lines(
        batch.lines(node_json),
        batch.first_seq + len(batch) - 1,
        batch.hashes[-1],
        batch.answers,
        journal=journal,
    )


def _set_nice(tid: int) -> None:
    # Linux: the nice value is per thread, and any thread may lower its own or a sibling's
    # priority. Elsewhere, or without permission, nothing changes.
    with contextlib.suppress(AttributeError, OSError):
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + _BACKGROUND_NICE))


def run_in_background() -> None:
    """Lower the calling thread's CPU priority (background audit work beside the loop)."""
    _set_nice(threading.get_native_id())
