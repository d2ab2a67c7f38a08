"""The heap keeper: survivors frozen every tick, frozen cycles reclaimed by the full collection."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from gtm.heap import HeapKeeper


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
