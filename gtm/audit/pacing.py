"""How the writer's background work shares a core with the answering paths.

A flush's work is cut into slices of a fraction of a millisecond (:class:`Slices`), and, when
paced, rests several times as long as each slice worked; the threads that do its file and
database I/O run at a lower CPU priority than the loop's (:func:`run_in_background`), so the
kernel hands the core back to the loop as soon as a query arrives. See :mod:`gtm.audit.writer`
for why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

from gtm.audit import deadline

_BACKGROUND_NICE = 10  # added to the thread's nice value (capped at 19, the lowest priority)
SLICE_S = 0.0003  # the longest row rendering holds the loop before it answers again
MAX_REST_S = 0.05  # paced work never rests longer than this at once


class Slices:
    """The time slices of one flush's work: :meth:`next` hands the loop back to the answering
    paths (and, when paced, rests). A cancellation that arrives meanwhile is remembered, not
    raised, and the rest runs without yielding: tallies once taken must all become rows."""

    __slots__ = ("cancelled", "deadline", "rest", "started", "watch")

    def __init__(self, rest: float) -> None:
        self.cancelled = False
        self.rest = rest
        self.started = time.perf_counter()
        self.deadline = self.started + SLICE_S
        self.watch: deadline.Watch | None = (
            None  # the database connection's deadline, while one is used
        )

    async def next(self) -> None:
        if not self.cancelled:
            try:
                # Bounded: a slice that took long was waiting (on the database), not working,
                # and resting six times a wait made a writer that hung 92 s rest 9 minutes
                # after the network was back (issue 33).
                worked = time.perf_counter() - self.started
                await asyncio.sleep(min(self.rest * worked, MAX_REST_S))
            except asyncio.CancelledError:
                self.cancelled = True
        if self.watch is not None:
            self.watch.progress()  # a slice done is progress: the deadline moves on
        self.started = time.perf_counter()
        self.deadline = self.started + SLICE_S


def set_nice(tid: int) -> None:
    # Linux: the nice value is per thread, and any thread may lower its own or a sibling's
    # priority. Elsewhere, or without permission, nothing changes.
    with contextlib.suppress(AttributeError, OSError):
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + _BACKGROUND_NICE))


def run_in_background() -> None:
    """Lower the calling thread's CPU priority (background audit work beside the loop)."""
    set_nice(threading.get_native_id())
