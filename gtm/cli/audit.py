"""``gtm audit``: the audit log of decisions (tail, export, show) and its verification."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gtm.audit import query
from gtm.audit.database import make_async_engine
from gtm.audit.decision_id import DecisionIdError, parse_id
from gtm.cli.common import DbOpt, checkpoint_sink, cli_settings, run_async, run_with_sink

# Verification and retention (the chains, their keys, the control log) are imported by those
# commands: `gtm audit tail` and `show` read rows and need none of it.
if TYPE_CHECKING:
    from gtm.audit.retention import Retained
    from gtm.audit.verify import Verification

audit_app = typer.Typer(help="The audit log of decisions.", no_args_is_help=True)


# -- audit -------------------------------------------------------------------------------------


def _row_text(row: dict[str, Any]) -> str:
    answer = ",".join(row["answer"]) or "-"
    return (
        f"{query.iso(row['last_at_us'])} {row['node']}#{row['node_seq']} x{row['count']} "
        f"{row['channel']} {row['name']} {row['client_network']} "
        f"{row['country'] or '??'} -> {row['outcome']} {row['region'] or '-'} {answer}"
    )


@audit_app.command("tail")
def audit_tail(
    database_url: DbOpt = None,
    lines: Annotated[int, typer.Option("-n", "--lines")] = 20,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the newest decisions (and keep printing new ones with --follow)."""
    settings = cli_settings(database_url=database_url)

    async def main() -> None:
        engine = make_async_engine(settings.database_url)
        try:
            rows = await query.tail(engine, lines)
            while True:
                for row in rows:
                    typer.echo(json.dumps(row) if as_json else _row_text(row))
                if not follow:
                    return
                last = rows[-1]["id"] if rows else 0
                await asyncio.sleep(1)
                rows = (
                    await query.tail(engine, after_id=last)
                    if last
                    else await query.tail(engine, lines)
                )
        finally:
            await engine.dispose()

    with contextlib.suppress(KeyboardInterrupt):
        run_async(main)


