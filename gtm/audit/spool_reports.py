"""What each node says its audit spool still holds: rows late, not gone.

A node seals its decision rows into its local spool (:mod:`gtm.audit.spool`) and checkpoints the
sealed head; the database takes the rows when it can. During an outage, or while a black-holed
connection hangs, the checkpoints run ahead of the database by every row sealed since, and a
missing tail would read as a break. So each node reports, with its status
(``node_status.audit_sealed_seq`` and ``audit_drained_seq``), the newest row it sealed and the
newest it knows the database holds.

A missing tail ``store_end + 1 .. vouched`` is *spooled* only when a report no older than the
liveness bound says the node still holds all of it: it has drained nothing past the store's end
(``drained <= store_end``: rows it wrote and that are not there were removed) and has sealed at
least what the checkpoint vouches for, unless the report predates that checkpoint (a node whose
spool was lost starts again from the database's head, and says so after its old checkpoints).
Anything else stays a break. The report is a database row, so an attacker who deletes a tail
could write one too: that buys "incomplete", never "clean", and only until the node's next report
(every state-sync round) says what it really drained.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.schema import node_status


@dataclass(frozen=True, slots=True)
class SpoolReport:
    """One node's last report of its spool: rows ``drained + 1 .. sealed`` only on its disk."""

    node: str
    at: float  # when the node reported it (unix seconds)
    sealed: int
    drained: int

    def holds(self, store_end: int, vouched: int, vouched_at: float) -> bool:
        """Whether this report accounts for rows ``store_end + 1 .. vouched`` as still
        spooled; ``vouched_at``: when the first checkpoint of ``vouched`` was signed. A report
        from before it cannot have sealed that far yet (the node reports every state-sync
        round, checkpoints every few seconds): its drained end is what counts. One from after
        it that sealed less is a node that lost its spool."""
        if self.drained > store_end:
            return False
        return self.sealed >= vouched or self.at < vouched_at


async def read_spool_reports(engine: AsyncEngine, newer_than: float) -> dict[str, SpoolReport]:
    """The spool reports of the nodes that reported since ``newer_than``, by node (chain)."""
    query = select(
        node_status.c.node,
        node_status.c.updated_at_us,
        node_status.c.audit_sealed_seq,
        node_status.c.audit_drained_seq,
    ).where(
        node_status.c.updated_at_us >= int(newer_than * 1e6),
        node_status.c.audit_sealed_seq.isnot(None),
        node_status.c.audit_drained_seq.isnot(None),
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return {
        str(node): SpoolReport(str(node), int(at_us) / 1e6, int(sealed), int(drained))
        for node, at_us, sealed, drained in rows
    }


__all__ = ["SpoolReport", "read_spool_reports"]
