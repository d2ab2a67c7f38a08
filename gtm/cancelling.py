"""Stopping a task that may not stop: cancelled, then waited for a bounded time.

A task cancelled while a database call is under way through a silent network (a black hole: a
dropped route, a firewall that forgot the flow) may never finish: the driver answers the
cancellation by closing the connection, and the close waits on the peer too. A node stopping
then must not wait with it for ever: past the bound the task is left behind, said so in the
log, and the stop goes on (the connection is dropped with the process, or when the network
comes back).

:func:`run_bounded` is the same for work that runs again and again (a sync round): past its
bound its connections are cut, so that it ends, and only when even that fails is it left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

STOP_WAIT_S = 5.0  # how long a cancelled task is waited for at a stop

T = TypeVar("T")


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


async def run_bounded(
    work: Coroutine[Any, Any, T],
    *,
    within_s: float,
    cut: Callable[[], int] | None,
    name: str,
) -> asyncio.Task[T]:
    """Run ``work`` in a task of its own and wait up to ``within_s`` for it. Past that it is
    stuck in a cleanup waiting on a silent peer (a rollback under the driver's shield, which no
    timeout reaches): ``cut`` shuts the sockets of its connections
    (gtm.audit.deadline.EngineSockets), the wait ends with an error the work handles, and it
    is waited for ``within_s`` again. The task is returned, done or (nothing to cut, or the cut
    did not end it) still running, for the caller to leave behind. Cancelled while waiting (a
    stop), the task is cancelled too, within :data:`STOP_WAIT_S`."""
    task = asyncio.create_task(work, name=name)
    try:
        done, _ = await asyncio.wait({task}, timeout=within_s)
        if not done and cut is not None:
            sockets = cut()
            log.warning("task.cut", task=name, sockets=sockets, after_s=within_s)
            await asyncio.wait({task}, timeout=within_s)
    except asyncio.CancelledError:
        await cancel_within(task)
        raise
    return task


__all__ = ["STOP_WAIT_S", "cancel_within", "run_bounded"]
