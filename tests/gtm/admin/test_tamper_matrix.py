"""The tamper matrix (issue 31), generated from the schema like the role matrix is from the
permissions table: for every table in ``gtm.audit.schema.metadata`` and every operation someone
holding the database password can do to it (insert a forged row, update each column of the
newest row, delete the newest row, delete a middle row, put an older row's values back over the
newest, truncate) the expected result is one of:

* ``unchanged``: nothing any node answers, nobody's authority and no proposal changes (the
  table is a cache of the signed control log, or signed rows are refused);
* ``named``: nothing changes either, and ``gtm audit verify`` (or the control log's check
  against its checkpoints) reports it, with its location.

A table or column the schema has and :data:`EXPECT` does not fails the test: a new table cannot
be added without saying what tampering with it does. Each operation is applied to a populated
store under a running node, the node syncs, the outcome is observed, and the operation is undone
before the next one, so one node serves the whole matrix. It runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any

import pytest
from sqlalchemy import Table, UniqueConstraint, and_, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.admin import lifecycle, principals
from gtm.admin.permissions import Role
from gtm.audit.event_chain import HASHED as EVENT_HASHED
from gtm.audit.record import HASHED_COLUMNS, record_of
from gtm.audit.schema import metadata
from gtm.audit.verify import verify
from gtm.control.anchor import ControlAnchor, sink_checkpoints, verify_control_log
from gtm.control.log import ControlLog
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.runtime import Runtime
from tests.gtm.admin.conftest import Admin, AdminFactory, loosen_eu
from tests.gtm.admin.conftest import documents as demo_documents
from tests.support.postgres import postgres_database
from tests.support.tamper import triggers_off

UNCHANGED, NAMED = "unchanged", "named"
OPERATIONS = ("insert", "update", "delete_newest", "delete_middle", "put_back_older", "truncate")


@dataclass(frozen=True)
class Expect:
    """What tampering with a table does: ``outcome`` for every operation, ``columns`` for an
    update of one column where it differs (every column must be listed: a new one fails)."""

    outcome: str
    why: str
    columns: dict[str, str] = field(default_factory=dict)


def _all(outcome: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, outcome)


EXPECT: dict[str, Expect] = {
    # The chains' own tables of what their hashes cover, plus the link columns: a column added
    # to a table and not to its chain's list has no entry, and fails the test below.
    "decisions": Expect(
        NAMED,
        "keyed, hash-chained per node, checkpointed outside the database",
        {"id": UNCHANGED, **_all(NAMED, *HASHED_COLUMNS, "prev_hash", "row_hash")},
    ),
    "region_events": Expect(
        NAMED,
        "the keyed event chain, checkpointed outside the database",
        {
            "id": UNCHANGED,  # a surrogate key: no evidence in it
            **_all(NAMED, *EVENT_HASHED, "prev_hash", "row_hash", "key_id", "signature"),
        },
    ),
    "event_chain": Expect(UNCHANGED, "the appenders' lock; heads are checkpointed by writers"),
    "health_observations": Expect(
        UNCHANGED, "signed by their node; this node rewrites its own on every sync"
    ),
    "region_overrides": Expect(UNCHANGED, "a cache of the control log's override entries"),
    "documents": Expect(UNCHANGED, "signed manifests; the node keeps its accepted copy"),
    "node_status": Expect(UNCHANGED, "what nodes report; nothing answers from it"),
    "principals": Expect(UNCHANGED, "a cache of the control log"),
    "api_tokens": Expect(UNCHANGED, "a cache of the control log (last use: for people)"),
    "document_versions": Expect(UNCHANGED, "content-addressed; activation names the hash"),
    "proposals": Expect(UNCHANGED, "a cache of the control log"),
    "approvals": Expect(UNCHANGED, "a cache of the control log"),
    "audit_store": Expect(
        NAMED,
        "checkpoints outside the database name their store",
        {"id": NAMED, "created_at_us": UNCHANGED},  # when it was made is no evidence
    ),
    "audit_checkpoints": Expect(UNCHANGED, "the database's copy; verify trusts the sink's"),
    "capacity_marks": Expect(UNCHANGED, "replay marks; the running node holds its own"),
    "control_log": Expect(
        NAMED,
        "signed entries; readers keep the last good state; checkpointed outside",
        {
            # A rewritten stored hash alone is caught by readers and verify alike; every other
            # column is under the signature.
            **_all(
                NAMED,
                "seq",
                "prev_hash",
                "at_us",
                "kind",
                "principal",
                "body",
                "key_id",
                "signature",
                "entry_hash",
            ),
        },
    ),
    "control_head": Expect(UNCHANGED, "the appenders' lock: a wrong head refuses appends"),
}


def test_every_table_and_column_has_an_entry() -> None:
    tables = {t.name: t for t in metadata.sorted_tables}
    assert tables.keys() - EXPECT.keys() == set(), "tables without a tamper expectation"
    assert EXPECT.keys() - tables.keys() == set(), "expectations without a table"
    for name, expect in EXPECT.items():
        if expect.columns:
            columns = {c.name for c in tables[name].columns}
            assert columns == expect.columns.keys(), (name, columns ^ expect.columns.keys())


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None
    else:
        with postgres_database() as url:
            yield url


PROBES = (("198.51.100.7", "chat-eu"), ("203.0.113.9", "chat"), ("81.2.69.142", "chat-eu"))


@dataclass(frozen=True)
class Seen:
    answers: tuple[Any, ...]
    authority: tuple[Any, ...]
    breaks: frozenset[tuple[str, int]]
    unanchored: tuple[tuple[str, int], ...]


class World:
    """A populated store under one running node, and how to look at it."""

    def __init__(self, admin: Admin, tokens: dict[str, str], control: ControlLog) -> None:
        self.admin = admin
        self.runtime: Runtime = admin.runtime
        self.tokens = tokens
        self.control = control

    async def seen(self, evidence: bool = True) -> Seen:
        """What the node answers and who may do what; with ``evidence``, what verify says."""
        rt, engine, now = self.runtime, self.runtime.engine, time.time()
        await rt.sync.sync_once()
        snap = rt.store.current
        routed = [
            decide(DecisionRequest(Channel.DNS, ip_address(ip), svc, svc), snap, now).region
            for ip, svc in PROBES
        ]
        answers = (
            *routed,
            tuple(sorted((r, h.state.value) for r, h in snap.health.items())),
            tuple(sorted((r, v.weight) for r, v in snap.regions.items())),
            rt.document_sequence,
            snap.policy.version,
        )
        await self.control.refresh(engine)
        authority: list[Any] = []
        for name, token in sorted(self.tokens.items()):
            who = await principals.authenticate(engine, token, now, self.control)
            authority.append((name, None if who is None else sorted(who.roles)))
        async with engine.connect() as conn:
            authority.append(
                tuple(
                    (p.id, p.state, p.version, p.author, tuple(a.approver for a in p.approvals))
                    for p in await lifecycle.list_all(conn, self.control)
                )
            )
        authority.append(tuple(sorted(self.control.good.overrides)))
        if not evidence:
            return Seen(answers, tuple(authority), frozenset(), ())
        result = await verify(engine, rt.checkpoint_sink)
        checkpoints, bad = sink_checkpoints(rt.checkpoint_sink)
        _, control_breaks = await verify_control_log(engine, rt.document_keys, checkpoints)
        self.problems = [*result.breaks, *bad, *control_breaks]
        breaks = {(b.node, b.node_seq) for b in self.problems}
        return Seen(
            answers, tuple(authority), frozenset(breaks), tuple(sorted(result.unanchored.items()))
        )


async def _populate(admin: Admin) -> World:
    runtime = admin.runtime
    tokens = {
        "root": await admin.token("root", Role.ADMIN),
        "alice": await admin.token("alice", Role.POLICY_AUTHOR),
        "bob": await admin.token("bob", Role.POLICY_APPROVER),
        "olga": await admin.token("olga", Role.OPERATOR),
    }
    strict = demo_documents(lambda n, t: t + "\n# reviewed\n" if n == "default.yaml" else t)
    async with admin.client(tokens["alice"]) as a, admin.client(tokens["bob"]) as b:
        for docs in (strict, demo_documents(loosen_eu)):
            p = (await a.post("/v1/proposals", json={**docs, "reason": "r"})).json()
            await a.post(f"/v1/proposals/{p['id']}/submit")
        # The first in force; the second (EU data to the US) waits for review.
        first = (await b.get("/v1/proposals/1")).json()
        await b.post("/v1/proposals/1/approve", json={"version": first["version"]})
        assert (await b.post("/v1/proposals/1/activate")).status_code == 200
    async with admin.client(tokens["olga"]) as o:
        r = await o.post("/v1/regions/us-west/drain", json={"reason": "maintenance"})
        assert r.status_code == 200, r.text
    await runtime.sync.sync_once()
    for ip, svc in PROBES * 3:
        decision = decide(
            DecisionRequest(Channel.DNS, ip_address(ip), svc, svc),
            runtime.store.current,
            time.time(),
        )
        runtime.writer.count(record_of(decision, channel="dns", name=f"{svc}.gtm.example."), 1)
        await runtime.writer.flush()
    await runtime.anchor.checkpoint("checkpoint")
    control = ControlLog(
        runtime.document_keys, mark=runtime.settings.spool_dir.parent / "state" / "matrix.json"
    )
    anchor = ControlAnchor(
        control, runtime.checkpoint_sink, runtime.spool.key, runtime.spool.bound_store
    )
    await control.refresh(runtime.engine)
    await anchor.checkpoint_if_moved()
    return World(admin, tokens, control)


def _pk(table: Table) -> list[str]:
    return [c.name for c in table.primary_key.columns]


def _unique(table: Table) -> set[str]:
    """The columns a copied row must change to be a new row: keys and unique columns."""
    names = set(_pk(table)) | {c.name for c in table.columns if c.unique}
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            names |= {c.name for c in constraint.columns}
    return names


def _mutated(value: Any, column: Any) -> Any:
    """A different value of the column's kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, list):
        return [*value, "forged"]
    if isinstance(value, dict):
        return {**value, "forged": "forged"}
    if isinstance(value, str):
        length = getattr(column.type, "length", None) or 64
        return (value[: length - 1] + ("0" if value[-1:] != "0" else "1")) if value else "f"
    python = getattr(column.type, "python_type", str)
    return {int: 7, float: 0.5, bool: True, str: "f", list: ["forged"], dict: {"f": 1}}.get(
        python, "f"
    )


