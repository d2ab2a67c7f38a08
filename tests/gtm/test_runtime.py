from __future__ import annotations

import os
from ipaddress import ip_address
from pathlib import Path

from gtm.audit import query
from gtm.audit.record import record_of
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.geoip import build_city_db


def settings_for(tmp_path: Path, geoip: Path) -> Settings:
    return Settings(
        config=DEMO,
        policies=(POLICIES,),
        geoip_path=geoip,
        database_url=f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
        spool_dir=tmp_path / "spool",
        node_id="test-node",
        audit_flush_interval_s=0.05,
        probes=False,
    )


async def test_runtime_counts_every_answer_into_the_store(tmp_path: Path) -> None:
    geoip = build_city_db(tmp_path / "city.mmdb")
    runtime = Runtime(settings_for(tmp_path, geoip))
    await runtime.start()
    snap = runtime.store.current
    for i in range(50):
        req = DecisionRequest(Channel.DNS, ip_address(f"198.51.100.{i}"), "chat", "chat")
        runtime.count(record_of(decide(req, snap, 0.0), channel="dns", name="chat"))
    await runtime.stop()
    assert await _total(runtime) == 50


async def _total(runtime: Runtime) -> int:
    from gtm.audit.database import make_async_engine

    engine = make_async_engine(runtime.settings.database_url)
    try:
        return await query.total_count(engine)
    finally:
        await engine.dispose()


async def test_geoip_file_change_swaps_a_new_snapshot(tmp_path: Path) -> None:
    geoip = build_city_db(tmp_path / "city.mmdb", {"198.51.100.0/24": ("DE", "EU", 50.1, 8.7)})
    runtime = Runtime(settings_for(tmp_path, geoip))
    await runtime.start()
    try:
        before = runtime.store.current
        assert await runtime.reload_geoip() is False  # unchanged file: nothing to do
        staged = build_city_db(
            tmp_path / "next.mmdb", {"198.51.100.0/24": ("US", "NA", 38.9, -77.0)}
        )
        os.replace(staged, geoip)
        assert await runtime.reload_geoip() is True
        after = runtime.store.current
        assert after.version == before.version + 1
        req = DecisionRequest(Channel.DNS, ip_address("198.51.100.1"), "chat", "chat")
        assert decide(req, before, 0.0).region == "eu-central"  # the old snapshot is intact
        assert decide(req, after, 0.0).region == "us-east"
        geoip.write_bytes(b"corrupt")
        assert await runtime.reload_geoip() is False
        assert runtime.store.current is after
        assert runtime.geoip.last_error
    finally:
        await runtime.stop()


async def test_a_node_reports_its_audit_spool_with_its_status(tmp_path: Path) -> None:
    """What gtm audit verify reads to tell a late tail from a lost one (issue 33): the newest
    row sealed and the newest the database holds, in the node's status row."""
    from gtm.fleet import shared_state

    geoip = build_city_db(tmp_path / "city.mmdb")
    runtime = Runtime(settings_for(tmp_path, geoip))
    await runtime.start()
    try:
        snap = runtime.store.current
        for i in range(5):
            req = DecisionRequest(Channel.DNS, ip_address(f"198.51.100.{i}"), "chat", "chat")
            runtime.count(record_of(decide(req, snap, 0.0), channel="dns", name="chat"))
        await runtime.writer.flush()  # sealed and drained: the database holds every row
        sealed = runtime.writer.head().seq
        assert sealed > 0
        await runtime.sync.sync_once()
        (status,) = await shared_state.read_node_status(runtime.engine, 0.0)
        assert (status.audit_sealed, status.audit_drained) == (sealed, sealed)
    finally:
        await runtime.stop()
