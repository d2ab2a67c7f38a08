"""The ``gtm`` command: serve, explain a decision, validate policies, migrate, read the audit.

Exit codes: 0 success, 1 the command ran but found a problem (e.g. a broken audit chain),
2 bad input (invalid document, setting or argument) with every reason printed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gtm.cli.common import ConfigOpt, DbOpt, GeoOpt, PoliciesOpt, cli_settings, fail
from gtm.cli.lazy import Lazy, lazy_group
from gtm.errors import ConfigError, GTMError

# What a command needs is imported when it runs: `gtm --help` (and a typo) answers without
# loading the node, the admin service, SQLAlchemy or the decision code (bench/cli_startup.py).
if TYPE_CHECKING:
    from gtm.decision.model import Decision

# The other groups live in their own modules, imported only when one of their commands runs
# (their help here is checked against the modules' own by tests/gtm/cli/test_cli_startup.py).
LAZY_GROUPS: Lazy = {
    "audit": ("gtm.cli.audit:audit_app", "The audit log of decisions."),
    "region": ("gtm.cli.fleet:region_app", "Region state and operator controls."),
    "config": ("gtm.cli.fleet:config_app", "Documents published to every node."),
    "token": ("gtm.cli.control:token_app", "API tokens of the admin API."),
    "admin": ("gtm.cli.control:admin_app", "The admin service: signing keys, OpenAPI."),
    "proposal": (
        "gtm.cli.control:proposal_app",
        "Policy and topology changes through the admin API (four-eyes).",
    ),
    "report": ("gtm.cli.report:report_app", "Reports for compliance teams and regulators."),
    "dns": ("gtm.cli.dns:dns_app", "The DNS responder: its cookie secret."),
    "dnssec": (
        "gtm.cli.dnssec:dnssec_app",
        "DNSSEC online signing: keys, and the DS record for the parent zone.",
    ),
}

app = typer.Typer(
    cls=lazy_group(LAZY_GROUPS),
    help="GTM: global traffic manager for AI inference fleets.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema (alembic migrations).", no_args_is_help=True)
policy_app = typer.Typer(help="Residency policy documents.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(policy_app, name="policy")

# -- serve -------------------------------------------------------------------------------------


@app.command()
def serve(
    config: ConfigOpt = None,
    policies: PoliciesOpt = None,
    database_url: DbOpt = None,
    geoip_path: GeoOpt = None,
    dns: Annotated[
        list[str] | None, typer.Option("--dns", help="DNS listen HOST:PORT (repeatable)")
    ] = None,
    http: Annotated[str | None, typer.Option("--http", help="HTTP front HOST:PORT")] = None,
    admin: Annotated[str | None, typer.Option("--admin", help="admin API HOST:PORT")] = None,
    metrics: Annotated[str | None, typer.Option("--metrics", help="metrics HOST:PORT")] = None,
    workers: Annotated[
        int | None,
        typer.Option("--workers", help="processes sharing the DNS and HTTP ports (SO_REUSEPORT)"),
    ] = None,
    node_id: Annotated[str | None, typer.Option("--node-id")] = None,
) -> None:
    """Run a GTM node: snapshot, GeoIP reload and audit writer, plus the listeners asked for."""
    settings = cli_settings(
        config=config,
        policies=policies,
        database_url=database_url,
        geoip_path=geoip_path,
        dns_listen=tuple(dns) if dns else None,
        http_listen=http,
        admin_listen=admin,
        metrics_listen=metrics,
        workers=workers,
        node_id=node_id,
    )
    from gtm.geodns.dnssec_keys import load_keys
    from gtm.listen import parse_listen
    from gtm.node import serve_forever, serve_workers

    try:
        listens = [settings.metrics_listen, settings.http_listen, settings.admin_listen]
        for listen in (*settings.dns_listen, *filter(None, listens)):
            parse_listen(listen)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc

    fixed = [*settings.dns_listen, *filter(None, [settings.http_listen])]
    if settings.workers > 1 and any(parse_listen(x)[1] == 0 for x in fixed):
        typer.echo("error: --workers needs fixed ports (port 0 differs per worker)", err=True)
        raise typer.Exit(2)
    try:
        if settings.dns_listen and settings.dnssec_key_file is not None:
            # Before anything starts: a signed zone whose keys cannot be used is never served.
            load_keys(settings.dnssec_key_file, settings.dnssec_publish_key_files)
        if settings.workers > 1:
            status = serve_workers(settings)
            if status:
                raise typer.Exit(status)  # a worker failed: the node stopped with it
        else:
            serve_forever(settings)
    except GTMError as exc:
        raise fail(exc) from exc
    except OSError as exc:  # a listen address that cannot be bound
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


# -- explain -----------------------------------------------------------------------------------


def _km(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def decision_json(decision: Decision) -> dict[str, Any]:
    loc = decision.location
    return {
        "outcome": decision.outcome.value,
        "region": decision.region,
        "regions": list(decision.regions),
        "answer": {
            "ipv4": list(decision.ipv4),
            "ipv6": list(decision.ipv6),
            "base_url": decision.base_url,
        },
        "ttl": decision.ttl,
        "service": decision.service,
        "residency_classes": list(decision.residency_classes),
        "matched_rules": list(decision.matched_rules),
        "dns_failure": decision.dns_failure.value if decision.dns_failure else None,
        "location": {
            "country": loc.country,
            "continent": loc.continent,
            "lat": loc.lat,
            "lon": loc.lon,
            "network": str(loc.network) if loc.network else None,
        },
        "client_network": str(decision.client_network),
        "scope_prefix": decision.scope_prefix,
        # Which address rules on client geography were judged on: "address", "ecs" (a trusted
        # resolver's) or "ecs+address" (an untrusted resolver's ECS, with its own address).
        "residency_basis": decision.residency_basis.value,
        "candidates": [
            {
                "region": c.region,
                "status": c.status.value,
                "reason": c.reason.value,
                "distance_km": _km(decision.distances.get(c.region)),
                "detail": c.detail,
            }
            for c in decision.candidates
        ],
        "versions": asdict(decision.versions),
    }


@app.command()
def explain(
    client: Annotated[str, typer.Option("--client", help="client (or resolver) IP address")],
    name: Annotated[str, typer.Option("--name", help="DNS name or HTTP host asked for")],
    config: ConfigOpt = None,
    policies: PoliciesOpt = None,
    geoip_path: GeoOpt = None,
    ecs: Annotated[
        str | None, typer.Option("--ecs", help="EDNS Client Subnet, e.g. 198.51.100.0/24")
    ] = None,
    residency: Annotated[
        list[str] | None, typer.Option("--residency", help="extra residency class")
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant")] = None,
    state: Annotated[
        Path | None,
        typer.Option("--state", help="YAML of region health and capacity for a what-if"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    files: Annotated[
        bool,
        typer.Option(
            "--files",
            help="decide with the local topology and policy files, not the version in force "
            "(the newest signed version in the database, verified with GTM_DOCUMENT_KEYS)",
        ),
    ] = False,
    database_url: DbOpt = None,
) -> None:
    """Decide for one client and print the decision with a reason for every region.

    The documents are the version in force, as every node serves it (``--files``: the local
    files); a note on stderr says when the two differ."""
    from gtm.cli.whatif import apply_state, choose_snapshot
    from gtm.decision.routing import Channel, DecisionRequest, decide
    from gtm.decision.topology import normalise_dns_name

    settings = cli_settings(
        config=config, policies=policies, geoip_path=geoip_path, database_url=database_url
    )
    try:
        client_ip = ip_address(client)
        ecs_net = ip_network(ecs, strict=True) if ecs else None
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    now = time.time()
    try:
        chosen = choose_snapshot(settings, now, files=files)
        snapshot = chosen.snapshot
        if state is not None:
            snapshot = apply_state(snapshot, state, now)
    except (GTMError, OSError, ValueError, KeyError) as exc:
        if isinstance(exc, GTMError):
            raise fail(exc) from exc
        typer.echo(f"error: --state {state}: {exc}", err=True)
        raise typer.Exit(2) from exc
    topo = snapshot.topology
    service = topo.service_by_host(name)
    if service is None:
        try:
            service = topo.service_by_dns_name(normalise_dns_name(name))
        except ValueError:
            service = None
    request = DecisionRequest(
        channel=Channel.API,
        client=client_ip,
        service=service.id if service else "",
        name=name,
        ecs=ecs_net,
        residency_classes=frozenset(residency or ()),
        tenant=tenant,
    )
    decision = decide(request, snapshot, now)
    for note in chosen.notes:
        typer.echo(f"note: {note}", err=True)
    documents = {"source": chosen.source, "sequence": chosen.sequence}
    if as_json:
        typer.echo(json.dumps({**decision_json(decision), "documents": documents}, indent=2))
    else:
        typer.echo(render_decision(decision, name))
        if chosen.sequence is None:
            typer.echo("  documents: the local files (no signed version in force)")
        else:
            typer.echo(
                f"  documents: the version in force, sequence {chosen.sequence} ({chosen.source})"
            )


def render_decision(decision: Decision, name: str) -> str:
    d = decision_json(decision)
    loc = d["location"]
    lines = [
        f"{name}: {d['outcome']}"
        + (f" -> {d['region']}" if d["region"] else "")
        + (
            f" {', '.join(d['answer']['ipv4'] + d['answer']['ipv6'])}"
            if d["answer"]["ipv4"] or d["answer"]["ipv6"]
            else ""
        )
        + (f" (dns: {d['dns_failure']})" if d["dns_failure"] else "")
        + f"  ttl={d['ttl']}",
        f"  client {d['client_network']} located {loc['country'] or '??'}/"
        f"{loc['continent'] or '??'} via {loc['network'] or 'no GeoIP network'}"
        f"  scope /{d['scope_prefix']}",
        f"  classes {d['residency_classes'] or '-'}  rules {d['matched_rules'] or '-'}"
        f"  residency judged on {d['residency_basis']}",
    ]
    for c in d["candidates"]:
        dist = f"{c['distance_km']:>8.0f} km" if c["distance_km"] is not None else " " * 11
        detail = f"  ({c['detail']})" if c["detail"] else ""
        lines.append(f"  {c['region']:<14} {c['status']:<9} {c['reason']:<22}{dist}{detail}")
    v = d["versions"]
    lines.append(
        f"  versions snapshot={v['snapshot']} topology={v['topology']} "
        f"policy={v['policy']} geoip={v['geoip']}"
    )
    return "\n".join(lines)


# -- db ----------------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(
    database_url: DbOpt = None, revision: Annotated[str, typer.Option("--revision")] = "head"
) -> None:
    """Bring the schema up to ``revision`` (default: the newest)."""
    from gtm.audit import migrate

    settings = cli_settings(database_url=database_url)
    migrate.upgrade(settings.database_url, revision)
    typer.echo(f"database at revision {migrate.current_revision(settings.database_url)}")


@db_app.command("downgrade")
def db_downgrade(revision: str, database_url: DbOpt = None) -> None:
    """Take the schema down to ``revision`` ("base" removes every table)."""
    from gtm.audit import migrate

    settings = cli_settings(database_url=database_url)
    migrate.downgrade(settings.database_url, revision)
    typer.echo(f"database at revision {migrate.current_revision(settings.database_url)}")


@db_app.command("current")
def db_current(database_url: DbOpt = None) -> None:
    from gtm.audit import migrate

    settings = cli_settings(database_url=database_url)
    current = migrate.current_revision(settings.database_url)
    head = migrate.head_revision(settings.database_url)
    typer.echo(f"current {current}, newest {head}")


# -- policy ------------------------------------------------------------------------------------


@policy_app.command("validate")
def policy_validate(
    files: Annotated[list[Path] | None, typer.Argument(help="files or directories")] = None,
    config: ConfigOpt = None,
) -> None:
    """Validate policy documents (and, with --config, their references to the topology)."""
    from gtm.decision.policy import load_policy
    from gtm.decision.topology import load_topology

    paths = files or [Path("policies")]
    try:
        topology = load_topology(config) if config is not None else None
        policy = load_policy(paths, topology)
    except ConfigError as exc:
        raise fail(exc) from exc
    typer.echo(
        f"ok: {len(policy.documents)} document(s), {len(policy.rules)} rule(s), "
        f"version {policy.version}"
    )


@policy_app.command("schema")
def policy_schema() -> None:
    """Print the JSON Schema of a policy document."""
    from gtm.decision.policy import json_schema

    typer.echo(json.dumps(json_schema(), indent=2, sort_keys=True))


# -- capacity reports --------------------------------------------------------------------------


@app.command("report-key")
def report_key(region: str) -> None:
    """Print REGION's capacity-report key, derived from GTM_REPORT_SECRET: give it to that
    region's balancers only (REGIONAL_LB_REPORT_SECRET, from a 0600 file or the environment).
    A balancer with one region's key cannot sign another region's reports."""
    from gtm.runtime import build_snapshot
    from regional_lb.capacity_report import region_secret

    settings = cli_settings()
    if settings.report_secret is None:
        typer.echo("error: GTM_REPORT_SECRET is unset: no fleet secret to derive from", err=True)
        raise typer.Exit(2)
    if region not in {r.id for r in build_snapshot(settings, time.time()).topology.regions}:
        typer.echo(f"error: no region {region!r} in {settings.config}", err=True)
        raise typer.Exit(2)
    typer.echo(region_secret(settings.report_secret.get_secret_value().encode(), region).decode())
