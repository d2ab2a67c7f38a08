"""Waiting for a condition in a test: polled, never a sleep standing in for readiness."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(
    cond: Callable[[], bool | Awaitable[bool]], within: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``cond`` (a plain or an async check) until it holds; fail after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in time")
        await asyncio.sleep(0.02)
