"""The batched audit writer: counts on the answering path, writes beside it.

``count()`` is all an answering path calls: a dictionary increment, no I/O, no await. A
background task flushes on an interval, or sooner when many distinct decisions are pending:
identical decisions of the window become one row with a count, rows are chained, appended to
the local spool, and then drained from the spool into the database (see :mod:`gtm.audit.spool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from prometheus_client import Counter
from sqlalchemy import JSON, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm import metrics
from gtm.audit.record import GENESIS, AuditRecord, chain, row_of
from gtm.audit.schema import decisions
from gtm.audit.spool import Spool

log = structlog.get_logger(__name__)

_INSERT_BATCH = 200  # short GIL holds in the driver: the loop keeps answering
_COLUMNS = [str(c.name) for c in decisions.c if c.name != "id"]
_JSON_COLUMNS = frozenset(str(c.name) for c in decisions.c if isinstance(c.type, JSON))


def _insert_sql(paramstyle: str) -> str:
    # Straight to the driver's executemany: SQLAlchemy's per-row parameter processing cost
    # more than the insert itself at thousands of rows per flush.
    mark = "?" if paramstyle == "qmark" else "%s"
    return (
        f"INSERT INTO decisions ({', '.join(_COLUMNS)}) "
        f"VALUES ({', '.join([mark] * len(_COLUMNS))})"
    )


def _params(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(orjson.dumps(row[c]).decode() if c in _JSON_COLUMNS else row[c] for c in _COLUMNS)


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
    ) -> None:
        self.engine = engine
        self.node = node
        self.spool = spool
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self._clock = clock
        # record -> [count, first_at_us, last_at_us]
        self._pending: dict[AuditRecord, list[int]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._seq, self._last_hash = spool.chain_state() or (0, GENESIS)
        self.counted = 0  # answers counted since start (rule 2 bookkeeping)
        self._counters: dict[str, Counter] = {}  # labelled children, looked up once
        # Whether the spool may hold rows from before this run or from failed flushes; the
        # first flush after start always reads it.
        self._backlog = True
        self.last_error: str | None = None

    # -- the answering path --------------------------------------------------------------------

    def count(self, record: AuditRecord, n: int = 1) -> None:
        """Count ``n`` answers of ``record``. Never blocks, never raises on I/O."""
        now_us = int(self._clock() * 1_000_000)
        entry = self._pending.get(record)
        if entry is None:
            self._pending[record] = [n, now_us, now_us]
            if len(self._pending) >= self.max_pending:
                self._wake.set()
        else:
            entry[0] += n
            entry[2] = now_us
        self.counted += n
        counter = self._counters.get(record.channel)
        if counter is None:
            counter = self._counters[record.channel] = metrics.DECISIONS_COUNTED.labels(
                record.channel
            )
        counter.inc(n)

    # -- beside it -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Continue this node's chain and replay anything a previous run left in the spool."""
        if self._seq == 0:
            self._seq, self._last_hash = await self._chain_state_from_db()
        await self.flush()
        self._task = asyncio.create_task(self._run(), name="audit-writer")

    async def stop(self) -> None:
        """Final flush. Whatever the database cannot take stays spooled for the next start."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.flush_interval)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> int:
        """Turn pending counts into rows and drain the spool; returns rows committed."""
        async with self._lock:
            pending, self._pending = self._pending, {}
            # Building, hashing and spooling rows is thousands of Python operations per flush:
            # done in a thread, the answering paths sharing this loop are not held up by it.
            rows = await asyncio.to_thread(self._seal, pending)
            # With no backlog the spool holds exactly these rows: no need to read them back.
            backlog, self._backlog = self._backlog, True
            return await self._drain(None if backlog else rows)

    def _seal(self, pending: dict[AuditRecord, list[int]]) -> list[dict[str, Any]]:
        """Rows for the pending counts, chained and appended to the spool (fsynced)."""
        rows: list[dict[str, Any]] = []
        for record, (n, first, last) in pending.items():
            self._seq += 1
            rows.append(
                row_of(
                    record,
                    node=self.node,
                    node_seq=self._seq,
                    first_at_us=first,
                    last_at_us=last,
                    count=n,
                )
            )
        self._last_hash = chain(rows, self._last_hash)
        self.spool.append(rows)
        return rows

    async def _drain(self, in_memory: list[dict[str, Any]] | None) -> int:
        rows = in_memory if in_memory is not None else await asyncio.to_thread(self.spool.pending)
        if not rows:
            metrics.AUDIT_SPOOLED_ROWS.set(0)
            return 0
        try:
            async with self.engine.begin() as conn:
                # Replays after a crash may repeat rows the database already committed.
                have = await conn.scalar(
                    select(func.coalesce(func.max(decisions.c.node_seq), 0)).where(
                        decisions.c.node == self.node
                    )
                )
                fresh = [r for r in rows if r["node_seq"] > (have or 0)]
                sql = _insert_sql(conn.dialect.paramstyle)
                for i in range(0, len(fresh), _INSERT_BATCH):
                    await conn.exec_driver_sql(
                        sql, [_params(r) for r in fresh[i : i + _INSERT_BATCH]]
                    )
        except (SQLAlchemyError, OSError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            metrics.AUDIT_FLUSH_FAILURES.inc()
            metrics.AUDIT_SPOOLED_ROWS.set(len(rows))
            log.warning("audit.flush_failed", spooled=len(rows), error=self.last_error)
            return 0
        await asyncio.to_thread(self.spool.clear)
        self._backlog = False
        self.last_error = None
        metrics.AUDIT_SPOOLED_ROWS.set(0)
        metrics.AUDIT_ROWS_WRITTEN.inc(len(fresh))
        return len(fresh)

    async def _chain_state_from_db(self) -> tuple[int, str]:
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
        except (SQLAlchemyError, OSError) as exc:
            # No local state and no database: start a chain; verification will show the gap if
            # this node name had rows before.
            log.warning("audit.chain_state_unavailable", error=str(exc).splitlines()[0])
            return 0, GENESIS
        return (row.node_seq, row.row_hash) if row is not None else (0, GENESIS)
