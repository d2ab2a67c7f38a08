"""Admin actions as events in the fleet's hash-chained event log.

They share the chain of region events (:mod:`gtm.audit.event_chain`): one log says who drained a
region, who approved a policy and who was refused, in the order it happened. Admin events carry
the region ``-`` (fleet-wide) and their principal as the actor.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.fleet import shared_state
from gtm.fleet.region_state import RegionEvent

FLEET = "-"  # the region column of an event that is about no one region


async def record(
    conn: AsyncConnection,
    kind: str,
    detail: str,
    *,
    actor: str,
    now: float,
    node: str,
    reason: str | None = None,
) -> None:
    """Chain one admin event in the caller's transaction (it lands with the change)."""
    await shared_state.record_event(
        conn, RegionEvent(now, node, FLEET, kind, None, None, detail, actor, reason)
    )


__all__ = ["FLEET", "record"]
