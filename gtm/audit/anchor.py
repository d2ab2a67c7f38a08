"""Anchoring: this node's chains, checkpointed and signed, in the database and outside it.

Threat model: the database is untrusted storage (whoever holds its password can read, write and
delete every row, but holds no key file and cannot rewrite the checkpoint sink). So the anchor
never signs what the database says: beside the writer (:mod:`gtm.audit.writer`) it signs a
checkpoint (:mod:`gtm.audit.checkpoints`) of the node's decision chain as the writer holds it in
memory, and of the fleet's event chain at the newest head this process itself wrote (and
committed: :func:`gtm.audit.event_chain.written_head`), never the head the ``event_chain`` row
shows, which anyone with the password can move. Checkpoints are written when the anchor starts
(``open``), on a schedule when a chain moved (and about once a minute when it did not), and at
shutdown, after the writer's last flush. Each goes to the sink outside the database first and
then to ``audit_checkpoints``; the sink is what verification trusts, the table is a convenience
copy.

The anchor's key also signs this process's region events (``start`` registers it with
:func:`gtm.audit.event_chain.use_key`, ``stop`` withdraws it): events are signed by the key
whose anchor checkpoints them, so each event row is attributable to a writer, and each writer
vouches only for heads it wrote.

A start after an unclean stop (the running marker a clean stop removes is still there) first
signs a ``gap``: answers counted after the chain's last flush and before this start were lost,
and ``gtm audit verify`` and the compliance report say so instead of showing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable

import structlog
from sqlalchemy import insert, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm import metrics
from gtm.audit import deadline
from gtm.audit import event_chain as keyed_events
from gtm.audit.checkpoints import EVENTS_CHAIN, Checkpoint, Kind, Signed, Sink, sign
from gtm.audit.schema import audit_checkpoints, audit_store
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.cancelling import cancel_within

log = structlog.get_logger(__name__)


async def read_store_id(engine: AsyncEngine, *, deadline_s: float = 10.0) -> str | None:
    """The audit store's id (made by the migration), or None when the database is away or
    gives no answer within ``deadline_s`` (gtm.audit.deadline)."""
    try:
        async with engine.connect() as conn, deadline.watched(conn, deadline_s):
            value = await conn.scalar(select(audit_store.c.id).limit(1))
    except (SQLAlchemyError, OSError) as exc:
        log.warning("audit.store_id_unavailable", error=str(exc).splitlines()[0])
        return None
    return None if value is None else str(value)


async def insert_checkpoint(conn: AsyncConnection, signed: Signed) -> None:
    """The database's copy of a checkpoint (the sink's is the one verification trusts)."""
    cp = signed.checkpoint
    await conn.execute(
        insert(audit_checkpoints),
        {
            "chain": cp.chain,
            "kind": cp.kind,
            "seq": cp.seq,
            "head": cp.head,
            "answers": cp.answers,
            "at_us": round(cp.at * 1e6),
            "store": cp.store,
            "key_id": cp.key,
            "detail": cp.detail,
            "signature": signed.signature,
        },
    )


class Anchor:
    def __init__(
        self,
        engine: AsyncEngine,
        writer: AuditWriter,
        spool: Spool,
        sink: Sink,
        *,
        interval_s: float = 10.0,
        db_deadline_s: float = 10.0,
        events: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.writer = writer
        self.spool = spool
        self.sink = sink
        self.key = spool.key
        self.interval_s = interval_s
        # A checkpoint's database copy gets no answer within this: given up (the sink has
        # it). Without it, a route gone silent held the anchor, and the node's stop, for good.
        self.db_deadline_s = db_deadline_s
        self.events = events  # also sign this process's events and checkpoint their heads
        self.clock = clock
        self._last: dict[str, tuple[int, str, float]] = {}  # chain -> (seq, head, at) signed
        # A chain that did not move is signed again this often: a verifier tells an idle node
        # from one whose checkpoints stopped (gtm_audit_verified_through_seconds keeps moving).
        self.heartbeat_s = 6 * interval_s
        self._task: asyncio.Task[None] | None = None
        self.unclean_start = False

    async def start(self) -> None:
        """Publish the key, record a gap if the last run stopped uncleanly, open the chain."""
        await asyncio.to_thread(self.sink.publish_key, self.key)
        if self.events:
            # Published first: a verifier must know the key before any event it signed exists.
            keyed_events.use_key(self.key)
        if self.spool.running_path.exists():
            self.unclean_start = True
            metrics.AUDIT_UNCLEAN_STOPS.inc()
            last = self.spool.last_written_at()
            since = "its first flush" if last is None else f"{last:.3f} (its last flush)"
            await self.checkpoint(
                "gap",
                force=True,
                detail=f"unclean stop: answers counted after {since} and before "
                f"{self.clock():.3f} (this start) were lost",
            )
        fd = os.open(self.spool.running_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        await self.checkpoint("open", force=True)
        self._task = asyncio.create_task(self._run(), name="audit-anchor")

    async def stop(self) -> None:
        """The last checkpoint, after the writer's last flush; then the clean-stop mark."""
        if self._task is not None:
            await cancel_within(self._task)  # bounded: see gtm.cancelling
            self._task = None
        await self.checkpoint("checkpoint")
        if self.events:
            # Nothing checkpoints what this key would sign from now on.
            keyed_events.drop_key(self.key)
        with contextlib.suppress(FileNotFoundError):
            self.spool.running_path.unlink()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.checkpoint("checkpoint")
            except Exception:  # the anchor must outlive one bad round (a full disk, say)
                log.exception("audit.checkpoint_error")

    async def checkpoint(self, kind: Kind, *, force: bool = False, detail: str = "") -> int:
        """Sign and write checkpoints of the chains that moved (all of them when ``force``);
        returns how many were written to the sink."""
        store = self.spool.bound_store()
        if store is None:
            # The database was away at start: bind as soon as it answers, so checkpoints name
            # the store they vouch for.
            store = await read_store_id(self.engine, deadline_s=self.db_deadline_s)
            if store is not None:
                self.spool.bind(store)
        now = self.clock()
        head = self.writer.head()
        heads = [(self.writer.node, head.seq, head.hash, head.answers, force)]
        if self.events and kind != "gap":  # a gap is this node's own chain's
            # Only heads this process wrote: none until it appends an event. Heads of its own
            # that the chain lost since (events removed, the head moved back) first, each signed
            # whatever the schedule: they are what contradicts the removal.
            for seq, digest in keyed_events.take_displaced(self.key.id):
                heads.append((EVENTS_CHAIN, seq, digest, 0, True))
            events_head = keyed_events.written_head(self.key.id)
            if events_head is not None:
                heads.append((EVENTS_CHAIN, events_head[0], events_head[1], 0, force))
        written = 0
        for chain, seq, digest, answers, forced in heads:
            last = self._last.get(chain)
            if (
                not forced
                and last is not None
                and last[:2] == (seq, digest)  # the chain did not move
                and now - last[2] < self.heartbeat_s
            ):
                continue
            signed = sign(
                Checkpoint(
                    kind, chain, seq, digest, answers, now, store or "unbound", self.key.id, detail
                ),
                self.key,
            )
            if await self._write(signed):
                written += 1
                self._last[chain] = (seq, digest, now)
        return written

    async def _write(self, signed: Signed) -> bool:
        cp = signed.checkpoint
        try:
            await asyncio.to_thread(self.sink.append, signed)
        except OSError as exc:
            metrics.AUDIT_CHECKPOINT_FAILURES.labels("sink").inc()
            log.error("audit.checkpoint_sink_failed", chain=cp.chain, seq=cp.seq, error=str(exc))
            return False
        metrics.AUDIT_CHECKPOINTS.labels(cp.kind, "sink").inc()
        metrics.AUDIT_LAST_CHECKPOINT.set(cp.at)
        try:
            async with (
                self.engine.connect() as conn,
                deadline.watched(conn, self.db_deadline_s),
            ):
                await insert_checkpoint(conn, signed)
                await conn.commit()
            metrics.AUDIT_CHECKPOINTS.labels(cp.kind, "database").inc()
        except (SQLAlchemyError, OSError) as exc:
            # The sink has it; the database copy is a convenience.
            metrics.AUDIT_CHECKPOINT_FAILURES.labels("database").inc()
            log.warning(
                "audit.checkpoint_db_failed", chain=cp.chain, error=str(exc).splitlines()[0]
            )
        return True


__all__ = ["Anchor", "insert_checkpoint", "read_store_id"]
