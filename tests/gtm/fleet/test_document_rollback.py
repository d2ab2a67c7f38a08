"""A node made to forget an activation (issue 31), refused: someone holding the database
password deletes or edits the newest signed document rows, or writes a hostile one, and
restarts a node. The node answers from the signed version it accepted, kept and verified on its
own disk; it says loudly that the database is behind; a malformed row never stops it starting.

On SQLite and on the real PostgreSQL (``database_url``), with two nodes on PostgreSQL. Rows are
published the way the admin service publishes them (:func:`shared_state.publish`, a manifest
signed by the document key), so these tests hold whatever the admin API looks like.

The observable: the demo's ``chat-eu`` service carries EU personal data. Activation 1 loosens
its policy (EU or US regions), activation 2 reverts that and goes further (eu-central only).
A US client is then answered from eu-central under activation 2, from us-east under 1, and
from eu-west under the node's own files: each rollback shows in one decision.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from gtm.admin.signer import Signer, generate, load_signer
from gtm.audit.schema import documents
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.fleet import shared_state
from gtm.fleet.signed_documents import Manifest, content_digest
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.waiting import eventually

US_CLIENT = "203.0.113.10"  # the test GeoIP database places it in Washington


def policy_texts(edit: Callable[[str, str], str] | None = None) -> dict[str, str]:
    texts = {p.name: p.read_text() for p in sorted(POLICIES.glob("*.yaml"))}
    return {n: edit(n, t) for n, t in texts.items()} if edit else texts


def _eu_rule(replacement: str) -> Callable[[str, str], str]:
    def edit(name: str, text: str) -> str:
        if name == "eu-personal.yaml":
            assert "jurisdictions: [EU]" in text
            return text.replace("jurisdictions: [EU]", replacement)
        return text

    return edit


LOOSE = policy_texts(_eu_rule("jurisdictions: [EU, US]"))  # activation 1: EU data to the US
EU_CENTRAL = policy_texts(_eu_rule("regions: [eu-central]"))  # activation 2: reverted, tighter
TOPOLOGY = DEMO.read_text()
FILES_ANSWER, LOOSE_ANSWER, STRICT_ANSWER = "eu-west", "us-east", "eu-central"


@dataclass
class Fleet:
    """Nodes on one database, trusting one document key, each with its own disk."""

    tmp_path: Path
    database_url: str
    geoip_path: Path
    signer: Signer
    public: Path

    def settings(self, node: str = "node-a") -> Settings:
        return Settings(
            config=DEMO,
            policies=(POLICIES,),
            geoip_path=self.geoip_path,
            database_url=self.database_url,
            spool_dir=self.tmp_path / node / "spool",
            node_id=node,
            probes=False,
            audit_flush_interval_s=0.05,
            state_sync_interval_s=0.2,
            document_keys=(self.public,),
            fleet_standalone_health=True,  # several nodes, no membership: on purpose here
        )

    @contextlib.asynccontextmanager
    async def node(self, name: str = "node-a") -> AsyncIterator[Runtime]:
        runtime = Runtime(self.settings(name))
        await runtime.start()
        try:
            yield runtime
        finally:
            await runtime.stop()

    def signed(self, policies: dict[str, str], sequence: int) -> tuple[bytes, str]:
        manifest = Manifest(
            version=content_digest(TOPOLOGY, policies),
            sequence=sequence,
            proposal=sequence,
            author="alice",
            approvers=("bob",),
            required=1,
            activated_at=time.time(),
            actor="bob",
            reason=f"activation {sequence}",
            key="",
        )
        return self.signer.sign(manifest)

    async def activate(self, engine: AsyncEngine, policies: dict[str, str], sequence: int) -> None:
        """Publish a signed version as the admin service does when it activates one."""
        body, signature = self.signed(policies, sequence)
        async with engine.begin() as conn:
            await shared_state.publish(
                conn,
                TOPOLOGY,
                policies,
                "fp",
                "bob",
                "activate",
                time.time(),
                manifest=body,
                signature=signature,
            )


@pytest.fixture
def fleet(tmp_path: Path, database_url: str, geoip_path: Path) -> Fleet:
    private, public = generate(tmp_path / "keys")
    return Fleet(tmp_path, database_url, geoip_path, load_signer(private), public)


def answer(runtime: Runtime, client: str = US_CLIENT) -> str | None:
    """Where the node sends this client's EU personal data now."""
    request = DecisionRequest(Channel.DNS, ip_address(client), "chat-eu", "chat-eu")
    return decide(request, runtime.store.current, time.time()).region


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _two_activations(fleet: Fleet, node: Runtime) -> str:
    """Activations 1 (loose) and 2 (eu-central only) in force on ``node``; its policy
    version."""
    assert answer(node) == FILES_ANSWER
    await fleet.activate(node.engine, LOOSE, 1)
    await node.sync.sync_once()
    assert answer(node) == LOOSE_ANSWER
    await fleet.activate(node.engine, EU_CENTRAL, 2)
    await node.sync.sync_once()
    assert node.document_sequence == 2
    assert answer(node) == STRICT_ANSWER
    return node.store.current.versions.policy


