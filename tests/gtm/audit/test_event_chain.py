"""The region events' hash chain on SQLite and PostgreSQL: appenders on several connections
never fork it, and an edited, removed or truncated event is found."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.database import make_async_engine
from gtm.audit.schema import region_events
from gtm.fleet import shared_state
from gtm.fleet.region_state import Override, RegionEvent
from tests.support.tamper import triggers_off


@pytest.fixture
async def engines(database_url: str) -> AsyncIterator[list[AsyncEngine]]:
    found = [make_async_engine(database_url) for _ in range(3)]
    yield found
    for engine in found:
        await engine.dispose()


def event(i: int, node: str) -> RegionEvent:
    return RegionEvent(1000.0 + i, node, "eu-west", "observed", "down", "up", f"probe {i}")


async def test_concurrent_appenders_build_one_unbroken_chain(engines: list[AsyncEngine]) -> None:
    async def node(engine: AsyncEngine, name: str) -> None:
        for i in range(15):
            await shared_state.append_events(engine, [event(i, name), event(i + 100, name)])

    await asyncio.gather(*(node(e, f"node-{k}") for k, e in enumerate(engines[:2])))
    # An operator's action is chained in the same transaction as the override itself.
    await shared_state.put_override(
        engines[2], Override("eu-west", drain=True, actor="ops", reason="upgrade"), "operator"
    )
    checked, breaks = await shared_state.read_event_chain(engines[0])
    assert (checked, breaks) == (61, [])
    async with engines[0].connect() as conn:
        seqs = (await conn.execute(select(region_events.c.seq))).scalars().all()
    assert sorted(seqs) == list(range(1, 62))


async def test_edits_removals_and_truncation_break_the_chain(engines: list[AsyncEngine]) -> None:
    engine = engines[0]
    for i in range(5):
        await shared_state.append_events(engine, [event(i, "node-a")])
    assert await shared_state.read_event_chain(engine) == (5, [])

    async with engine.begin() as conn:  # someone rewrites who did what
        await triggers_off(conn)
        await conn.execute(
            update(region_events).where(region_events.c.seq == 2).values(detail="nothing happened")
        )
    _, breaks = await shared_state.read_event_chain(engine)
    assert [(b.node_seq, b.problem) for b in breaks] == [
        (2, "event content does not match its hash")
    ]

    async with engine.begin() as conn:  # ... or removes an event from the middle
        await triggers_off(conn)
        await conn.execute(delete(region_events).where(region_events.c.seq == 3))
    _, breaks = await shared_state.read_event_chain(engine)
    assert {b.node_seq for b in breaks} >= {2, 4}
    assert any("jumps from 2 to 4" in b.problem for b in breaks)


async def test_removing_the_newest_events_is_found_by_the_head(engines: list[AsyncEngine]) -> None:
    engine = engines[0]
    for i in range(4):
        await shared_state.append_events(engine, [event(i, "node-a")])
    async with engine.begin() as conn:
        await triggers_off(conn)
        newest = await conn.scalar(select(func.max(region_events.c.seq)))
        await conn.execute(delete(region_events).where(region_events.c.seq == newest))
    checked, breaks = await shared_state.read_event_chain(engine)
    assert checked == 3
    assert [b.problem for b in breaks] == ["the chain ends at 3; its head says 4"]
