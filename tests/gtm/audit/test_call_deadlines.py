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
import socket
import time
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.database import make_async_engine
from gtm.audit.deadline import Watch
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import eventually

pytestmark = pytest.mark.postgres

BOUND_S = 30.0  # what a call may take here before the test calls it hung
SILENCE_S = 1.0  # the engine's deadlines here: 3 s a statement, 1 s the pool's ping
STATEMENT_S = 2.0


@contextlib.asynccontextmanager
async def _through_a_proxy(
    postgres_url: str, statement_s: float = STATEMENT_S
) -> AsyncIterator[tuple[TcpProxy, AsyncEngine]]:
    """A proxy in front of the server, and an engine (the test's deadlines) through it."""
    server = make_url(postgres_url)
    proxy = TcpProxy(server.host or "127.0.0.1", server.port or 5432)
    await proxy.start()
    through = server.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    engine = make_async_engine(through, silence_s=SILENCE_S, statement_s=statement_s)
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


async def test_without_a_statement_timeout_a_long_statement_is_not_cut(postgres_url: str) -> None:
    """``statement_s`` 0 is no statement timeout on the server: the client's deadline then
    leaves room for long statements (gtm.audit.deadline.UNTIMED_STATEMENT_S), not the
    silence alone, which would cut a healthy statement longer than it."""
    async with (
        _through_a_proxy(postgres_url, statement_s=0) as (_, engine),
        engine.connect() as conn,
    ):
        await conn.execute(text(f"SELECT pg_sleep({SILENCE_S * 2})"))  # raises if cut
        assert await conn.scalar(text("SELECT 1")) == 1  # and the connection goes on


async def test_a_deadline_due_while_the_answer_waits_unread_does_not_cut() -> None:
    """The process may be slow to read an answer that came (its loop stalled): that is no
    silence of the peer's. A deadline due then is moved on, not fired; with nothing waiting
    it fires and shuts the socket."""
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setblocking(False)
        watch = Watch(ours.fileno(), 0.05)
        due = watch._handle
        peer.send(b"an answer")
        time.sleep(0.2)  # noqa: ASYNC251 (the loop stalls past the deadline, the answer unread)
        await eventually(
            lambda: watch._handle is not due or watch.fired, BOUND_S, "the due deadline run"
        )
        assert not watch.fired  # moved on: a new deadline
        assert ours.recv(64) == b"an answer"  # the socket was left alone
        await eventually(lambda: watch.fired, BOUND_S, "the deadline with nothing waiting")
        assert ours.recv(64) == b""  # shut: nothing more is read from it
        with pytest.raises(BrokenPipeError):
            peer.send(b"late")  # nor written to it
        watch.cancel()
