"""``gtm region ...`` and ``gtm config ...``: operator controls and fleet-wide documents.

Controls go through the admin API (``GTM_ADMIN_URL``, ``GTM_ADMIN_TOKEN``) as the token's
principal and under the topology's safety rules; ``status``, ``events`` and ``config show``
read the shared database every node syncs with.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import httpx
import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.database import make_async_engine
from gtm.cli.admin_client import call
from gtm.cli.common import DbOpt, cli_settings, fail, run_async
from gtm.decision.bundle import load_documents, parse_documents
from gtm.decision.topology import Topology
from gtm.errors import ConfigError, GTMError
from gtm.fleet import operator, roster, shared_state
from gtm.fleet.local_documents import read_in_force
from gtm.fleet.observation_seal import NodeKey, ObservationGate, membership
from gtm.fleet.region_state import RegionBook, RegionEvent
from gtm.fleet.signed_documents import load_public_keys
from gtm.fleet.state_sync import fence_slack_s
from gtm.settings import Settings

region_app = typer.Typer(help="Region state and operator controls.", no_args_is_help=True)
# A node counts as live while its status report is younger than this.
config_app = typer.Typer(help="Documents published to every node.", no_args_is_help=True)

WhyOpt = Annotated[str, typer.Option("--why", help="why (recorded with the change)")]
OverrideOpt = Annotated[
    bool, typer.Option("--override-safety", help="break a safety rule (admins only, recorded)")
]
ForOpt = Annotated[
    str | None, typer.Option("--for", help="lapse after this long: 90s, 15m, 2h, 1d")
]
T = TypeVar("T")


def read_shared(settings: Settings, main: Callable[[], Awaitable[T]]) -> T:
    """``main``'s reads of the shared database. A fresh database reads as empty, not as an
    error: when its schema is missing (or behind) the read fails, the migrations run and it is
    read again. Only then are they imported: alembic costs a third of a second to load, more
    than a read of a current database takes."""
    try:
        return run_async(main)
    except DBAPIError:
        from gtm.audit import migrate

        migrate.upgrade(settings.database_url)
        return run_async(main)


async def _topology(engine: AsyncEngine, settings: Settings) -> Topology:
    """The topology in force: the newest published one that verifies with GTM_DOCUMENT_KEYS
    (a row written into the database is not it), else the configured file."""
    keys = load_public_keys(settings.document_keys)
    found = await read_in_force(engine, keys, settings.policy_approvals)
    for note in found.notes:
        typer.echo(f"note: {note}", err=True)
    if found.accepted is not None:
        accepted = found.accepted
        source = f"version {accepted.manifest.version[:12]}"
        return parse_documents(accepted.topology, accepted.policies, source).topology
    return load_documents(settings.config, settings.policies).topology


def _change(region: str, action: str, body: dict[str, Any]) -> None:
    """One operator control through the admin API, as the token's principal."""
    result = call("POST", f"/v1/regions/{region}/{action}", body)
    typer.echo(f"{region}: {result['override'] or 'no override'}")
    for rule in result["broke_safety_rules"]:
        typer.echo(f"  safety rule overridden: {rule}")


@region_app.command("drain")
def region_drain(
    region: str, why: WhyOpt, for_: ForOpt = None, override_safety: OverrideOpt = False
) -> None:
    """Stop sending new clients to REGION (DNS and HTTP answers move at every node's next
    sync). Refused when it breaks a safety rule, unless an admin overrides."""
    _change(region, "drain", {"reason": why, "for": for_, "override_safety": override_safety})


@region_app.command("undrain")
def region_undrain(region: str, why: WhyOpt) -> None:
    """Send clients to REGION again (re-admitted gradually over the readmit window)."""
    _change(region, "undrain", {"reason": why})


