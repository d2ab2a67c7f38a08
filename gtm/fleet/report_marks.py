"""The newest capacity report of each region, kept in the shared database.

A node keeps its own mark per region (the (ts, seq) of the last report it accepted) in
``capacity_marks``; the fleet's mark is the newest over all nodes. Read at start and written
back at every state sync, they let :class:`gtm.fleet.capacity.CapacityIntake` refuse a report
captured and replayed after a restart, or to another node: in memory alone, a restart forgot
every mark. A report accepted in the last sync interval before a crash is the one exception
(its mark had not been written yet): it is the region's newest report, so replaying it says
nothing the region had not said.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.database import upsert
from gtm.audit.schema import capacity_marks
from gtm.fleet.capacity import CapacityIntake, Mark


async def load(engine: AsyncEngine, node: str) -> tuple[dict[str, Mark], dict[str, Mark]]:
    """(this node's marks, the fleet's newest) by region."""
    async with engine.connect() as conn:
        rows = (await conn.execute(select(capacity_marks))).all()
    own = {r.region: (r.ts, r.seq) for r in rows if r.node == node}
    fleet: dict[str, Mark] = {}
    for r in rows:
        fleet[r.region] = max((r.ts, r.seq), fleet.get(r.region, (r.ts, r.seq)))
    return own, fleet


async def store(engine: AsyncEngine, node: str, marks: dict[str, Mark]) -> None:
    """Write this node's marks (only ever forward: an older mark never replaces a newer)."""
    rows = [{"node": node, "region": r, "ts": ts, "seq": seq} for r, (ts, seq) in marks.items()]
    if not rows:
        return
    stmt = upsert(engine, capacity_marks)
    stored, new = capacity_marks.c, stmt.excluded
    stmt = stmt.on_conflict_do_update(
        index_elements=["node", "region"],
        set_={"ts": new.ts, "seq": new.seq},
        where=(stored.ts < new.ts) | ((stored.ts == new.ts) & (stored.seq < new.seq)),
    )
    async with engine.begin() as conn:
        await conn.execute(stmt, rows)


class MarkSync:
    """What changed since the last sync goes out; the fleet's newest comes in."""

    def __init__(self, engine: AsyncEngine, node: str, intake: CapacityIntake) -> None:
        self.engine, self.node, self.intake = engine, node, intake
        self._written: dict[str, Mark] = {}

    async def start(self) -> None:
        own, fleet = await load(self.engine, self.node)
        self.intake.remember(own, fleet)
        self._written = dict(own)

    async def sync(self) -> None:
        own = self.intake.own_marks()
        changed = {r: m for r, m in own.items() if self._written.get(r) != m}
        if changed:
            await store(self.engine, self.node, changed)
            self._written.update(changed)
        _, fleet = await load(self.engine, self.node)
        self.intake.remember({}, fleet)


__all__ = ["MarkSync", "load", "store"]
