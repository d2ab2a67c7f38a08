"""Answers an activation would send out of their jurisdiction: refused until the activator
names each leak, and recorded with the activation once named (gtm.admin.routes.documents)."""

from __future__ import annotations

from collections import Counter

from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.admin import events, impact
from gtm.admin.auth import AdminContext
from gtm.admin.errors import Conflict
from gtm.admin.principals import Principal
from gtm.errors import Problem


class LeakNotAcknowledged(Conflict):
    """An activation that would send answers out of their jurisdiction, without the activator
    naming each such leak: refused with every leak and its count, so a client can show them."""

    code = "leak_not_acknowledged"


def _problems(leaks: Counter[impact.Leak]) -> list[Problem]:
    return [
        Problem(
            "impact",
            impact.leak_name(leak),
            f"{n} answers of class {leak[0]} answered in {leak[1]} would be answered in {leak[2]}",
        )
        for leak, n in leaks.most_common()
    ]


def refuse_unacknowledged(leaks: Counter[impact.Leak], acknowledge: str) -> None:
    """Refused (409 ``leak_not_acknowledged``) unless ``acknowledge`` names every leak."""
    missing = impact.unacknowledged(leaks, acknowledge)
    if missing:
        total = sum(leaks.values())
        raise LeakNotAcknowledged(
            f"activating this sends {total} answers of the last day out of their jurisdiction; "
            f"activate with acknowledge={impact.leak_key(leaks)!r} to accept",
            _problems(leaks),
        )


async def record_acknowledged(
    conn: AsyncConnection,
    proposal_id: int,
    who: Principal,
    leaks: Counter[impact.Leak],
    ctx: AdminContext,
) -> None:
    """The acknowledgement lands in the activation's transaction: evidence of who accepted
    which leak, and how many answers it stood for, with the change it let through."""
    if leaks:
        named = "; ".join(f"{impact.leak_name(x)} ({n} answers)" for x, n in leaks.most_common())
        await events.record(
            conn,
            "proposal",
            f"#{proposal_id}: answers leaving their jurisdiction acknowledged: {named}",
            actor=who.name,
            now=ctx.clock(),
            node=ctx.node,
        )
