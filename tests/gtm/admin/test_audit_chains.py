"""The evidence status the console shows, ``GET /v1/audit/chains``: every chain's newest signed
checkpoint and whether the sink outside the database holds it, gaps, retention cuts, and this
admin node's scheduled verification; through the real app, with a store tampered with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, insert, select

from gtm.admin.permissions import Role
from gtm.audit.anchor import Anchor, read_store_id
from gtm.audit.checkpoints import DirectorySink
from gtm.audit.retention import retain
from gtm.audit.schema import audit_checkpoints, decisions
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.runtime import Runtime
from tests.gtm.admin.conftest import Admin, AdminFactory
from tests.gtm.admin.test_audit_api import DE, US, count
from tests.gtm.audit.test_audit import records
from tests.support.tamper import triggers_off
from tests.support.waiting import eventually


async def _old_chain(runtime: Runtime, sink: DirectorySink) -> None:
    """A second node's chain: it stopped uncleanly once (a gap), and retention removed its
    first day (a cut)."""
    now = [1_000.0]
    spool = Spool(runtime.settings.spool_dir.parent / "spool-old", "old")
    store = await read_store_id(runtime.engine)
    assert store is not None
    spool.bind(store)
    spool.running_path.parent.mkdir(parents=True, exist_ok=True)
    spool.running_path.touch()  # the marker a clean stop removes: the last run was killed
    writer = AuditWriter(runtime.engine, "old", spool, clock=lambda: now[0])
    anchor = Anchor(runtime.engine, writer, spool, sink, interval_s=3600, clock=lambda: now[0])
    await writer.start()
    await anchor.start()
    snapshot = runtime.store.current
    for day in range(2):  # three rows a day
        now[0] = 1_000.0 + 86_400 * day
        for n, record in enumerate(records(snapshot)):
            writer.count(record, n=n + 1)
        await writer.flush()
    await writer.stop()
    await anchor.stop()
    done = await retain(runtime.engine, int(50_000 * 1e6), key=spool.key, sink=sink, store=store)
    assert [(c.chain, c.seq) for c in done.cuts] == [("old", 3)]


def _append(path: Path, line: bytes) -> None:
    with open(path, "ab") as f:
        f.write(line)


async def _chains(client: Any) -> dict[str, Any]:
    response = await client.get("/v1/audit/chains")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_every_chain_with_its_checkpoints_gaps_cuts_and_verification(
    start_admin: AdminFactory, monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    monkeypatch.setenv("GTM_AUDIT_VERIFY_INTERVAL_S", "0.2")
    async with start_admin(database_url=database_url) as admin:
        await _check(admin)


async def _check(admin: Admin) -> None:
    runtime = admin.runtime
    sink = DirectorySink(runtime.settings.checkpoint_dir)
    count(runtime, US, "chat-eu", "chat.eu.gtm.example.", 5)
    count(runtime, DE, "chat", "chat.gtm.example.", 3)
    await runtime.writer.flush()
    await runtime.anchor.checkpoint("checkpoint")
    await _old_chain(runtime, sink)
    auditor = await admin.token("ada", Role.AUDITOR)
    operator = await admin.token("otto", Role.OPERATOR)
    viewer = await admin.token("vic", Role.VIEWER)
    async with admin.client(auditor) as a, admin.client(operator) as o, admin.client(viewer) as v:
        assert (await v.get("/v1/audit/chains")).status_code == 403

        async def verified() -> bool:
            body = await _chains(a)
            last = body["verification"]["last_pass"]
            chains = {c["chain"]: c for c in body["chains"]}
            through = {c: (chains[c]["verified"] or {}).get("seq") for c in ("admin-test", "old")}
            return bool(last and last["ok"] and through == {"admin-test": 2, "old": 6})

        await eventually(verified, within=20, what="a scheduled pass over the new rows")
        body = await _chains(o)  # operators read it too
        assert body["store"] == await read_store_id(runtime.engine)
        assert body["sink"]["location"] == str(runtime.settings.checkpoint_dir)
        assert body["sink"]["problems"] == [] and body["sink"]["keys"] == 2
        chains = {c["chain"]: c for c in body["chains"]}
        assert {"admin-test", "old"} <= set(chains)

        node = chains["admin-test"]
        assert node["node"] == "admin-test" and node["kind"] == "decisions"
        last = node["last_checkpoint"]
        assert last["kind"] == "checkpoint" and last["seq"] == node["database_seq"] == 2
        assert last["answers"] == 8 and last["key_id"] == runtime.anchor.key.id
        assert last["in_sink"] and last["in_database"] and last["location"]
        assert node["unanchored_rows"] == 0 and node["gaps"] == [] and node["cuts"] == []
        assert node["warnings"] == []
        assert node["verified"]["seq"] == 2

        old = chains["old"]
        assert [g["kind"] for g in old["gaps"]] == ["gap"]
        assert "unclean stop" in old["gaps"][0]["detail"] and old["gaps"][0]["in_sink"]
        assert [(c["seq"], c["answers"], c["in_sink"]) for c in old["cuts"]] == [(3, 6, True)]
        assert old["last_checkpoint"]["seq"] == old["database_seq"] == 6
        assert old["warnings"] == []

        verification = body["verification"]
        assert verification["node"] == "admin-test" and verification["scheduled"]
        assert verification["interval_s"] == 0.2 and verification["passes"] >= 1
        assert verification["last_pass"]["break_count"] == 0
        assert verification["last_pass"]["error"] is None

        # Someone with the database password: the newest row of a chain goes, and a checkpoint
        # is forged into the database's copy; a line of the sink is damaged too.
        async with runtime.engine.begin() as conn:
            await triggers_off(conn)
            await conn.execute(
                delete(decisions).where(decisions.c.node == "admin-test", decisions.c.node_seq == 2)
            )
            forged = (await conn.execute(
                select(audit_checkpoints)
                .where(audit_checkpoints.c.chain == "old", audit_checkpoints.c.kind == "checkpoint")
                .order_by(audit_checkpoints.c.id.desc()).limit(1)
            )).one()._mapping  # fmt: skip
            await conn.execute(
                insert(audit_checkpoints),
                {**{k: v for k, v in forged.items() if k != "id"}, "seq": 99, "signature": "00"},
            )
        chain_file = next((runtime.settings.checkpoint_dir / "chains").glob("old.*.jsonl"))
        _append(chain_file, b'{"checkpoint": "not one"}\n')

        async def failed() -> bool:
            # A pass that began before the damage may see part of it: wait for one that sees all.
            last = (await _chains(a))["verification"]["last_pass"]
            return bool(last) and {b["chain"] for b in last["breaks"]} >= {
                "admin-test",
                "checkpoint",
            }

        await eventually(failed, within=20, what="a scheduled pass that finds the breaks")
        body = await _chains(a)
        chains = {c["chain"]: c for c in body["chains"]}
        assert "the tail is gone" in " ".join(chains["admin-test"]["warnings"])
        assert chains["admin-test"]["database_seq"] == 1
        last = chains["old"]["last_checkpoint"]
        assert (last["seq"], last["in_sink"], last["in_database"]) == (99, False, True)
        assert "not anchored outside the database" in " ".join(chains["old"]["warnings"])
        [problem] = body["sink"]["problems"]
        assert problem["location"].startswith(f"{chain_file}:") and body["sink"]["problem_count"]
        verification = body["verification"]
        assert verification["failures"] >= 1
        breaks = verification["last_pass"]["breaks"]
        assert any(b["chain"] == "admin-test" and "is gone" in b["problem"] for b in breaks)
        assert any(b["chain"] == "checkpoint" and str(chain_file) in b["problem"] for b in breaks)
        assert verification["last_pass"]["break_count"] == len(breaks)
        async with runtime.engine.connect() as conn:
            assert await conn.scalar(select(func.count()).select_from(decisions)) == 4
