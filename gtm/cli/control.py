"""The control plane from the command line.

``gtm token create|revoke`` and ``gtm admin keygen|openapi`` run on a node with database access
(``token create`` is how the first principal comes to exist: the only path that needs no token,
and it is recorded as an event). ``gtm proposal ...`` is a client of the admin API
(``GTM_ADMIN_URL``, ``GTM_ADMIN_TOKEN``): the principal is the token's, never a flag.
"""

from __future__ import annotations

import getpass
import json
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gtm.admin.permissions import Role
from gtm.cli.admin_client import call, call_or_refusal
from gtm.cli.common import (
    ConfigOpt,
    DbOpt,
    PoliciesOpt,
    cli_settings,
    fail,
    human_time,
    run_async,
)
from gtm.errors import ConfigError, GTMError

# The admin service, the database and the documents are imported by the commands that use
# them: `gtm proposal ...` is a client of the admin API and needs none of them to start.
if TYPE_CHECKING:
    from gtm.control.log import ControlLog
    from gtm.settings import Settings

token_app = typer.Typer(help="API tokens of the admin API.", no_args_is_help=True)
admin_app = typer.Typer(help="The admin service: signing keys, OpenAPI.", no_args_is_help=True)
proposal_app = typer.Typer(
    help="Policy and topology changes through the admin API (four-eyes).", no_args_is_help=True
)


# -- tokens (database access) ------------------------------------------------------------------


def _control(settings: Settings) -> ControlLog:
    """Principals and tokens are entries of the control log, signed with the admin service's
    key: database access alone makes neither. The key file's holder writes as ``bootstrap``."""
    from gtm.admin.signer import load_signer
    from gtm.control.log import ControlLog
    from gtm.fleet.signed_documents import load_public_keys

    if settings.document_signing_key is None:
        raise fail(
            GTMError(
                "set GTM_DOCUMENT_SIGNING_KEY (the admin service's key): tokens and principals "
                "are sealed with it, and database access alone makes neither"
            )
        )
    try:
        signer = load_signer(settings.document_signing_key)
        keys = load_public_keys(settings.document_keys)
    except ConfigError as exc:
        raise fail(exc) from exc
    return ControlLog(keys, signer, public=signer.public_key())


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option("--name", help="the principal")],
    role: Annotated[list[Role], typer.Option("--role", help="a role (repeatable)")],
    expires: Annotated[str | None, typer.Option("--expires", help="e.g. 90d; none: never")] = None,
    database_url: DbOpt = None,
) -> None:
    """Create principal NAME with its roles (or, if it exists with them, a new token for it)
    and print the token once."""
    from gtm.admin import principals
    from gtm.audit import migrate
    from gtm.audit.database import make_async_engine
    from gtm.fleet.operator import parse_duration

    settings = cli_settings(database_url=database_url)
    try:
        lifetime = None if expires is None else parse_duration(expires)
    except ValueError as exc:
        raise fail(GTMError(str(exc))) from exc
    control = _control(settings)
    migrate.upgrade(settings.database_url)
    # Who ran it, as the operating system says: there is no token yet to say it.
    actor = f"local:{getpass.getuser()}@{socket.gethostname()}"

    async def main() -> str:
        engine = make_async_engine(settings.database_url)
        now = time.time()
        try:
            await control.refresh(engine)
            async with engine.begin() as conn:
                principal = await principals.by_name(conn, name, control)
                if principal is None:
                    principal = await principals.create(
                        conn,
                        name,
                        role,
                        created_by=actor,
                        now=now,
                        node=settings.node_id,
                        control=control,
                    )
                elif principal.roles != frozenset(role):
                    raise GTMError(
                        f"{name} exists with roles {', '.join(sorted(principal.roles))}; "
                        "roles are not changed here"
                    )
                token = await principals.issue_token(
                    conn,
                    principal,
                    created_by=actor,
                    now=now,
                    expires_at=None if lifetime is None else now + lifetime,
                    node=settings.node_id,
                    control=control,
                )
            return token.text
        finally:
            await engine.dispose()

    try:
        text = run_async(main)
    except GTMError as exc:
        raise fail(exc) from exc
    typer.echo(text)
    typer.echo("(shown once: only its hash is kept)", err=True)