@region_app.command("weight")
def region_weight(
    region: str,
    weight: Annotated[
        float | None, typer.Argument(help="0 = no traffic; omit with --reset")
    ] = None,
    reset: Annotated[bool, typer.Option("--reset", help="back to the topology's weight")] = False,
    why: WhyOpt = "",
    for_: ForOpt = None,
    override_safety: OverrideOpt = False,
) -> None:
    """Set REGION's weight in the ranking (distance / weight), replacing the topology's."""
    if (weight is None) != reset:
        raise fail(GTMError("give a weight, or --reset"))
    body = {"weight": weight, "reason": why, "for": for_, "override_safety": override_safety}
    _change(region, "weight", body)


@region_app.command("force")
def region_force(
    region: str,
    state: Annotated[str, typer.Argument(help="up, down, or none to end a forced state")],
    why: WhyOpt,
    for_: ForOpt = None,
    override_safety: OverrideOpt = False,
) -> None:
    """Force REGION up or down whatever the probes say, for a limited time (--for)."""
    if state not in ("up", "down", "none"):
        raise fail(GTMError(f"state must be up, down or none, not {state!r}"))
    body = {"state": state, "reason": why, "for": for_, "override_safety": override_safety}
    _change(region, "force", body)


@region_app.command("clear")
def region_clear(region: str, why: WhyOpt) -> None:
    """Remove every override of REGION."""
    _change(region, "clear", {"reason": why})


