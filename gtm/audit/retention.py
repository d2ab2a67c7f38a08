"""Retention: the one way rows leave the audit store, and it leaves a signed record.

``gtm audit retain --before T`` removes, per decision chain, the oldest rows up to the last one
whose whole window ended before ``T`` (a prefix: a chain never loses a row from its middle).
Before any row goes, a ``cut`` checkpoint (chain, the last sequence removed, its hash, the
answers counted through it) is signed and written to the sink outside the database and to
``audit_checkpoints``; verification then starts each chain from its newest cut, so rows removed
on purpose are told apart from rows removed by anyone else (a gap after the cut is still a
break).

Then the rows go. On PostgreSQL the decisions table is partitioned by day
(:mod:`gtm.audit.partitions`): every partition that ended by ``T`` and holds only rows of the
cut prefixes is dropped whole, which costs the same however many rows it holds and leaves no
dead rows to vacuum; what is left of the prefixes (rows of the day ``T`` falls in, or a
partition that also holds rows a chain keeps) is deleted row by row with ``gtm.retention`` set,
the one case the evidence tables' triggers let through. Both need the tables' owner (nodes own
nothing and have no DELETE). With ``T`` at midnight UTC nothing is deleted row by row. On
SQLite the prefixes are deleted.

A run that stops after its cuts are recorded and before the rows are gone is finished by the
next: rows at or before a chain's newest cut are removed whatever ``T`` says, and a cut is only
signed for rows past the previous one, so answers are never counted twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog
from sqlalchemy import delete, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import partitions
from gtm.audit.anchor import insert_checkpoint
from gtm.audit.checkpoints import Checkpoint, CheckpointSink, sign
from gtm.audit.keys import ChainKey
from gtm.audit.query import distinct
from gtm.audit.schema import decisions
from gtm.audit.verify import read_checkpoints

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Cut:
    chain: str
    seq: int  # the last sequence removed
    rows: int  # rows the cut newly covers
    answers: int  # the answers they counted


@dataclass
class Retained:
    cuts: list[Cut] = field(default_factory=list)  # signed by this run
    dropped: list[str] = field(default_factory=list)  # partitions dropped whole (PostgreSQL)
    deleted: int = 0  # rows deleted one by one


def _newest_cuts(sink: CheckpointSink, store: str) -> dict[str, tuple[int, int]]:
    """Each chain's newest cut (sequence, answers through it), from the sink's trusted
    checkpoints (the database's copy could be edited, and the next cut would then count
    wrongly)."""
    newest: dict[str, tuple[int, int]] = {}
    for signed, _ in read_checkpoints(sink, store)[0]:
        cp = signed.checkpoint
        if cp.kind == "cut" and cp.seq > newest.get(cp.chain, (-1, 0))[0]:
            newest[cp.chain] = (cp.seq, cp.answers)
    return newest


async def _cut(
    engine: AsyncEngine,
    chain: str,
    before_us: int,
    previous: tuple[int, int],
    key: ChainKey,
    sink: CheckpointSink,
    store: str,
    now: float,
) -> Cut | None:
    """Sign and record the chain's cut at ``before_us``, if it moves past ``previous``."""
    prev_seq, prev_answers = previous
    async with engine.connect() as conn:
        first_kept = await conn.scalar(
            select(func.min(decisions.c.node_seq)).where(
                decisions.c.node == chain, decisions.c.last_at_us >= before_us
            )
        )
        query = select(func.max(decisions.c.node_seq)).where(decisions.c.node == chain)
        if first_kept is not None:
            query = query.where(decisions.c.node_seq < first_kept)
        last_removed = await conn.scalar(query)
        if last_removed is None or last_removed <= prev_seq:
            return None
        head = await conn.scalar(
            select(decisions.c.row_hash).where(
                decisions.c.node == chain, decisions.c.node_seq == last_removed
            )
        )
        counted = await conn.execute(
            select(func.count(), func.coalesce(func.sum(decisions.c.count), 0)).where(
                decisions.c.node == chain,
                decisions.c.node_seq > prev_seq,
                decisions.c.node_seq <= last_removed,
            )
        )
        rows, answers = counted.one()
    checkpoint = Checkpoint(
        "cut",
        chain,
        int(last_removed),
        str(head),
        prev_answers + int(answers),
        now,
        store,
        key.id,
        f"retention: rows through {last_removed} removed (before {before_us / 1e6:.0f})",
    )
    signed = sign(checkpoint, key)
    await asyncio.to_thread(sink.append, signed)  # outside the database first
    async with engine.begin() as conn:
        await insert_checkpoint(conn, signed)
    return Cut(chain, int(last_removed), int(rows), int(answers))


async def _drop_partitions(
    engine: AsyncEngine, before_us: int, through: dict[str, int]
) -> list[str]:
    """PostgreSQL: drop every partition that ended by ``before_us`` and holds only rows of the
    removed prefixes. A partition whose lock does not come in time stays; its rows are deleted
    with the rest."""
    dropped = []
    async with engine.connect() as conn:
        candidates = [
            p for p in await partitions.partitions(conn)
            if p.hi_us is not None and p.hi_us <= before_us
        ]  # fmt: skip
    for part in candidates:
        try:
            async with engine.begin() as conn:
                if await partitions.drop_if_covered(conn, part.name, through):
                    dropped.append(part.name)
        except DBAPIError as exc:
            log.warning("audit.partition_not_dropped", partition=part.name,
                        error=str(exc.orig).splitlines()[0])  # fmt: skip
    return dropped


async def retain(
    engine: AsyncEngine,
    before_us: int,
    *,
    key: ChainKey,
    sink: CheckpointSink,
    store: str,
    clock: float | None = None,
) -> Retained:
    now = time.time() if clock is None else clock
    await asyncio.to_thread(sink.publish_key, key)
    previous = await asyncio.to_thread(_newest_cuts, sink, store)
    async with engine.connect() as conn:
        chains = await distinct(conn, decisions.c.node)
    out = Retained()
    # Every cut is signed and recorded before any row goes: a partition holds rows of many
    # chains, and is dropped only when all of them are covered.
    through: dict[str, int] = {}
    for chain in chains:
        cut = await _cut(
            engine, chain, before_us, previous.get(chain, (0, 0)), key, sink, store, now
        )
        if cut is not None:
            out.cuts.append(cut)
        seq = cut.seq if cut is not None else previous.get(chain, (0, 0))[0]
        if seq > 0:
            through[chain] = seq
    async with engine.connect() as conn:
        if partitions.partitioned(conn):
            out.dropped = await _drop_partitions(engine, before_us, through)
    for chain, seq in through.items():
        async with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                await conn.execute(text("SET LOCAL gtm.retention = 'on'"))
            result = await conn.execute(
                delete(decisions).where(decisions.c.node == chain, decisions.c.node_seq <= seq)
            )
            out.deleted += max(0, result.rowcount or 0)
    return out


__all__ = ["Cut", "Retained", "retain"]