async def _rows(conn: AsyncConnection, table: Table) -> list[dict[str, Any]]:
    order = [table.c[c] for c in _pk(table)]
    return [dict(r._mapping) for r in await conn.execute(select(table).order_by(*order))]


def _where(table: Table, row: dict[str, Any]) -> Any:
    return and_(*(table.c[c] == row[c] for c in _pk(table)))


Undo = list[tuple[str, dict[str, Any]]]  # ("drop", row) or ("restore", row)


async def _apply(world: World, table: Table, op: str, column: str | None) -> Undo | None:
    """Apply one operation; how to undo it, or None when it does not apply."""
    async with world.runtime.engine.begin() as conn:
        await triggers_off(conn)
        rows = await _rows(conn, table)
        if not rows:
            return None  # nothing to copy, change or remove (an empty table)
        newest = rows[-1]
        if op == "insert":
            forged = dict(newest)
            for c in _unique(table):  # a new row, not a clash with the one it copies
                forged[c] = _mutated(forged[c], table.c[c])
            await conn.execute(insert(table), forged)
            return [("drop", forged)]
        if op == "update":
            assert column is not None
            value = _mutated(newest[column], table.c[column])
            await conn.execute(update(table).where(_where(table, newest)).values({column: value}))
            return [("drop", {**newest, column: value}), ("restore", newest)]
        if op in ("delete_newest", "delete_middle"):
            if op == "delete_middle" and len(rows) < 3:
                return None
            victim = rows[-1] if op == "delete_newest" else rows[len(rows) // 2]
            await conn.execute(delete(table).where(_where(table, victim)))
            return [("restore", victim)]
        if op == "put_back_older":
            # The oldest row's content over the newest, under the newest's keys.
            older = {k: v for k, v in rows[0].items() if k not in _unique(table)}
            if len(rows) < 2 or not older:
                return None
            await conn.execute(update(table).where(_where(table, newest)).values(older))
            return [("restore", newest)]
        assert op == "truncate"
        await conn.execute(delete(table))
        return [("restore", row) for row in rows]


async def _undo(world: World, table: Table, undo: Undo) -> None:
    """Back to the rows as they were; a row the node rewrote meanwhile (its own status, its
    observations) is replaced by the one saved, which the node rewrites again on its next sync."""
    async with world.runtime.engine.begin() as conn:
        await triggers_off(conn)
        for what, row in undo:
            await conn.execute(delete(table).where(_where(table, row)))
            if what == "restore":
                for constraint in table.constraints:
                    if isinstance(constraint, UniqueConstraint):
                        cols = [c.name for c in constraint.columns]
                        await conn.execute(
                            delete(table).where(and_(*(table.c[c] == row[c] for c in cols)))
                        )
                for c in table.columns:
                    if c.unique and not c.primary_key:
                        await conn.execute(delete(table).where(table.c[c.name] == row[c.name]))
                await conn.execute(insert(table), row)


async def test_tamper_matrix(start_admin: AdminFactory, database_url: str | None) -> None:
    async with start_admin(database_url=database_url) as admin:
        world = await _populate(admin)
        baseline = await world.seen()
        assert baseline.breaks == frozenset(), world.problems
        tables = {t.name: t for t in metadata.sorted_tables}
        cases: list[tuple[str, str, str | None]] = []
        for name, table in tables.items():
            for op in OPERATIONS:
                if op == "update":
                    cases += [(name, op, c.name) for c in table.columns]
                else:
                    cases.append((name, op, None))
        failures: list[str] = []
        ran = 0
        for name, op, column in cases:
            expect = EXPECT[name]
            outcome = expect.columns.get(column, expect.outcome) if column else expect.outcome
            undo = await _apply(world, tables[name], op, column)
            if undo is None:
                continue  # nothing to do that to (an empty table, one row)
            ran += 1
            try:
                seen = await world.seen()
            finally:
                await _undo(world, tables[name], undo)
            case = f"{name}.{op}{'.' + column if column else ''}"
            if seen.answers != baseline.answers:
                failures.append(f"{case}: answers changed {baseline.answers} -> {seen.answers}")
            if seen.authority != baseline.authority:
                failures.append(f"{case}: authority changed")
            named = seen.breaks != baseline.breaks or seen.unanchored != baseline.unanchored
            if outcome == NAMED and not named:
                failures.append(f"{case}: verify said nothing")
            after = await world.seen(evidence=False)
            if after.answers != baseline.answers or after.authority != baseline.authority:
                failures.append(f"{case}: not back to the baseline after the undo")
        # And the whole store wiped under a new id: every decision, event, checkpoint copy
        # and control-log entry gone, the heads reset, the store renamed.
        async with admin.runtime.engine.begin() as conn:
            await triggers_off(conn)
            for name in ("decisions", "region_events", "audit_checkpoints", "control_log"):
                await conn.execute(delete(tables[name]))
            await conn.execute(update(tables["event_chain"]).values(seq=0, last_hash="0" * 64))
            await conn.execute(update(tables["control_head"]).values(seq=0, last_hash="0" * 64))
            await conn.execute(update(tables["audit_store"]).values(id="wiped-and-new"))
        ran += 1
        wiped = await world.seen()
        if wiped.answers != baseline.answers or wiped.authority != baseline.authority:
            failures.append("wipe: answers or authority changed")
        named = {chain for chain, _ in wiped.breaks}
        for chain in ("control_log", "region_events"):
            if chain not in named:
                failures.append(f"wipe: verify did not name {chain}: {world.problems}")
        if not any(c not in ("control_log", "region_events") for c in named):
            failures.append(f"wipe: verify named no decision chain: {world.problems}")
        print(f"tamper matrix: {ran} cases over {len(tables)} tables")
        assert failures == [], "\n".join(failures)
