"""The writer's side of the database: sealed rows in, the chain's end out.

Everything here opens its own connection under a deadline (:mod:`gtm.audit.deadline`): a
database that stops answering costs the drain its connection, never the rows, which stay in the
spool for the next drain. Rows are written in batches of about a millisecond of work each,
between slices of the loop (:class:`gtm.audit.pacing.Slices`): INSERT batches on SQLite, one
COPY on PostgreSQL. The writer (:mod:`gtm.audit.writer`) decides what to drain and when; this
module only knows how.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.audit import deadline, partitions
from gtm.audit.pacing import Slices, set_nice
from gtm.audit.record import GENESIS
from gtm.audit.rows import COPY_SQL, Batch, insert_sql, spooled_params
from gtm.audit.schema import decisions
from gtm.audit.spool import ChainHead

log = structlog.get_logger(__name__)

INSERT_BATCH = 64  # about a millisecond of SQLite work per statement
_PARTITIONS_EVERY_S = 3600.0  # how often the days ahead are checked for partitions
_PARTITIONS_RETRY_S = 60.0
# The COPY path calls psycopg itself: an error there may reach us unwrapped by SQLAlchemy.
DB_ERRORS = (SQLAlchemyError, OSError, psycopg.Error)


@dataclass(slots=True)
class Written:
    """What one drain part did: rows committed, the node's newest sequence the database held
    before it (None: not read), and the error that ended it (None: every row went in)."""

    rows: int = 0
    had: int | None = None
    error: BaseException | None = None


class Database:
    """One node's rows into the decisions table."""

    def __init__(
        self, engine: AsyncEngine, node: str, *, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.engine = engine
        self.node = node
        # A drain whose connection makes no progress for this long is abandoned and the
        # connection discarded; the rows stay spooled for the next.
        self.timeout_s = timeout_s
        self._clock = clock
        self._backgrounded: set[int] = set()  # driver threads already lowered in priority
        self._partitions_due = 0.0  # when the days ahead are next checked (PostgreSQL)

    async def write(
        self, batch: Batch | None, rows: list[dict[str, Any]], slices: Slices
    ) -> Written:
        """Insert ``batch`` (sealed rows kept in memory) or, when it is None, ``rows`` (read
        back from the spool), skipping what the database already holds: replays after a crash
        may repeat rows it committed. One transaction per insert batch (or one COPY), so a
        paced drain holds no write lock while it rests."""
        done = Written()
        await self._ensure_partitions()
        total = len(rows) if batch is None else len(batch)
        try:
            async with (
                self.engine.connect() as conn,
                deadline.watched(conn, self.timeout_s) as watch,
            ):
                slices.watch = watch
                await self._driver_in_background(conn)
                have = await conn.scalar(
                    select(func.coalesce(func.max(decisions.c.node_seq), 0)).where(
                        decisions.c.node == self.node
                    )
                )
                await conn.commit()
                have = done.had = int(have or 0)
                watch.progress()
                postgres = conn.dialect.name == "postgresql"
                if batch is not None:
                    start = min(total, max(0, have - batch.first_seq + 1))
                    chunks: Iterator[list[tuple[Any, ...]]] = (
                        batch.params(self.node, i, min(total, i + INSERT_BATCH))
                        for i in range(start, total, INSERT_BATCH)
                    )
                else:
                    # The spool's rows (a replay, or windows sealed while a drain ran), a batch
                    # at a time between rests like the sealed rows: a replay after an outage
                    # may hold many thousands.
                    chunks = (
                        [
                            spooled_params(r)
                            for r in rows[i : i + INSERT_BATCH]
                            if r["node_seq"] > have
                        ]
                        for i in range(0, total, INSERT_BATCH)
                    )
                if postgres:
                    # One COPY for both: INSERT batches of the spool's rows made a writer that
                    # fell behind slower still.
                    await self._copy(conn, chunks, slices, done)
                else:
                    sql = insert_sql(conn.dialect.paramstyle)
                    for chunk in chunks:
                        if chunk:
                            await conn.exec_driver_sql(sql, chunk)
                            await conn.commit()
                            done.rows += len(chunk)
                        await slices.next()
        except DB_ERRORS as exc:
            done.error = exc
            deadline.release(exc)
        finally:
            slices.watch = None
        return done

    async def _copy(
        self,
        conn: AsyncConnection,
        chunks: Iterator[list[tuple[Any, ...]]],
        slices: Slices,
        done: Written,
    ) -> None:
        """PostgreSQL: rows in one COPY, one transaction (several times the rows per second of
        INSERT batches, and all of a flush or none of it). Rows are written a chunk of a few
        dozen at a time between slices of the loop, like every other part of a flush.
        ``done.rows`` counts them only once committed."""
        raw = await conn.get_raw_connection()
        pg = raw.driver_connection
        assert pg is not None
        copied = 0
        try:
            async with pg.cursor() as cursor, cursor.copy(COPY_SQL) as copy:
                for chunk in chunks:
                    for row in chunk:
                        await copy.write_row(row)
                    copied += len(chunk)
                    await slices.next()
            await pg.commit()
        except BaseException:
            await pg.rollback()
            raise
        done.rows += copied

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
                deadline.watched(conn, self.timeout_s),
            ):
                made = await partitions.ensure(conn, now)
        except DB_ERRORS as exc:
            self._partitions_due = now + _PARTITIONS_RETRY_S
            log.warning("audit.partitions_not_made", error=str(exc).splitlines()[0])
            return
        if made:
            log.info("audit.partitions_made", days=made)

    async def _driver_in_background(self, conn: AsyncConnection) -> None:
        """Lower the priority of the driver's own thread, if it has one (aiosqlite runs each
        connection in a thread; psycopg's async connections run on the loop and have none)."""
        raw = await conn.get_raw_connection()
        thread = getattr(raw.driver_connection, "_thread", None)
        tid = getattr(thread, "native_id", None)
        if isinstance(tid, int) and tid not in self._backgrounded:
            self._backgrounded.add(tid)
            set_nice(tid)

    async def chain_head(self) -> ChainHead:
        """The end of this node's chain as the database holds it (the start when it holds
        none, or cannot be read)."""
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