@token_app.command("revoke")
def token_revoke(token_id: str, database_url: DbOpt = None) -> None:
    """Revoke token TOKEN_ID (the 16 hex digits after ``gtm_``)."""
    from gtm.admin import principals
    from gtm.audit import migrate
    from gtm.audit.database import make_async_engine

    settings = cli_settings(database_url=database_url)
    control = _control(settings)
    migrate.upgrade(settings.database_url)
    actor = f"local:{getpass.getuser()}@{socket.gethostname()}"

    async def main() -> bool:
        engine = make_async_engine(settings.database_url)
        try:
            await control.refresh(engine)
            async with engine.begin() as conn:
                return await principals.revoke(
                    conn,
                    token_id,
                    actor=actor,
                    now=time.time(),
                    node=settings.node_id,
                    control=control,
                )
        finally:
            await engine.dispose()

    if not run_async(main):
        raise fail(GTMError(f"no live token {token_id}"))
    typer.echo(f"revoked {token_id}")


# -- the admin service -------------------------------------------------------------------------


@admin_app.command("keygen")
def admin_keygen(directory: Path) -> None:
    """Make the document signing key pair in DIRECTORY (the private key 0600)."""
    from gtm.admin import signer

    try:
        private, public = signer.generate(directory)
    except FileExistsError as exc:
        raise fail(GTMError(f"{exc.filename} exists: a key nodes trust is never replaced")) from exc
    typer.echo(f"private key: {private} (GTM_DOCUMENT_SIGNING_KEY on admin nodes)")
    typer.echo(f"public key:  {public} (GTM_DOCUMENT_KEYS on every node)")


def openapi_document() -> dict[str, Any]:
    """The admin API's OpenAPI document (no database is touched to build it)."""
    from gtm.admin.app import create_app
    from gtm.admin.auth import AdminContext
    from gtm.audit.database import make_async_engine
    from gtm.control.log import ControlLog

    context = AdminContext(make_async_engine("sqlite:///:memory:"), "openapi", 1, ControlLog({}))
    app = create_app(context)
    return app.openapi()


@admin_app.command("openapi")
def admin_openapi() -> None:
    """Print the admin API's OpenAPI document (checked in as gtm/admin/openapi.json)."""
    typer.echo(json.dumps(openapi_document(), indent=2, sort_keys=True))


# -- proposals (admin API client) --------------------------------------------------------------


def _show(p: dict[str, Any]) -> None:
    approvals = ", ".join(a["approver"] for a in p["approvals"]) or "none"
    typer.echo(
        f"#{p['id']} {p['state']} by {p['author']}: {p['reason']}\n"
        f"  version {p['version']}\n"
        f"  created {human_time(p['created_at'])}\n"
        f"  approvals ({len(p['approvals'])} of {p['required_approvals']}): {approvals}"
        + (
            f"\n  active since {human_time(p['activated_at'])}, sequence {p['sequence']}"
            if p["sequence"]
            else ""
        )
        + (
            f"\n  scheduled for {human_time(p['activate_at'])}"
            if p.get("activate_at") and not p["sequence"]
            else ""
        )
    )


