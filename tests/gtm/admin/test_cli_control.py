"""The control plane from the command line: the signing key, the first token, and proposals
made and approved through the admin API as two different people."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gtm.admin import principals
from gtm.admin.permissions import Role
from gtm.admin.signer import PRIVATE_NAME, generate, load_signer
from gtm.audit.database import make_async_engine
from gtm.cli.control import rollout_lines
from gtm.control.log import ControlLog
from gtm.errors import ConfigError
from gtm.fleet import shared_state
from tests.conftest import DEMO, ROOT
from tests.gtm.admin.conftest import AdminFactory

GTM = [sys.executable, "-m", "gtm"]


def gtm(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GTM, *args],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path: Path) -> None:
    out = gtm(["admin", "keygen", str(tmp_path / "keys")])
    assert out.returncode == 0, out.stderr
    private = tmp_path / "keys" / PRIVATE_NAME
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    again = gtm(["admin", "keygen", str(tmp_path / "keys")])
    assert again.returncode == 2 and "never replaced" in again.stderr
    load_signer(private)  # loads
    private.chmod(0o644)
    with pytest.raises(ConfigError, match="must be 0600"):
        load_signer(private)


async def test_the_first_token_is_made_on_the_node_and_recorded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.sqlite3'}"
    args = ["token", "create", "--name", "root", "--role", "admin", "--expires", "90d"]
    # Database access alone makes no token: it takes the admin service's key.
    keyless = await asyncio.to_thread(gtm, args, GTM_DATABASE_URL=url)
    assert keyless.returncode == 2 and "GTM_DOCUMENT_SIGNING_KEY" in keyless.stderr
    private, _ = generate(tmp_path / "keys")
    out = await asyncio.to_thread(
        gtm, args, GTM_DATABASE_URL=url, GTM_DOCUMENT_SIGNING_KEY=str(private)
    )
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert token.startswith("gtm_") and "shown once" in out.stderr
    engine = make_async_engine(url)
    try:
        principal = await principals.authenticate(
            engine, token, 0, ControlLog({}, (k := load_signer(private)), public=k.public_key())
        )
        assert principal is not None and principal.roles == {Role.ADMIN}
        events = await shared_state.read_events(engine, "-", 10)
        assert any(e.kind == "token" and (e.actor or "").startswith("local:") for e in events)
        assert any(e.kind == "principal" for e in events)
    finally:
        await engine.dispose()
    # The same name with other roles is refused rather than changed.
    other = await asyncio.to_thread(
        gtm,
        ["token", "create", "--name", "root", "--role", "viewer"],
        GTM_DATABASE_URL=url,
        GTM_DOCUMENT_SIGNING_KEY=str(private),
    )
    assert other.returncode == 2 and "roles are not changed here" in other.stderr


async def test_a_proposal_through_the_cli_needs_a_second_person(
    start_admin: AdminFactory, tmp_path: Path
) -> None:
    async with start_admin() as admin:
        alice = await admin.token("alice", Role.POLICY_AUTHOR)
        bob = await admin.token("bob", Role.POLICY_APPROVER)
        policies = tmp_path / "policies"
        policies.mkdir()
        for p in (ROOT / "policies").glob("*.yaml"):
            text = p.read_text()
            if p.name == "eu-personal.yaml":
                text = text.replace("jurisdictions: [EU]", "jurisdictions: [EU, US]")
            (policies / p.name).write_text(text)
        as_alice = {"GTM_ADMIN_URL": admin.url, "GTM_ADMIN_TOKEN": alice}
        as_bob = {"GTM_ADMIN_URL": admin.url, "GTM_ADMIN_TOKEN": bob}
        made = await asyncio.to_thread(
            gtm,
            ["proposal", "create", "--why", "US clients", "--config", str(DEMO),
             "--policies", str(policies)],
            **as_alice,
        )  # fmt: skip
        assert made.returncode == 0, made.stdout + made.stderr
        assert made.stdout.startswith("#1 proposed by alice: US clients")
        version = made.stdout.split("version ")[1].split()[0]
        shown = await asyncio.to_thread(gtm, ["proposal", "show", "1"], **as_bob)
        assert "+    - US" in shown.stdout
        impact = await asyncio.to_thread(
            gtm, ["proposal", "impact", "1", "--since", "1h"], **as_bob
        )
        assert impact.returncode == 0 and "LEAVE THEIR JURISDICTION" in impact.stdout
        own = await asyncio.to_thread(
            gtm, ["proposal", "approve", "1", "--version", version], **as_alice
        )
        assert own.returncode == 1 and "403 forbidden" in own.stderr
        approved = await asyncio.to_thread(
            gtm, ["proposal", "approve", "1", "--version", version], **as_bob
        )
        assert approved.returncode == 0 and "#1 approved" in approved.stdout
        active = await asyncio.to_thread(gtm, ["proposal", "activate", "1"], **as_bob)
        assert active.returncode == 0 and "sequence 1" in active.stdout
        assert "in force on every member" in active.stdout
        assert active.stdout.rstrip().endswith(": admin-test")
        unset = await asyncio.to_thread(gtm, ["proposal", "list"], GTM_ADMIN_URL="")
        assert unset.returncode == 2 and "GTM_ADMIN_TOKEN" in unset.stderr


async def test_region_controls_from_the_cli_are_the_tokens_principal(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        olga = await admin.token("olga", Role.OPERATOR)
        env = {
            "GTM_ADMIN_URL": admin.url,
            "GTM_ADMIN_TOKEN": olga,
            "GTM_DATABASE_URL": admin.runtime.settings.database_url,
            # `region status` reads overrides from the verified control log: the public key.
            "GTM_DOCUMENT_KEYS": json.dumps([str(admin.keys / "document-signing.pub")]),
        }

        async def run(*args: str) -> subprocess.CompletedProcess[str]:
            return await asyncio.to_thread(gtm, list(args), **env)

        drained = await run("region", "drain", "eu-west", "--why", "maintenance")
        assert drained.returncode == 0, drained.stderr
        assert drained.stdout.strip() == "eu-west: drained"
        # The last EU region: refused by the safety rules (exit 1, every rule said).
        refused = await run("region", "drain", "eu-central", "--why", "x")
        assert refused.returncode == 1 and "eu-personal" in refused.stderr
        no_expiry = await run("region", "force", "us-east", "down", "--why", "x")
        assert no_expiry.returncode == 2 and "needs an expiry" in no_expiry.stderr
        forced = await run("region", "force", "us-east", "down", "--why", "bad", "--for", "10m")
        assert forced.stdout.strip() == "us-east: forced down"
        unknown = await run("region", "drain", "atlantis", "--why", "x")
        assert unknown.returncode == 2 and "no region 'atlantis'" in unknown.stderr
        # Who made the change is the token's principal; there is no flag to say otherwise.
        claimed = await run("region", "drain", "us-west", "--why", "x", "--who", "someone-else")
        assert claimed.returncode == 2
        await admin.runtime.sync.sync_once()  # the node has the drain, and says so
        status = json.loads((await run("region", "status", "--json")).stdout)
        by_region = {row["region"]: row for row in status}
        assert by_region["eu-west"]["override_by"] == "olga: maintenance"
        assert by_region["eu-west"]["in_force"] == {"admin-test": "draining"}
        await run("region", "undrain", "eu-west", "--why", "done")
        lines = (await run("region", "events", "--region", "eu-west")).stdout.splitlines()
        events = [e for e in lines if " override " in e]  # not the node's own state changes
        assert "cleared by olga: done" in events[0]
        assert "set: drained by olga: maintenance" in events[1]


def test_an_incomplete_rollout_names_each_pending_and_fenced_member() -> None:
    lines = rollout_lines(
        {
            "membership": "3 members (GTM_HEALTH_MEMBERS)",
            "acknowledged": ["node-a"],
            "pending": {"node-b": 4, "node-c": None},
            "silent": {"node-b": 1_795_000_000.0, "node-c": None},
            "fenced": {"node-d": 1_795_000_060.0},
        }
    )
    assert lines[0] == "  NOT in force on every member (3 members (GTM_HEALTH_MEMBERS))"
    assert "  in force on: node-a" in lines
    assert any(line.startswith("  PENDING  node-b: has 4, silent since 20") for line in lines)
    assert "  PENDING  node-c: has no version, never reported" in lines
    fenced = [line for line in lines if line.startswith("  FENCED   node-d:")]
    assert len(fenced) == 1 and "closed since 20" in fenced[0]
