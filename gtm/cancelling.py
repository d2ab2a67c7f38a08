"""Stopping a task that may not stop: cancelled, then waited for a bounded time.

A task cancelled while a database call is under way through a silent network (a black hole: a
dropped route, a firewall that forgot the flow) may never finish: the driver answers the
cancellation by closing the connection, and the close waits on the peer too. A node stopping
then must not wait with it for ever: past the bound the task is left behind, said so in the
log, and the stop goes on (the connection is dropped with the process, or when the network
comes back).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

log = structlog.get_logger(__name__)

STOP_WAIT_S = 5.0  # how long a cancelled task is waited for at a stop


async def cancel_within(task: asyncio.Task[Any], within_s: float | None = None) -> bool:
    """Cancel ``task`` and wait up to ``within_s`` (:data:`STOP_WAIT_S`) for it to end; False
    (and a warning) when it did not. What it ended with, cancellation or an error, is not
    raised: it is being stopped."""
    if within_s is None:
        within_s = STOP_WAIT_S
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        log.warning(
            "task.stop_abandoned",
            task=task.get_name(),
            within_s=within_s,
            detail="cancelled, still waiting on I/O (a silent network?): left behind",
        )
        return False
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
    return True


__all__ = ["STOP_WAIT_S", "cancel_within"]
