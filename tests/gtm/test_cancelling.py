"""A node's stop bounded when a task will not give way (gtm.cancelling).

A database call through a silent network answers its cancellation by closing the connection,
under a shield, and the close waits on the silent peer too: the task stays "cancelling" for
ever. The admin rollout test saw it in a node's stop (``state-sync`` cancelling, its
connection's close pending): ``Runtime.stop`` awaited the task without a bound and never
returned. The stuck task here is that shape exactly, a shielded future nobody resolves, as the
real one cannot be made to hang on cue.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gtm import cancelling
from gtm.fleet import shared_state
from gtm.runtime import Runtime
from tests.support.geoip import build_city_db
from tests.support.waiting import eventually

from .test_runtime import settings_for

WITHIN_S = 60.0  # a hang detector: the stop takes the (shortened) bound per stuck task


def _stuck() -> tuple[asyncio.Task[None], asyncio.Future[None]]:
    """A task that ignores cancellation until ``release`` is resolved, as a shielded close on a
    silent connection does."""
    release: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def hold() -> None:
        try:
            await asyncio.Event().wait()  # a query under way
        except asyncio.CancelledError:
            await asyncio.shield(release)  # the driver's close, waiting on the peer
            raise

    return asyncio.create_task(hold(), name="stuck"), release


async def test_a_task_that_does_not_give_way_is_left_behind_and_one_that_does_is_not() -> None:
    task, release = _stuck()
    await asyncio.sleep(0)  # running
    assert await cancelling.cancel_within(task, 0.1) is False
    assert not task.done()
    release.set_result(None)
    await asyncio.wait({task})
    assert task.cancelled()
    calm = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    assert await cancelling.cancel_within(calm, WITHIN_S) is True and calm.cancelled()


async def test_a_node_stops_while_its_tasks_are_stuck_in_a_silent_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cancelling, "STOP_WAIT_S", 0.2)
    runtime = Runtime(settings_for(tmp_path, build_city_db(tmp_path / "city.mmdb")))
    await runtime.start()
    stuck_sync, release_sync = _stuck()
    stuck_task, release_task = _stuck()
    await asyncio.sleep(0)
    # The state sync's round and one of the runtime's own loops, each inside such a call.
    normal_sync = runtime.sync._task
    runtime.sync._task = stuck_sync
    runtime._tasks.append(stuck_task)
    try:
        stopping = asyncio.create_task(runtime.stop())
        done, _ = await asyncio.wait({stopping}, timeout=WITHIN_S)
        assert done, "the stop waited on the stuck tasks"
        stopping.result()
    finally:
        for release in (release_sync, release_task):
            if not release.done():
                release.set_result(None)
        if normal_sync is not None:
            normal_sync.cancel()
        await asyncio.gather(stuck_sync, stuck_task, return_exceptions=True)


async def test_a_sync_round_stuck_in_its_cancellation_does_not_stop_the_next_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout test's other failure: node-b never acknowledged after the heal, its state
    sync's loop stuck for good in one round's cancelled call. Now the loop gives the round up
    after its bound and the next rounds run: the node hears from the fleet again."""
    settings = settings_for(tmp_path, build_city_db(tmp_path / "city.mmdb")).model_copy(
        update={"state_sync_interval_s": 0.1}
    )
    runtime = Runtime(settings)
    await runtime.start()
    release: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    real = shared_state.read_observations
    calls = [0]

    async def first_one_hangs(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            try:
                await asyncio.Event().wait()  # the peer went silent mid-call
            except asyncio.CancelledError:
                await asyncio.shield(release)  # the close, waiting on the silent peer
                raise
        return await real(*args, **kwargs)

    monkeypatch.setattr(shared_state, "read_observations", first_one_hangs)
    sync = runtime.sync
    try:
        await eventually(lambda: calls[0] >= 1, WITHIN_S, "a round in the silent call")
        stuck_at = sync.last_ok or 0.0
        # A later round reaches the database: the loop did not stay with the stuck one.
        await eventually(
            lambda: (sync.last_ok or 0.0) > stuck_at and calls[0] >= 2,
            WITHIN_S,
            "a round after the stuck one",
        )
        assert len(sync._stuck) == 1
    finally:
        release.set_result(None)
        await runtime.stop()
