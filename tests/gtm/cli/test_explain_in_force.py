"""``gtm explain`` and its what-if answer with the version in force (issue 31: after an
activation, explain still answered from the local files, contradicting every node, with no
warning). ``--files`` asks for the local files, and says that they differ."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from sqlalchemy import delete

from gtm.admin.signer import generate, load_signer
from gtm.audit import migrate
from gtm.audit.database import make_async_engine
from gtm.audit.schema import documents
from gtm.fleet import shared_state
from gtm.fleet.signed_documents import Manifest, content_digest
from tests.gtm.cli.test_cli import env, run
from tests.gtm.fleet.test_document_rollback import EU_CENTRAL, TOPOLOGY

__all__ = ["env"]  # the fixture, shared

US_CLIENT = "203.0.113.8"  # Washington: eu-west under the files, eu-central in force
EXPLAIN = ["explain", "--client", US_CLIENT, "--name", "chat.eu.gtm.example", "--json"]


@pytest.fixture
async def in_force(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Activation 1 (EU personal data served from eu-central only) published, signed, in the
    database the environment names; the environment trusts its key."""
    url = env["GTM_DATABASE_URL"]
    await asyncio.to_thread(migrate.upgrade, url)
    private, public = generate(tmp_path / "keys")
    signer = load_signer(private)
    body, signature = signer.sign(
        Manifest(
            content_digest(TOPOLOGY, EU_CENTRAL), 1, 1, "alice", ("bob",), 1, time.time(),
            "bob", "eu-central only", "",
        )
    )  # fmt: skip
    engine = make_async_engine(url)
    try:
        async with engine.begin() as conn:
            await shared_state.publish(
                conn, TOPOLOGY, EU_CENTRAL, "fp", "bob", "r", time.time(),
                manifest=body, signature=signature,
            )  # fmt: skip
    finally:
        await engine.dispose()
    return env | {"GTM_DOCUMENT_KEYS": json.dumps([str(public)])}


def test_explain_answers_with_the_version_in_force(in_force: dict[str, str]) -> None:
    out = run(EXPLAIN, in_force)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["region"] == "eu-central"  # as every node answers, not eu-west from the files
    assert d["documents"]["sequence"] == 1
    assert "local files" in out.stderr and "differ" in out.stderr
    text = run(EXPLAIN[:-1], in_force)
    assert "-> eu-central" in text.stdout
    assert "the version in force, sequence 1" in text.stdout


def test_explain_files_says_the_files_differ_from_the_version_in_force(
    in_force: dict[str, str],
) -> None:
    out = run([*EXPLAIN, "--files"], in_force)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["region"] == "eu-west" and d["documents"] == {"source": "files", "sequence": None}
    assert "DIFFER from the version in force (sequence 1" in out.stderr


def test_what_if_uses_the_version_in_force(in_force: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state.yaml"
    state.write_text("health: {eu-central: down}\n")
    out = run([*EXPLAIN, "--state", str(state)], in_force)
    assert out.returncode == 0, out.stderr
    # eu-central is the only region allowed: with it down, EU personal data is refused.
    assert json.loads(out.stdout)["outcome"] == "fail_closed"
    files = run([*EXPLAIN, "--state", str(state), "--files"], in_force)
    assert json.loads(files.stdout)["region"] == "eu-west"


def test_explain_refuses_an_unverified_version_and_says_so(in_force: dict[str, str]) -> None:
    # Without the key, nothing in the database verifies: the files, with a warning.
    untrusted = in_force | {"GTM_DOCUMENT_KEYS": "[]"}
    out = run(EXPLAIN, untrusted)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["region"] == "eu-west"
    assert "refused (no_keys)" in out.stderr and "GTM_DOCUMENT_KEYS" in out.stderr


async def test_explain_on_a_node_uses_its_copy_when_the_database_was_rolled_back(
    in_force: dict[str, str], geoip_path: Path
) -> None:
    from gtm.runtime import Runtime
    from gtm.settings import load_settings

    settings = load_settings(
        config=Path(in_force["GTM_CONFIG"]),
        policies=tuple(Path(p) for p in json.loads(in_force["GTM_POLICIES"])),
        geoip_path=geoip_path,
        database_url=in_force["GTM_DATABASE_URL"],
        spool_dir=Path(in_force["GTM_SPOOL_DIR"]),
        node_id="cli-node",
        probes=False,
        document_keys=tuple(Path(p) for p in json.loads(in_force["GTM_DOCUMENT_KEYS"])),
    )
    node = Runtime(settings)
    await node.start()  # accepts activation 1 and keeps a copy on its disk
    try:
        assert node.document_sequence == 1
        async with node.engine.begin() as conn:
            await conn.execute(delete(documents))
    finally:
        await node.stop()
    out = run(EXPLAIN, in_force)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["region"] == "eu-central" and d["documents"]["sequence"] == 1
    assert d["documents"]["source"].startswith("local copy")
    assert "below this node's copy" in out.stderr
