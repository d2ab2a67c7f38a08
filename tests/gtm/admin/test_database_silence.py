"""The admin API while its database is silent (DESIGN.md rule 10): a proxy in front of the
real PostgreSQL stops forwarding and closes nothing, so the kernel keeps acknowledging and no
TCP timeout fires. Before, a request's first call waited there for good (the test gave up at
its 30 s bound); now it fails at its deadline and is answered 503 with a Retry-After, not 401
(the token may be good) nor 500, and once the route is back the next requests are answered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from gtm.admin.permissions import Role
from tests.gtm.admin.conftest import AdminFactory, through
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import eventually

pytestmark = pytest.mark.postgres

BOUND_S = 30.0  # what a request may take here before the test calls it hung
WITHIN_S = 60.0  # a condition polled for, not a timing measured


async def test_a_silent_database_gets_503_and_the_api_recovers_after_the_heal(
    start_admin: AdminFactory, postgres: str, tmp_path: Path
) -> None:
    server = make_url(postgres)
    proxy = TcpProxy(server.host or "127.0.0.1", server.port or 5432)
    await proxy.start()
    try:
        deadlines = {"database_silence_s": 1.0, "database_statement_timeout_s": 2.0}
        async with start_admin(database_url=through(postgres, proxy), **deadlines) as admin:
            alice = await admin.token("alice", Role.AUDITOR)
            async with admin.client(alice) as a:
                assert (await a.get("/v1/events")).status_code == 200
                proxy.blackhole()
                r = await asyncio.wait_for(a.get("/v1/events"), BOUND_S)
                assert r.status_code == 503, r.text
                assert r.json()["error"] == "database_unavailable"
                assert r.headers["retry-after"] == "5"
                proxy.heal()

                async def answered() -> bool:
                    try:
                        return (await a.get("/v1/events")).status_code == 200
                    except httpx.HTTPError:
                        return False

                await eventually(answered, WITHIN_S, "the API answering again after the heal")
    finally:
        await proxy.stop()
