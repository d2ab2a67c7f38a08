"""Least privilege on the real PostgreSQL (migration 0007): an answering node's role may only
add evidence, never change or remove it; the tables' owner is refused by triggers; readers only
read. And a node runs with nothing more than its role (the admin service: tests/gtm/admin)."""

from __future__ import annotations

import subprocess
import sys
import time
from ipaddress import ip_address
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from gtm.audit.database import make_async_engine
from gtm.audit.record import record_of
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot
from gtm.fleet.region_state import RegionEvent
from gtm.fleet.shared_state import append_events
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES, ROOT
from tests.gtm.audit.test_audit import records
from tests.support.postgres import fresh_cluster

pytestmark = pytest.mark.postgres


def _sql(url: str, statement: str) -> str | None:
    """None when ``statement`` succeeded, else the server's error message."""
    try:
        with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(False),
                             autocommit=True) as conn:  # fmt: skip
            conn.execute(statement)
    except psycopg.Error as exc:
        return str(exc).splitlines()[0]
    return None


async def test_a_node_runs_on_its_role_and_cannot_change_what_it_wrote(
    postgres_logins: dict[str, str], postgres_url: str, tmp_path: Path, geoip_path: Path
) -> None:
    settings = Settings(
        config=DEMO, policies=(POLICIES,), geoip_path=geoip_path,
        database_url=postgres_logins["gtm_node"], spool_dir=tmp_path / "spool", node_id="least",
        probes=False, migrate_on_start=False, state_sync_interval_s=0.1,
    )  # fmt: skip
    runtime = Runtime(settings)
    await runtime.start()
    for i in range(5):
        request = DecisionRequest(Channel.DNS, ip_address(f"198.51.100.{i}"), "chat", "chat")
        runtime.count(record_of(decide(request, runtime.store.current, 0.0), channel="dns",
                                name="chat"))  # fmt: skip
    await runtime.writer.flush()
    assert await runtime.sync.sync_once()  # node status, observations, documents
    await runtime.marks.sync()
    probe = RegionEvent(time.time(), "least", "eu-west", "observed", "up", None, "probe ok")
    await append_events(runtime.engine, [probe])  # as gtm_node: the event and the chain's head
    await runtime.stop()
    assert runtime.writer.last_error is None
    assert runtime.spool.pending() == []  # every row reached the database as gtm_node
    node, reader = postgres_logins["gtm_node"], postgres_logins["gtm_reader"]
    assert _sql(node, "INSERT INTO audit_store VALUES ('x', 0)") is not None
    for statement in (
        "UPDATE decisions SET region = 'us-east'",
        "DELETE FROM decisions",
        "TRUNCATE decisions",
        "UPDATE region_events SET detail = 'x'",
        "DELETE FROM audit_checkpoints",
        "UPDATE audit_store SET id = 'other'",
    ):
        refused = _sql(node, statement)
        assert refused is not None and "permission denied" in refused, statement
    # The owner holds every privilege, and the triggers still refuse.
    for statement in (
        "UPDATE decisions SET region = 'us-east'",
        "DELETE FROM decisions",
        "TRUNCATE decisions",
        "DELETE FROM region_events",
        "TRUNCATE audit_checkpoints",
    ):
        refused = _sql(postgres_url, statement)
        assert refused is not None and "append-only" in refused, statement
    assert _sql(reader, "SELECT count(*) FROM decisions") is None
    assert "permission denied" in (_sql(reader, "INSERT INTO audit_store VALUES ('y', 0)") or "")
    with psycopg.connect(
        make_url(reader).set(drivername="postgresql").render_as_string(False)
    ) as c:
        rows = c.execute("SELECT sum(count) FROM decisions WHERE node = 'least'").fetchone()
        assert rows is not None and rows[0] == 5
        checkpoints = c.execute("SELECT count(*) FROM audit_checkpoints").fetchone()
        assert checkpoints is not None and checkpoints[0] >= 2  # open and shutdown


async def test_a_flush_the_database_refuses_keeps_every_row_spooled(
    postgres_logins: dict[str, str], tmp_path: Path, snapshot: Snapshot
) -> None:
    """The COPY fails server-side (a role without INSERT): the flush says so, the rows stay in
    the spool, and stopping does not raise; with the right role the next start drains them."""
    reader = make_async_engine(postgres_logins["gtm_reader"])
    spool = Spool(tmp_path / "spool", "refused")
    writer = AuditWriter(reader, "refused", spool)
    for record in records(snapshot):
        writer.count(record)
    assert await writer.flush() == 0
    assert writer.last_error is not None and "permission denied" in writer.last_error
    await writer.stop()
    await reader.dispose()
    assert len(Spool(tmp_path / "spool", "refused").pending()) == 3
    node = make_async_engine(postgres_logins["gtm_node"])
    try:
        again = AuditWriter(node, "refused", Spool(tmp_path / "spool", "refused"))
        await again.start()
        await again.stop()
        assert again.last_error is None
        assert Spool(tmp_path / "spool", "refused").pending() == []
    finally:
        await node.dispose()


def test_databases_migrated_at_once_on_a_fresh_cluster_share_its_roles() -> None:
    """The roles are the cluster's, not a database's: migrated at the same time on a cluster
    that has none yet, each database finds them missing and creates them; one creation wins,
    the others find its roles and go on (before, they failed on pg_authid's unique index)."""
    with fresh_cluster(databases=3) as urls:
        # Processes, not threads: alembic's ``op`` is one per process.
        upgrade = "import sys; from gtm.audit import migrate; migrate.upgrade(sys.argv[1])"
        runs = [
            subprocess.Popen(
                [sys.executable, "-c", upgrade, url],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for url in urls
        ]
        errors = [run.communicate(timeout=120)[1] for run in runs]
        assert [run.returncode for run in runs] == [0, 0, 0], "\n".join(errors)[-3000:]
        # Each database's grants went to the one set of roles.
        for url in urls:
            with psycopg.connect(make_url(url).set(drivername="postgresql")
                                 .render_as_string(False)) as conn:  # fmt: skip
                row = conn.execute(
                    "SELECT pg_has_role('gtm_admin', 'gtm_node', 'MEMBER'),"
                    " has_table_privilege('gtm_admin', 'documents', 'INSERT'),"
                    " has_table_privilege('gtm_node', 'decisions', 'INSERT'),"
                    " has_table_privilege('gtm_node', 'decisions', 'UPDATE'),"
                    " has_table_privilege('gtm_reader', 'decisions', 'SELECT')"
                ).fetchone()
            assert row == (True, True, True, False, True), url