def _time_us(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(datetime.fromisoformat(value).timestamp() * 1_000_000)
    except ValueError as exc:
        raise typer.BadParameter(f"{value!r} is not an ISO 8601 time ({exc})") from exc


@audit_app.command("export")
def audit_export(
    database_url: DbOpt = None,
    since: Annotated[str | None, typer.Option(help="ISO time, inclusive")] = None,
    until: Annotated[str | None, typer.Option(help="ISO time, exclusive")] = None,
    fmt: Annotated[str, typer.Option("--format", help="jsonl or csv")] = "jsonl",
    output: Annotated[Path | None, typer.Option("--output", "-o")] = None,
) -> None:
    """Export decisions in a time range as JSON lines or CSV."""
    if fmt not in ("jsonl", "csv"):
        typer.echo("error: --format must be jsonl or csv", err=True)
        raise typer.Exit(2)
    try:
        since_us, until_us = _time_us(since), _time_us(until)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    settings = cli_settings(database_url=database_url)
    out = output.open("w", newline="", encoding="utf-8") if output else sys.stdout

    async def main() -> int:
        engine = make_async_engine(settings.database_url)
        n = 0
        writer: csv.DictWriter[str] | None = None
        try:
            async for row in query.export(engine, since_us, until_us):
                if fmt == "jsonl":
                    out.write(json.dumps(row) + "\n")
                else:
                    flat = {
                        k: json.dumps(v) if isinstance(v, list | dict) else v
                        for k, v in row.items()
                    }
                    if writer is None:
                        writer = csv.DictWriter(out, fieldnames=list(flat))
                        writer.writeheader()
                    writer.writerow(flat)
                n += 1
        finally:
            await engine.dispose()
        return n

    try:
        n = run_async(main)
    finally:
        if output:
            out.close()
    typer.echo(f"exported {n} row(s)", err=True)


def explain_row(row: dict[str, Any]) -> str:
    """A row as a compliance reader wants it: the answer, then why every region was or was not
    it, then the versions that let the decision be replayed."""
    lines = [
        _row_text(row),
        f"  {row['channel']} {row['query_type'] or '-'} -> {row['response'] or '-'}, "
        f"{row['count']} response(s) {query.iso(row['first_at_us'])} .. "
        f"{query.iso(row['last_at_us'])}",
        f"  residency {','.join(row['residency_classes']) or '-'}, tenant "
        f"{row['tenant'] or '-'}, rules {','.join(row['matched_rules']) or '-'}",
    ]
    for c in row["candidates"]:
        detail = f" ({c['detail']})" if c["detail"] else ""
        lines.append(f"  {c['region']:<16} {c['status']:<8} {c['reason']}{detail}")
    lines.append(
        f"  snapshot {row['snapshot_version']}, topology {row['topology_version']}, policy "
        f"{row['policy_version']}, geoip {row['geoip_build']}"
    )
    return "\n".join(lines)


@audit_app.command("show")
def audit_show(
    decision_id: Annotated[str, typer.Argument(help="an X-GTM-Decision-Id (or a 451/503 body's)")],
    database_url: DbOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The decision behind an HTTP response: its audit row, with every region's reason. Exit 1
    when no row holds it yet (a node writes its rows about a second after answering)."""
    try:
        parse_id(decision_id)
    except DecisionIdError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    settings = cli_settings(database_url=database_url)

    async def main() -> list[dict[str, Any]]:
        engine = make_async_engine(settings.database_url)
        try:
            return await query.find_decision(engine, decision_id)
        finally:
            await engine.dispose()

    rows = run_async(main)
    for row in rows:
        typer.echo(json.dumps(row) if as_json else explain_row(row))
    if not rows:
        typer.echo(f"no audit row holds {decision_id} (yet)", err=True)
        raise typer.Exit(1)


@audit_app.command("verify")
def audit_verify(
    database_url: DbOpt = None,
    checkpoints: Annotated[
        str | None,
        typer.Option(
            "--checkpoints",
            help="the checkpoint sink: a directory (keys/ and chains/) or s3://BUCKET/PREFIX; "
            "default: GTM_AUDIT_CHECKPOINT_URL, else GTM_AUDIT_CHECKPOINT_DIR",
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            help="ISO time: start each chain at its newest checkpoint written by then (rows "
            "before it are not read; a full pass is the default)"
        ),
    ] = None,
) -> None:
    """Check every decision chain and the region events' chain against their links and the
    signed checkpoints outside the database; exit 1 at any break, each listed with where.
    Exit 3 when nothing is broken but a live node's spool still holds rows its checkpoints
    vouch for (late, not gone: run it again once the node has drained)."""
    from gtm.audit.checkpoints import EVENTS_CHAIN
    from gtm.audit.verify import verify
    from gtm.control.anchor import verify_control_log
    from gtm.fleet import roster
    from gtm.fleet.signed_documents import load_public_keys

    settings = cli_settings(database_url=database_url)
    sink = checkpoint_sink(settings, checkpoints)
    since_us = _time_us(since)

    document_keys = load_public_keys(settings.document_keys)

    async def main() -> Verification:
        engine = make_async_engine(settings.database_url)
        try:
            found = await verify(
                engine,
                sink,
                since=None if since_us is None else since_us / 1e6,
                # A missing tail a node reported within the liveness bound as still spooled.
                spools_since=time.time()
                - roster.live_bound_s(settings.node_live_within_s, settings.state_sync_interval_s),
            )
            if document_keys:
                # Every control-log entry's link and signature (its checkpoints were checked
                # above, against the entries they name).
                entries, breaks = await verify_control_log(engine, document_keys, ())
                found.breaks.extend(breaks)
                control_entries.append(entries)
            return found
        finally:
            await engine.dispose()

    control_entries: list[int] = []
    result = run_with_sink(main)
    for b in result.breaks:
        typer.echo(f"BROKEN {b.node}#{b.node_seq}: {b.problem}")
    for gap in result.gaps:
        typer.echo(f"GAP {gap.chain}#{gap.seq} at {gap.at:.3f}: {gap.detail}")
    for cut in result.cuts:
        typer.echo(f"CUT {cut.chain}#{cut.seq} at {cut.at:.3f}: {cut.detail}")
    for chain, c in sorted(result.spooled.items()):
        assert c.spool is not None  # spooled rows always come with the report that holds them
        typer.echo(
            f"SPOOLED {chain}#{c.last_seq + 1}: {c.spooled} row(s) still spooled on node "
            f"{c.spool.node} (reported at {c.spool.at:.3f}: sealed through {c.spool.sealed}, "
            f"drained through {c.spool.drained}); not yet arrived, not gone"
        )
    for chain, rows in sorted(result.unanchored.items()):
        typer.echo(f"UNANCHORED {chain}: {rows} row(s) after its newest checkpoint")
    if result.unanchored:
        typer.echo(
            "  (normal while a node runs: it checkpoints a chain that moved every "
            f"{settings.audit_checkpoint_interval_s:g} s, GTM_AUDIT_CHECKPOINT_INTERVAL_S, and "
            "when it stops; these rows' links were checked, and the next checkpoint vouches "
            "for them. Not normal: a count that keeps growing past that interval.)"
        )
    for chain, c in sorted(result.chains.items()):
        if c.started is not None and c.started.kind != "cut":
            typer.echo(
                f"FROM {chain}#{c.started.seq}: the rows up to it were not read (its "
                f"checkpoint at {c.started.at:.3f} vouches for them)"
            )
    events = result.chains.get(EVENTS_CHAIN)
    typer.echo(
        f"{result.rows} decision row(s) and {events.rows if events else 0} region event(s) "
        f"checked in {len(result.chains)} chain(s) against {result.checkpoints} checkpoint(s) "
        f"from {sink.location}: {len(result.breaks)} break(s), {len(result.gaps)} gap(s), "
        f"{sum(c.spooled for c in result.spooled.values())} row(s) still spooled"
    )
    if control_entries:
        typer.echo(f"control-log entries checked with the document keys: {control_entries[0]}")
    else:
        typer.echo("control-log entries not checked: no GTM_DOCUMENT_KEYS to verify them with")
    if result.breaks:
        typer.echo(f"NOT INTACT: {len(result.breaks)} break(s), each listed above with where")
        raise typer.Exit(1)
    if result.spooled:
        typer.echo(
            "INCOMPLETE: no break, but rows listed SPOOLED have not reached the database yet; "
            "run verify again once their node has drained"
        )
        raise typer.Exit(3)
    typer.echo("no break: every row read links to the one before it and matches the checkpoints")


@audit_app.command("retain")
def audit_retain(
    before: Annotated[str, typer.Option("--before", help="ISO 8601: rows that ended before")],
    yes: Annotated[bool, typer.Option("--yes", help="do it (without: say what would go)")] = False,
    checkpoints: Annotated[
        str | None, typer.Option("--checkpoints", help="a directory or s3://BUCKET/PREFIX")
    ] = None,
    key: Annotated[
        Path | None, typer.Option("--key", help="signing key; default: this node's audit key")
    ] = None,
    database_url: DbOpt = None,
) -> None:
    """Remove each chain's rows that ended before --before, after signing a cut for each
    chain (to the sink outside the database first), so that verify knows they went on purpose.
    Needs a database role with DELETE (the owner's)."""
    from sqlalchemy import func, select

    from gtm.audit.keys import KEY_NAME, load_or_create
    from gtm.audit.retention import retain
    from gtm.audit.schema import decisions
    from gtm.audit.verify import verify

    settings = cli_settings(database_url=database_url)
    before_us = _time_us(before)
    assert before_us is not None
    sink = checkpoint_sink(settings, checkpoints)
    chain_key = load_or_create(key or settings.audit_signing_key or settings.spool_dir / KEY_NAME)

    async def main() -> Retained | None:
        engine = make_async_engine(settings.database_url)
        try:
            # Never cut what does not verify: the cut would launder the evidence of a break.
            checked = await verify(engine, sink)
            if checked.store is None:
                typer.echo("error: the database has no audit store id (gtm db upgrade)", err=True)
                raise typer.Exit(2)
            if checked.breaks:
                for b in checked.breaks:
                    typer.echo(f"BROKEN {b.node}#{b.node_seq}: {b.problem}", err=True)
                typer.echo(
                    f"error: refusing retention: {len(checked.breaks)} break(s) in the store; "
                    "removing rows now would remove the evidence of them",
                    err=True,
                )
                raise typer.Exit(1)
            if not yes:
                async with engine.connect() as conn:
                    n = await conn.scalar(
                        select(func.count()).where(decisions.c.last_at_us < before_us)
                    )
                typer.echo(f"would remove up to {n} row(s) ended before {before}; --yes to do it")
                return None
            return await retain(engine, before_us, key=chain_key, sink=sink, store=checked.store)
        finally:
            await engine.dispose()

    retained = run_with_sink(main)
    if retained is None:
        return
    for cut in retained.cuts:
        typer.echo(f"{cut.chain}: {cut.rows} row(s) through #{cut.seq} removed, cut signed")
    for partition in retained.dropped:
        typer.echo(f"partition {partition} dropped whole")
    typer.echo(
        f"{len(retained.dropped)} partition(s) dropped, "
        f"{retained.deleted} row(s) deleted one by one"
    )