@proposal_app.command("create")
def proposal_create(
    why: Annotated[str, typer.Option("--why", help="the reason, recorded with every step")],
    config: ConfigOpt = None,
    policies: PoliciesOpt = None,
    submit: Annotated[bool, typer.Option(help="propose it at once")] = True,
) -> None:
    """Draft the topology and policy files as a new version (validated here and again by the
    admin service), and propose it for approval."""
    from gtm.decision.bundle import load_documents
    from gtm.decision.policy import policy_files

    settings = cli_settings(config=config, policies=policies)
    try:
        load_documents(settings.config, settings.policies)
        files = policy_files(settings.policies)
        texts = {p.name: p.read_text(encoding="utf-8") for p in files}
    except ConfigError as exc:
        raise fail(exc) from exc
    if len(texts) != len(files):
        raise fail(GTMError("two policy files share a name; a version needs distinct names"))
    body = {
        "topology": settings.config.read_text(encoding="utf-8"),
        "policies": texts,
        "reason": why,
    }
    proposal = call("POST", "/v1/proposals", body)
    if submit:
        proposal = call("POST", f"/v1/proposals/{proposal['id']}/submit")
    _show(proposal)


@proposal_app.command("list")
def proposal_list(state: Annotated[str | None, typer.Option("--state")] = None) -> None:
    """Proposals, newest first."""
    for p in call("GET", "/v1/proposals" + (f"?state={state}" if state else "")):
        typer.echo(
            f"#{p['id']:<5} {p['state']:<10} {p['version'][:12]} {p['author']}: {p['reason']}"
        )


@proposal_app.command("show")
def proposal_show(proposal_id: int) -> None:
    """One proposal, and its diff against the active version."""
    _show(call("GET", f"/v1/proposals/{proposal_id}"))
    diff = call("GET", f"/v1/proposals/{proposal_id}/diff")
    if not diff["files"]:
        typer.echo("  no change from the active version")
    for f in diff["files"]:
        typer.echo(f["diff"], nl=False)


@proposal_app.command("approve")
def proposal_approve(
    proposal_id: int,
    version: Annotated[str, typer.Option("--version", help="the version id you reviewed")],
    comment: Annotated[str, typer.Option("--comment")] = "",
) -> None:
    """Approve a proposal you did not write, naming the version you reviewed."""
    _show(
        call(
            "POST",
            f"/v1/proposals/{proposal_id}/approve",
            {"version": version, "comment": comment},
        )
    )


def _activate(proposal_id: int, acknowledged: list[str]) -> dict[str, Any]:
    """Activate, naming the leaks accepted; a version that sends answers out of their
    jurisdiction is shown leak by leak and activated only when each is acknowledged, by flag or,
    at a terminal, by answering yes to the list."""
    path = f"/v1/proposals/{proposal_id}/activate"
    body = {"acknowledge": "; ".join(acknowledged)}
    proposal, refusal = call_or_refusal("POST", path, body, "leak_not_acknowledged")
    if refusal is None:
        return dict(proposal)
    leaks = [p["location"] for p in refusal.get("problems", [])]
    typer.echo(
        f"#{proposal_id} would send answers out of their jurisdiction (replayed over the last "
        "day of recorded traffic):",
        err=True,
    )
    for problem in refusal.get("problems", []):
        typer.echo(f"  {problem['location']}: {problem['message']}", err=True)
    if not acknowledged and sys.stdin.isatty():
        if typer.confirm("Activate anyway, acknowledging each of these?", err=True):
            return dict(call("POST", path, {"acknowledge": "; ".join(leaks)}))
        raise typer.Exit(1)
    flags = " ".join(f"--acknowledge-leak '{x.replace('→', '->')}'" for x in leaks)
    typer.echo(f"not activated; to accept: gtm proposal activate {proposal_id} {flags}", err=True)
    raise typer.Exit(1)