@region_app.command("status")
def region_status(
    database_url: DbOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Each region's state recounted from the fleet's observations, every node's view, the
    overrides, and the state each live node reports it answers with."""
    settings = cli_settings(database_url=database_url)

    async def main() -> tuple[list[dict[str, Any]], list[roster.Entry]]:
        engine = make_async_engine(settings.database_url)
        try:
            topology = await _topology(engine, settings)
            now = time.time()
            observations = await shared_state.read_observations(engine, 0)
            overrides = await operator.verified_overrides(engine, settings)
            reports = await shared_state.read_node_status(engine, 0.0)
        finally:
            await engine.dispose()
        book = RegionBook(
            operator.OPERATOR_NODE,
            tuple(r.id for r in topology.regions),
            quorum=settings.health_quorum,
            max_age_s=settings.health_observation_max_age_s,
        )
        # Recounted as the nodes count: only members' observations that verify with their key
        # (this command is no member: a throwaway key of its own, which no row carries).
        members = membership(
            topology.fleet.members,
            settings.health_members,
            operator.OPERATOR_NODE,
            NodeKey(Ed25519PrivateKey.generate()),
        )
        book.set_gate(ObservationGate(members, max_future_s=settings.health_max_future_s))
        # Every configured member, silent ones included, with what it last reported.
        bounds = roster.Bounds(
            roster.live_bound_s(settings.node_live_within_s, settings.state_sync_interval_s),
            settings.fence_after_s,
            fence_slack_s(settings.state_sync_interval_s),
        )
        entries = roster.roster(members.voters, reports, now, bounds)
        book.replace_peers(observations)
        book.set_overrides(overrides)
        composed = book.compose(now)
        by_region = {o.region: o for o in overrides}
        rows = []
        for region in topology.regions:
            override = by_region.get(region.id)
            effective = override.effective(now) if override is not None else None
            rows.append(
                {
                    "region": region.id,
                    "state": composed.health[region.id].state.value,
                    "detail": composed.health[region.id].detail,
                    "override": effective.describe() if effective else None,
                    "override_by": f"{effective.actor}: {effective.reason}" if effective else None,
                    "nodes": {
                        o.node: {
                            "state": o.state.value,
                            "age_s": round(now - o.observed_at, 1),
                            "fresh": now - o.observed_at <= settings.health_observation_max_age_s,
                        }
                        for o in observations
                        if o.region == region.id
                    },
                    # What each live node answers with now (its own report, with its memory
                    # of re-admission and the overrides it has synced), beside the recount.
                    # A member not live shows what it is (silent, fenced, never reported).
                    "in_force": roster.held_by(entries, region.id),
                }
            )
        return rows, entries

    try:
        rows, entries = read_shared(settings, main)
    except ConfigError as exc:
        raise fail(exc) from exc
    utilisation, why_not = _utilisation(settings)
    for row in rows:
        row["utilisation"] = utilisation.get(row["region"])
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo(f"{'REGION':<16} {'STATE':<9} {'UTIL':>5}  {'OBSERVED (node=state)':<30} IN FORCE")
    for row in rows:
        nodes = " ".join(
            f"{n}={v['state']}{'' if v['fresh'] else '(stale)'}" for n, v in row["nodes"].items()
        )
        override = f"  [{row['override']} — {row['override_by']}]" if row["override"] else ""
        serving = " ".join(f"{n}:{s}" for n, s in row["in_force"].items())
        util = "-" if row["utilisation"] is None else f"{row['utilisation']:.0%}"
        typer.echo(
            f"{row['region']:<16} {row['state']:<9} {util:>5}  {nodes or '-':<30} "
            f"{serving or 'no live node'}{override}"
        )
    for e in entries:
        last = "never" if e.last_report is None else f"{time.time() - e.last_report:.1f} s ago"
        fenced = "" if e.fenced_since is None else f" (fenced since {e.fenced_since:.0f})"
        typer.echo(
            f"member {e.member:<20} {e.state}{fenced}  last report {last}"
            f"  documents {e.document_sequence if e.document_sequence is not None else 'files'}"
            f"{'' if e.configured else '  (not a configured member)'}"
        )
    if why_not:
        typer.echo(f"UTIL -: {why_not}", err=True)


def _utilisation(settings: Settings) -> tuple[dict[str, float | None], str | None]:
    """Each region's utilisation from its last fresh capacity report, as the admin API's node
    holds it (reports are pushed to nodes, not kept in the database); ({}, why) without one."""
    if not settings.admin_url or settings.admin_token is None:
        return {}, "utilisation needs GTM_ADMIN_URL and GTM_ADMIN_TOKEN (the admin API's node)"
    headers = {"authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
    try:
        reply = httpx.get(f"{settings.admin_url}/v1/regions", headers=headers, timeout=3)
        reply.raise_for_status()
        regions = reply.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {}, f"the admin API did not answer /v1/regions: {exc}"
    return {r["region"]: r.get("utilisation") for r in regions}, None


@region_app.command("events")
def region_events(
    region: Annotated[str | None, typer.Option("--region")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1)] = 50,
    database_url: DbOpt = None,
) -> None:
    """Region state changes and operator actions, newest first."""
    settings = cli_settings(database_url=database_url)

    async def main() -> list[RegionEvent]:
        engine = make_async_engine(settings.database_url)
        try:
            return await shared_state.read_events(engine, region, limit)
        finally:
            await engine.dispose()

    for e in read_shared(settings, main):
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.at))
        change = f"{e.previous} -> {e.state}" if e.state else ""
        who = f" by {e.actor}: {e.reason}" if e.actor else ""
        typer.echo(f"{when} {e.node:<12} {e.region:<14} {e.kind:<9} {change} {e.detail}{who}")


@config_app.command("show")
def config_show(database_url: DbOpt = None) -> None:
    """The documents in force on the fleet (the newest published)."""
    settings = cli_settings(database_url=database_url)

    async def main() -> shared_state.Published | None:
        engine = make_async_engine(settings.database_url)
        try:
            newest = await shared_state.newest_document_id(engine)
            return None if newest is None else await shared_state.read_published(engine, newest)
        finally:
            await engine.dispose()

    published = read_shared(settings, main)
    if published is None:
        typer.echo("nothing published: nodes use their configured files")
        return
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(published.published_at))
    typer.echo(
        f"#{published.id} published {when} by {published.actor}: {published.reason}\n"
        f"  policies: {', '.join(sorted(published.policies))}"
    )
