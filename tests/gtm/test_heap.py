"""The heap keeper: survivors frozen every tick, frozen cycles reclaimed by the full collection."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import weakref

import pytest

from gtm.heap import HeapKeeper, settle_malloc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    keep.append(a)
    return weakref.ref(a)


keep: list[_Node] = []


def test_survivors_are_frozen_and_frozen_cycles_wait_for_the_full_collection() -> None:
    now = [0.0]
    keeper = HeapKeeper(interval_s=1.0, full_every_s=600.0, clock=lambda: now[0])
    try:
        ref = _cycle()
        keeper.tick()  # the cycle is alive: it survives the young collection and is frozen
        assert gc.get_freeze_count() > 0
        keep.clear()  # now garbage, but frozen: neither collection below walks it
        keeper.tick()
        gc.collect()
        assert ref() is not None
        now[0] = 600.0  # the full collection is due: everything is unfrozen and walked
        keeper.tick()
        assert ref() is None
        assert keeper.full_collections == 1 and keeper.longest_full_s > 0
        # Garbage that dies young never needs the full collection.
        young = _cycle()
        keep.clear()
        now[0] = 601.0
        keeper.tick()
        assert young() is None and keeper.full_collections == 1
    finally:
        gc.unfreeze()


def test_a_keeper_without_full_collections_is_refused() -> None:
    with pytest.raises(ValueError, match="full_every_s"):
        HeapKeeper(full_every_s=0.0)


async def test_stopping_the_keeper_unfreezes_the_heap() -> None:
    keeper = HeapKeeper(interval_s=0.01)
    task = asyncio.create_task(keeper.run())
    await asyncio.sleep(0.05)
    assert gc.get_freeze_count() > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.get_freeze_count() == 0


# Run in a child: the allocator's threshold is process state, and this process's may already
# have moved. The child frees a 1 MiB block (mapped, as it is past the threshold) and then asks
# for a 256 KiB one: glibc by default has raised its threshold to 1 MiB by then, so that block
# comes from the heap (mapped bytes unchanged); settled, it is mapped of its own.
_PROBE = """
import ctypes, json, sys
from gtm.heap import settle_malloc
settled = settle_malloc({}) if sys.argv[1] == "settle" else False
libc = ctypes.CDLL(None)
class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.free(libc.malloc(1 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(256 << 10)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(json.dumps({"settled": settled, "mapped": mapped}))
"""


def _probe(mode: str) -> dict[str, object]:
    # Without the variables that tune malloc: the child's allocator starts at glibc's defaults.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")
    }
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, env=env
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _has_mallinfo2() -> bool:
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018 (glibc 2.33 and later)
    except (OSError, AttributeError, TypeError):
        return False
    return True


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or platform.libc_ver()[0] != "glibc"
    or not _has_mallinfo2(),
    reason="mallopt's threshold is glibc's; the probe reads it with mallinfo2 (glibc 2.33+)",
)
def test_settled_malloc_maps_large_blocks_after_a_larger_one_was_freed() -> None:
    assert _probe("default") == {"settled": False, "mapped": 0}  # the behaviour it fixes
    settled = _probe("settle")
    assert settled["settled"] is True
    assert isinstance(settled["mapped"], int) and settled["mapped"] >= 256 << 10


def test_an_operators_malloc_tuning_is_left_alone() -> None:
    assert settle_malloc({"MALLOC_ARENA_MAX": "4"}) is False
    assert settle_malloc({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert settle_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