@proposal_app.command("activate")
def proposal_activate(
    proposal_id: int,
    wait: Annotated[str, typer.Option("--wait", help="how long to wait for every node")] = "10s",
    acknowledge_leak: Annotated[
        list[str] | None,
        typer.Option(
            "--acknowledge-leak",
            help="a leak out of a jurisdiction you accept, as the refusal names it, e.g. "
            "'eu-personal EU->US' (repeatable; each leak must be named)",
        ),
    ] = None,
) -> None:
    """Sign and publish an approved proposal, then wait until every configured member of the
    fleet reports it in force (exit 1 if one has not within --wait, naming each member that is
    pending and each that is fenced, since when).

    When the version would send answers out of their jurisdiction, the leaks are listed with
    their counts and the activation needs each named with --acknowledge-leak (or, at a
    terminal, a yes); the acknowledgement is recorded with the activation."""
    from gtm.fleet.operator import parse_duration

    try:
        window = parse_duration(wait)
    except ValueError as exc:
        raise fail(GTMError(str(exc))) from exc
    _show(_activate(proposal_id, acknowledge_leak or []))
    deadline = time.monotonic() + window
    while True:
        rollout = call("GET", f"/v1/proposals/{proposal_id}/rollout")
        if rollout["complete"]:
            nodes = ", ".join(rollout["acknowledged"])
            typer.echo(f"  in force on every member ({rollout['membership']}): {nodes}")
            return
        if time.monotonic() >= deadline:
            for line in rollout_lines(rollout):
                typer.echo(line)
            raise typer.Exit(1)
        time.sleep(0.25)


def rollout_lines(rollout: dict[str, Any]) -> list[str]:
    """What an incomplete rollout has reached, member by member."""
    lines = [f"  NOT in force on every member ({rollout['membership']})"]
    if rollout["acknowledged"]:
        lines.append(f"  in force on: {', '.join(rollout['acknowledged'])}")
    for member, has in rollout["pending"].items():
        silent = rollout["silent"].get(member, "live")
        said = (
            "live"
            if silent == "live"
            else "never reported"
            if silent is None
            else f"silent since {_when(silent)}"
        )
        lines.append(f"  PENDING  {member}: has {has if has is not None else 'no version'}, {said}")
    for member, since in rollout["fenced"].items():
        lines.append(
            f"  FENCED   {member}: silent past the fence bound, failing restricted traffic "
            f"closed since {_when(since)}"
        )
    if not rollout["pending"] and not rollout["fenced"] and not rollout["acknowledged"]:
        lines.append("  no member has reported")
    return lines


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@proposal_app.command("withdraw")
def proposal_withdraw(proposal_id: int) -> None:
    """Withdraw your own proposal."""
    _show(call("POST", f"/v1/proposals/{proposal_id}/withdraw"))


@proposal_app.command("impact")
def proposal_impact(
    proposal_id: int,
    since: Annotated[str, typer.Option("--since", help="replay window, e.g. 24h")] = "24h",
) -> None:
    """Replay recorded traffic under the proposal: answers that would move, fail closed, or
    leave their jurisdiction (those first), per service, class and region."""
    from gtm.fleet.operator import parse_duration

    try:
        window = parse_duration(since)
    except ValueError as exc:
        raise fail(GTMError(str(exc))) from exc
    r = call("POST", f"/v1/proposals/{proposal_id}/impact", {"since_s": window})
    typer.echo(
        f"#{proposal_id}: {r['answers']:,} answers ({r['inputs']:,} distinct inputs) of the last "
        f"{since} replayed in {r['seconds']:.1f} s\n"
        f"  would move region:         {r['moved']:,}\n"
        f"  would newly fail closed:   {r['newly_refused']:,}\n"
        f"  would newly be answered:   {r['newly_answered']:,}\n"
        f"  LEAVE THEIR JURISDICTION:  {r['left_jurisdiction']:,}"
    )
    for move, n in sorted(r["by_move"].items(), key=lambda kv: -kv[1]):
        typer.echo(f"  {move:<32} {n:>12,}")
    for c in r["examples"]:
        flag = "!" if c["left_jurisdiction"] else " "
        typer.echo(
            f" {flag} {c['example']:<24} {c['name']:<28} {c['client_network']:<18} "
            f"{c['before']} -> {c['after']} ({c['answers']:,})"
        )
