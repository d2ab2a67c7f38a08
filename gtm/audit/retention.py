"""Retention: the one way rows leave the audit store, and it leaves a signed record.

``gtm audit retain --before T`` removes, per decision chain, the oldest rows up to the last one
whose whole window ended before ``T`` (a prefix: a chain never loses a row from its middle).
Before any row is deleted, a ``cut`` checkpoint (chain, the last sequence removed, its hash, the
answers counted through it) is signed and written to the sink outside the database and to
``audit_checkpoints``; verification then starts each chain from its newest cut, so rows removed
on purpose are told apart from rows removed by anyone else (a gap after the cut is still a
break). On PostgreSQL the delete runs with ``gtm.retention`` set, the one case the evidence
tables' triggers let through, and needs a role with DELETE (the owner's: nodes have none).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sqlalchemy import delete, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import insert_checkpoint
from gtm.audit.checkpoints import Checkpoint, DirectorySink, sign
from gtm.audit.keys import ChainKey
from gtm.audit.schema import decisions
from gtm.audit.verify import read_checkpoints


@dataclass(frozen=True, slots=True)
class Cut:
    chain: str
    seq: int
    rows: int
    answers: int


def _cut_answers(sink: DirectorySink, store: str) -> dict[str, int]:
    """Answers through each chain's newest cut, from the sink's trusted checkpoints (the
    database's copy could be edited, and the next cut would then count wrongly)."""
    newest: dict[str, tuple[int, int]] = {}
    for signed, _ in read_checkpoints(sink, store)[0]:
        cp = signed.checkpoint
        if cp.kind == "cut" and cp.seq > newest.get(cp.chain, (-1, 0))[0]:
            newest[cp.chain] = (cp.seq, cp.answers)
    return {chain: answers for chain, (_, answers) in newest.items()}


async def retain(
    engine: AsyncEngine,
    before_us: int,
    *,
    key: ChainKey,
    sink: DirectorySink,
    store: str,
    clock: float | None = None,
) -> list[Cut]:
    now = time.time() if clock is None else clock
    await asyncio.to_thread(sink.publish_key, key)
    cut_answers = await asyncio.to_thread(_cut_answers, sink, store)
    async with engine.connect() as conn:
        chains = [r[0] for r in await conn.execute(select(decisions.c.node).distinct())]
    cuts = []
    for chain in sorted(chains):
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
            if last_removed is None:
                continue
            head = await conn.scalar(
                select(decisions.c.row_hash).where(
                    decisions.c.node == chain, decisions.c.node_seq == last_removed
                )
            )
            counted = await conn.execute(
                select(func.count(), func.coalesce(func.sum(decisions.c.count), 0)).where(
                    decisions.c.node == chain, decisions.c.node_seq <= last_removed
                )
            )
            rows, answers = counted.one()
        before = cut_answers.get(chain, 0)
        checkpoint = Checkpoint(
            "cut",
            chain,
            int(last_removed),
            str(head),
            before + int(answers),
            now,
            store,
            key.id,
            f"retention: rows through {last_removed} removed (before {before_us / 1e6:.0f})",
        )
        signed = sign(checkpoint, key)
        await asyncio.to_thread(sink.append, signed)  # outside the database first
        async with engine.begin() as conn:
            await insert_checkpoint(conn, signed)
            if conn.dialect.name == "postgresql":
                await conn.execute(text("SET LOCAL gtm.retention = 'on'"))
            await conn.execute(
                delete(decisions).where(
                    decisions.c.node == chain, decisions.c.node_seq <= last_removed
                )
            )
        cuts.append(Cut(chain, int(last_removed), int(rows), int(answers)))
    return cuts


__all__ = ["Cut", "retain"]