def _still_in_force(node: Runtime, policy: str) -> None:
    assert node.document_sequence == 2
    assert node.store.current.versions.policy == policy
    assert answer(node) == STRICT_ANSWER  # not us-east (activation 1), not eu-west (files)


@pytest.mark.parametrize("which", ["newest", "all"])
async def test_deleting_the_newest_document_rows_does_not_roll_a_restarted_node_back(
    fleet: Fleet, which: str
) -> None:
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
        engine = node.engine
        async with engine.begin() as conn:
            query = delete(documents)
            if which == "newest":
                query = query.where(documents.c.sequence == 2)
            await conn.execute(query)
    behind = _metric("gtm_documents_rollback_refused_total", kind="behind")
    with capture_logs() as logs:
        async with fleet.node() as restarted:  # same node, same disk
            _still_in_force(restarted, policy)
            for _ in range(3):
                await restarted.sync.sync_once()
            _still_in_force(restarted, policy)
            assert _metric("gtm_documents_database_diverged") == 1
    assert _metric("gtm_documents_rollback_refused_total", kind="behind") == behind + 1
    refused = [e for e in logs if e["event"] == "documents.database_refused"]
    assert len(refused) == 1 and refused[0]["log_level"] == "error", refused
    assert refused[0]["kind"] == "behind" and refused[0]["serving"] == 2


@pytest.mark.parametrize("column", ["policies", "manifest", "sequence_in_manifest"])
async def test_an_edited_newest_row_is_refused_and_the_restarted_node_keeps_serving(
    fleet: Fleet, column: str
) -> None:
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
        engine = node.engine
        async with engine.connect() as conn:
            row = (
                (await conn.execute(select(documents).where(documents.c.sequence == 2)))
                .mappings()
                .one()
            )
        manifest = orjson.loads(row["manifest"])
        changes: dict[str, Any] = {
            # The content swapped under the genuine record: EU data to the US.
            "policies": {"policies": LOOSE},
            # The record rewritten to approve the loose content (the signature no longer fits).
            "manifest": {
                "manifest": orjson.dumps(
                    {**manifest, "version": content_digest(TOPOLOGY, LOOSE)},
                    option=orjson.OPT_SORT_KEYS,
                ).decode(),
                "policies": LOOSE,
            },
            # The genuine record made to look older than activation 1.
            "sequence_in_manifest": {
                "manifest": orjson.dumps(
                    {**manifest, "sequence": 0}, option=orjson.OPT_SORT_KEYS
                ).decode(),
            },
        }[column]
        async with engine.begin() as conn:
            await conn.execute(update(documents).where(documents.c.id == row["id"]), changes)
    async with fleet.node() as restarted:
        _still_in_force(restarted, policy)
        assert _metric("gtm_documents_database_diverged") == 1


@pytest.mark.postgres
async def test_two_nodes_on_postgres_answer_one_policy_after_the_rows_are_deleted(
    tmp_path: Path, postgres_url: str, geoip_path: Path
) -> None:
    from gtm.audit import migrate

    migrate.downgrade(postgres_url, "base")
    migrate.upgrade(postgres_url)
    private, public = generate(tmp_path / "keys")
    fleet = Fleet(tmp_path, postgres_url, geoip_path, load_signer(private), public)
    async with fleet.node("node-b") as other:
        async with fleet.node("node-a") as node:
            policy = await _two_activations(fleet, node)
            await other.sync.sync_once()
            _still_in_force(other, policy)
            async with node.engine.begin() as conn:
                await conn.execute(delete(documents).where(documents.c.sequence == 2))
        # node-a restarts against the rolled-back database; node-b kept running.
        async with fleet.node("node-a") as restarted:
            await other.sync.sync_once()
            for runtime in (restarted, other):
                _still_in_force(runtime, policy)
            assert _metric("gtm_documents_database_diverged") == 1


async def _copy_of_newest(engine: AsyncEngine) -> dict[str, Any]:
    async with engine.connect() as conn:
        row = (
            (await conn.execute(select(documents).where(documents.c.sequence == 2)))
            .mappings()
            .one()
        )
    return {k: row[k] for k in row if k != "id"}


