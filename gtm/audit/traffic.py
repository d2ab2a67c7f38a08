"""Live traffic from the audit store: answers per (client country, region, outcome) over the last
seconds, summed across every node that writes to the store (the console's map draws it)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.schema import decisions


@dataclass(frozen=True, slots=True)
class Flow:
    country: str | None  # None: GeoIP did not place the client
    region: str | None  # None: nothing answered (refused, failed closed)
    outcome: str
    answers: int


async def flows(engine: AsyncEngine, since_us: int) -> list[Flow]:
    """Answers counted in rows first seen at or after ``since_us``. A row's count gathers
    identical decisions over at most one writer flush, so the window's edge is that blurred."""
    total = func.sum(decisions.c.count)
    query = (
        select(decisions.c.country, decisions.c.region, decisions.c.outcome, total)
        .where(decisions.c.first_at_us >= since_us)
        .group_by(decisions.c.country, decisions.c.region, decisions.c.outcome)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [Flow(r[0], r[1], r[2], int(r[3] or 0)) for r in rows]


__all__ = ["Flow", "flows"]
