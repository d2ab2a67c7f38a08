"""Keeping garbage-collection pauses off the answering paths, and the C heap from
fragmenting under churn.

The DNS responder and the HTTP front cache thousands of decisions and answers (tens of objects
each), and keep them until the decision epoch changes. Left to the collector's defaults, every
full collection walks all of them: on a loaded two-core machine, 50-100k cached objects cost a
30-80 ms pause (cache misses, not work), several times a minute while caches fill. That pause
is the whole P99 of both answering paths at 80 % load.

So the keeper, once a second, collects the young generations (objects that died young, cycles
included; well under a millisecond) and freezes what survived: frozen objects are never walked
again. Objects that die later are still freed by reference counting; only a reference *cycle*
that dies after being frozen waits for the next full collection, which the keeper runs at a long
interval (``full_every_s``, default ten minutes), unfreezing everything first. That one pause is
the price of bounded memory; it lands in the P99.99, not the P99. When the keeper stops it
unfreezes everything, so the collector's defaults apply again.

Below the interpreter, glibc's malloc (:func:`settle_malloc`) moves its threshold for
serving a large block from its own map up to the size of each such block freed, up to 32 MiB:
after the first freed table of the subnet memo or the spool's 256 KiB write buffer, blocks of
those sizes come from the heap, where freeing them leaves holes other blocks pin (measured:
3-4 MiB of a random-subnet flood's heap growth at a 16 MiB budget, none of it reused).
Fixing the threshold keeps large blocks in maps of their own, returned when freed; two arenas
instead of eight per core keep the few threads (database driver, journal, spool) from each
holding a partly used heap of its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import time
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept fixed
ARENA_MAX = 2


def settle_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc malloc's map threshold and cap its arenas (the module docstring), unless the
    environment tunes malloc itself (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``, or
    ``GLIBC_TUNABLES`` naming a ``glibc.malloc`` tunable: an operator's tuning wins). Returns
    whether both settings took; False on a C library without mallopt (musl, macOS), where
    nothing changes."""
    if (
        "MALLOC_MMAP_THRESHOLD_" in environ
        or "MALLOC_ARENA_MAX" in environ
        or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library, no ldconfig
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error.
    threshold = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    arenas = bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
    if not (threshold and arenas):
        log.warning("heap.malloc_not_settled", threshold=threshold, arenas=arenas)
    return threshold and arenas


class HeapKeeper:
    def __init__(
        self,
        interval_s: float = 1.0,
        full_every_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if full_every_s <= 0:
            raise ValueError("full_every_s must be positive: frozen cycles are only reclaimed then")
        self.interval_s = interval_s
        self.full_every_s = full_every_s
        self.clock = clock
        self._next_full = clock() + full_every_s
        self.full_collections = 0
        self.longest_full_s = 0.0

    def tick(self) -> None:
        """One round: a young collection and a freeze, or when due the full collection."""
        now = self.clock()
        if now >= self._next_full:
            started = time.perf_counter()
            frozen = gc.get_freeze_count()
            gc.unfreeze()
            gc.collect()
            took = time.perf_counter() - started
            self.full_collections += 1
            self.longest_full_s = max(self.longest_full_s, took)
            self._next_full = now + self.full_every_s
            log.info("heap.full_collection", seconds=round(took, 4), were_frozen=frozen)
        else:
            gc.collect(1)
        gc.freeze()

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.tick()
        finally:
            gc.unfreeze()