async def test_a_row_with_policies_as_a_json_string_does_not_stop_start_up(
    fleet: Fleet, database_url: str
) -> None:
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
        engine = node.engine
        genuine = await _copy_of_newest(engine)
        hostile = [
            # The valid copied signature, and policies a JSON string, not a mapping: claimed
            # as the newest sequence, so it is the first row a node reads.
            {**genuine, "sequence": 99, "policies": orjson.dumps(EU_CENTRAL).decode()},
            {**genuine, "sequence": 98, "policies": ["a", "list"]},
            {**genuine, "sequence": 97, "policies": {"default.yaml": 7}},
            {**genuine, "sequence": 96, "manifest": "{not json"},
            {**genuine, "sequence": 95, "manifest": "[1, 2]"},
            {**genuine, "sequence": 94, "manifest": '{"sequence": 1e999}'},
            {**genuine, "sequence": 93, "signature": "zz" * 64},
        ]
        async with engine.begin() as conn:
            await conn.execute(insert(documents), hostile)
            if database_url.startswith("sqlite"):
                # SQLite keeps whatever it is given, even text the JSON column cannot decode.
                await conn.execute(insert(documents), {**genuine, "sequence": 92, "policies": {}})
                await conn.execute(
                    text("UPDATE documents SET policies = '{oops' WHERE sequence = 92")
                )
                await conn.execute(
                    text("UPDATE documents SET published_at_us = 'x' WHERE sequence = 93")
                )
    malformed = _metric("gtm_documents_refused_total", reason="malformed")
    bad_manifest = _metric("gtm_documents_refused_total", reason="bad_manifest")
    # The same node restarted, and a new node that has only the database to go by.
    async with fleet.node() as restarted, fleet.node("node-new") as new:
        for runtime in (restarted, new):
            _still_in_force(runtime, policy)
    assert _metric("gtm_documents_refused_total", reason="malformed") >= malformed + 3
    assert _metric("gtm_documents_refused_total", reason="bad_manifest") >= bad_manifest + 3


async def test_a_fork_at_the_sequence_in_force_is_refused_loudly(fleet: Fleet) -> None:
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
        fork = _metric("gtm_documents_rollback_refused_total", kind="fork")
        # A second, validly signed record for sequence 2 (a restored admin database, say).
        await fleet.activate(node.engine, LOOSE, 2)
        await node.sync.sync_once()
        _still_in_force(node, policy)
        assert _metric("gtm_documents_database_diverged") == 1
        assert _metric("gtm_documents_rollback_refused_total", kind="fork") == fork + 1
        # A genuine next activation ends the episode.
        v3 = {**EU_CENTRAL, "default.yaml": EU_CENTRAL["default.yaml"] + "\n# v3\n"}
        await fleet.activate(node.engine, v3, 3)
        await node.sync.sync_once()
        assert node.document_sequence == 3 and answer(node) == STRICT_ANSWER
        assert _metric("gtm_documents_database_diverged") == 0


async def test_a_clean_restart_raises_no_alarm(fleet: Fleet) -> None:
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
    refused = _metric("gtm_documents_refused_total", reason="replayed")
    async with fleet.node() as restarted:
        _still_in_force(restarted, policy)
        assert _metric("gtm_documents_database_diverged") == 0
    assert _metric("gtm_documents_refused_total", reason="replayed") == refused


def _refused_total() -> float:
    total = 0.0
    for family in REGISTRY.collect():
        if family.name == "gtm_documents_refused":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


async def test_an_older_version_seen_again_is_no_alarm_a_row_that_does_not_verify_is(
    fleet: Fleet,
) -> None:
    """``gtm_documents_refused_total`` feeds the critical GTMDocumentsRefused: it must move for
    a row that does not verify, and not for a signed version that is merely old (a copy of an
    older row, rows renumbered by a restore or failover; the old code counted each as a
    refusal, ``replayed``). Neither comes into force."""
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
        async with node.engine.connect() as conn:
            old = (
                (await conn.execute(select(documents).where(documents.c.sequence == 1)))
                .mappings()
                .one()
            )
        refused, superseded = _refused_total(), _metric("gtm_documents_superseded_total")
        copy = {k: v for k, v in old.items() if k != "id"}
        async with node.engine.begin() as conn:
            await conn.execute(insert(documents), copy)  # the same signed version, a new row
        # Waited for, not counted exactly: the node's sync loop runs beside this test.
        await eventually(
            lambda: _metric("gtm_documents_superseded_total") > superseded, 30, "the copy seen"
        )
        _still_in_force(node, policy)
        assert _refused_total() == refused
        # A row whose signature does not verify: an alarm, and not in force either.
        forged = {**copy, "sequence": 3, "signature": "00" * 64}
        async with node.engine.begin() as conn:
            await conn.execute(insert(documents), forged)
        await eventually(lambda: _refused_total() > refused, 30, "the forged row refused")
        _still_in_force(node, policy)
    # A restart looks at every row again: history and the copy are no alarm; the forged row,
    # still there, is refused again (it is still wrong).
    refused, superseded = _refused_total(), _metric("gtm_documents_superseded_total")
    async with fleet.node() as restarted:
        _still_in_force(restarted, policy)
        assert _refused_total() > refused
    assert _metric("gtm_documents_superseded_total") == superseded
