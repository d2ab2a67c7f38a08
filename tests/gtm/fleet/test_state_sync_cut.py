"""A fleet exchange (a state sync round, a report marks sync) stuck on a black-holed connection
is ended by shutting its connections' sockets: the node hears from the fleet again once the
network is back.

The admin rollout test failed this way in CI (about one run in two here): node-b's round was
cut off as the control log's read gave its connection back. The rollback on the way out waits
on the peer, in a close the driver shields from cancellation and no deadline reaches (psycopg
bounds a cancelled query, not a rollback), while the round holds the control log's lock: every
later round timed out waiting for that lock, so node-b never acknowledged after the heal. The
report marks' loop, without any deadline, stayed stuck for good the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import make_url

from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.postgres import postgres_database
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import eventually

pytestmark = pytest.mark.postgres


@pytest.fixture
def postgres() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.mark.parametrize("table", ["control_log", "capacity_marks"])
async def test_an_exchange_stuck_on_a_silent_peer_is_cut_and_the_node_recovers(
    postgres: str, tmp_path: Path, geoip_path: Path, table: str
) -> None:
    server = make_url(postgres)
    proxy = TcpProxy(server.host or "127.0.0.1", server.port or 5432)
    await proxy.start()
    via = server.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    settings = Settings(
        config=DEMO, policies=(POLICIES,), geoip_path=geoip_path, database_url=via,
        spool_dir=tmp_path / "spool", node_id="node-b", probes=False,
        state_sync_interval_s=0.1,
    )  # fmt: skip
    node = Runtime(settings)
    await node.start()
    sync = node.sync
    reads: list[str] = []  # the statements on ``table``, from the cut on
    cut: list[str] = []

    def read(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if table in statement:
            reads.append(statement)

    def cut_at_its_rollback(_conn: Any) -> None:
        # The route goes silent just as the read's connection is given back: its rollback
        # waits on the peer (for the control log, while the round holds the log's lock).
        if reads and not cut:
            cut.append("rollback")
            proxy.blackhole()

    try:
        await eventually(lambda: sync.last_ok is not None, 30, "the node in sync")
        engine = sync.engine.sync_engine
        event.listen(engine, "before_cursor_execute", read)
        event.listen(engine, "rollback", cut_at_its_rollback)
        await eventually(lambda: bool(cut), 30, f"an exchange cut off after a read of {table}")
        # The stuck exchange is cut (its sockets shut) while the network is still silent.
        sockets = node.sync_sockets
        assert sockets is not None
        await eventually(lambda: sockets.cuts >= 1, 30, "the stuck exchange cut")
        heard_at, reads_at = sync.last_ok or 0.0, len(reads)
        proxy.heal()
        await eventually(lambda: (sync.last_ok or 0.0) > heard_at, 30, "a state sync round")
        await eventually(lambda: len(reads) > reads_at, 30, f"{table} read again")
        assert not sync._stuck, "no round was left behind"
    finally:
        await node.stop()
        await proxy.stop()
