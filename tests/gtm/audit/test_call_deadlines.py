"""A deadline on every call an engine makes (DESIGN.md rule 10, gtm.audit.deadline), checked
against the real PostgreSQL behind a proxy that goes silent while it keeps every connection
open, so the kernel keeps acknowledging: a frozen server, or something in between that
swallows what it is sent. ``tcp_user_timeout`` and keepalives never fire there.

Before, the engine the admin API, its loops and the control log share had no deadline of its
own: a statement sent into that silence, or the pool's ping of a kept connection, waited for
good (each test here failed at its 30 s bound); now the call fails at its deadline, the
connection is discarded, and the next call goes through on a new one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.database import make_async_engine
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.postgres

BOUND_S = 30.0  # what a call may take here before the test calls it hung
SILENCE_S = 0.5  # the engine's deadlines here: 1 s a statement, 0.5 s the pool's ping
STATEMENT_S = 0.5


@contextlib.asynccontextmanager
async def _through_a_proxy(postgres_url: str) -> AsyncIterator[tuple[TcpProxy, AsyncEngine]]:
    """A proxy in front of the server, and an engine (the test's deadlines) through it."""
    server = make_url(postgres_url)
    proxy = TcpProxy(server.host or "127.0.0.1", server.port or 5432)
    await proxy.start()
    through = server.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    engine = make_async_engine(through, silence_s=SILENCE_S, statement_s=STATEMENT_S)
    try:
        yield proxy, engine
    finally:
        await engine.dispose()
        await proxy.stop()


async def _select_one(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(text("SELECT 1")) or 0)


async def test_a_statement_sent_into_silence_fails_at_its_deadline(postgres_url: str) -> None:
    async with _through_a_proxy(postgres_url) as (proxy, engine):
        async with engine.connect() as conn:
            assert await conn.scalar(text("SELECT 1")) == 1
            proxy.blackhole()
            with pytest.raises(DBAPIError) as caught:
                await asyncio.wait_for(conn.execute(text("SELECT 2")), BOUND_S)
            assert caught.value.connection_invalidated  # never handed out again
        proxy.heal()
        assert await asyncio.wait_for(_select_one(engine), BOUND_S) == 1  # a new connection


async def test_a_kept_connection_gone_silent_is_pinged_out_and_replaced(postgres_url: str) -> None:
    async with _through_a_proxy(postgres_url) as (proxy, engine):
        assert await _select_one(engine) == 1  # its connection goes back to the pool
        proxy.blackhole()  # the kept connection goes silent...
        proxy.heal()  # ...while new ones pass again
        # The pool pings the kept connection before handing it out: the ping meets the
        # silence, is cut at its deadline, and the pool opens a new connection instead.
        assert await asyncio.wait_for(_select_one(engine), BOUND_S) == 1
        assert proxy.accepted == 2


async def test_a_commit_sent_into_silence_fails_at_its_deadline(postgres_url: str) -> None:
    async with _through_a_proxy(postgres_url) as (proxy, engine):
        conn = await engine.connect()
        try:
            await conn.execute(text("SELECT 1"))  # a transaction begun
            proxy.blackhole()
            with pytest.raises(DBAPIError):
                await asyncio.wait_for(conn.commit(), BOUND_S)
        finally:
            await asyncio.wait_for(conn.close(), BOUND_S)  # its rollback meets a shut socket
