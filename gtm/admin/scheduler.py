"""Scheduled activations: each admin node with the signing key activates what is due, once.

A proposal scheduled for a time (``POST /v1/proposals/{id}/activate`` with ``at``) is activated
by whichever admin node looks first after that time, with every check of an activation made
then (sealed approvals of this version by current approvers, the configured number). Exactly
once across nodes: the activation locks the proposal row and moves it out of ``approved`` in
the same transaction that takes the next (unique) sequence, so a second node finds nothing to
do, or loses on the sequence, and skips it.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gtm.admin import lifecycle
from gtm.admin import principals as identities
from gtm.admin.auth import AdminContext
from gtm.admin.errors import LifecycleError
from gtm.admin.permissions import Role

log = structlog.get_logger(__name__)


async def activate_due(ctx: AdminContext) -> list[int]:
    """Activate every proposal that is due; the ids activated here."""
    if ctx.signer is None:
        return []
    now = ctx.clock()
    # What is due is what the verified log says: a proposal row set to "approved" with a
    # schedule in the database (a rollback by SQL) is nothing here.
    due = lifecycle.due(await ctx.control.refresh(ctx.engine), now)
    done = []
    for proposal_id, scheduled_by in due:
        try:
            async with ctx.engine.begin() as conn:
                # Who scheduled it must still be a sealed, enabled approver now.
                actor = await identities.by_id(conn, scheduled_by, ctx.control)
                if actor is None or actor.disabled or Role.POLICY_APPROVER not in actor.roles:
                    log.error("admin.schedule_refused", proposal=proposal_id)
                    continue
                await lifecycle.activate(
                    conn,
                    proposal_id,
                    actor,
                    ctx.signer,
                    now=now,
                    node=ctx.node,
                    control=ctx.control,
                    min_approvals=ctx.required_approvals,
                )
            done.append(proposal_id)
            log.info("admin.scheduled_activation", proposal=proposal_id)
        except LifecycleError as exc:  # another node was first, or it no longer qualifies
            log.info("admin.scheduled_skipped", proposal=proposal_id, reason=str(exc))
        except SQLAlchemyError as exc:  # lost the race on the sequence or the lock
            log.info("admin.scheduled_skipped", proposal=proposal_id, reason=type(exc).__name__)
    return done


async def run(ctx: AdminContext, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Look for due activations every ``interval_s`` until ``stop`` is set."""
    while not stop.is_set():
        try:
            await activate_due(ctx)
        except Exception:  # the loop outlives any single failure (a database away, say)
            log.exception("admin.scheduler_failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


__all__ = ["activate_due", "run"]
