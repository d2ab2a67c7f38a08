"""``gtm report compliance``: the compliance report of a time window, as HTML or JSON."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal

import typer
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.admin.permissions import READS
from gtm.audit.database import make_async_engine
from gtm.cli.common import DbOpt, checkpoint_sink, cli_settings, run_with_sink
from gtm.control.log import ControlLog, LogRefused
from gtm.control.state import ControlState
from gtm.decision.policy import policy_files
from gtm.fleet.signed_documents import load_public_keys
from gtm.report.compliance import Compliance, compliance_report
from gtm.report.html import render
from gtm.settings import Settings

report_app = typer.Typer(help="Reports for compliance teams and regulators.", no_args_is_help=True)


def _us(value: str | None, default: float) -> int:
    if value is None:
        return int(default * 1e6)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        typer.echo(
            f"error: {value!r} is not an ISO 8601 time (2026-11-24T00:00:00+00:00)", err=True
        )
        raise typer.Exit(2) from None
    if moment.tzinfo is None:
        typer.echo(f"error: {value!r} has no time zone: add +00:00 or Z", err=True)
        raise typer.Exit(2)
    return int(moment.timestamp() * 1e6)


@report_app.command("compliance")
def compliance(
    since: Annotated[str | None, typer.Option("--from", help="ISO 8601; default: 24 h ago")] = None,
    until: Annotated[str | None, typer.Option("--to", help="ISO 8601; default: now")] = None,
    fmt: Annotated[Literal["html", "json"], typer.Option("--format")] = "html",
    output: Annotated[Path | None, typer.Option("-o", "--output")] = None,
    checkpoints: Annotated[
        str | None, typer.Option("--checkpoints", help="a directory or s3://BUCKET/PREFIX")
    ] = None,
    database_url: DbOpt = None,
) -> None:
    """Answers per jurisdiction, class and service; answers outside the allowed regions,
    recomputed from the recorded inputs; policy versions and their approvers; operator actions;
    gaps; chain verification. Exit 1 when an answer was outside the allowed regions, could not
    be recomputed, or a chain does not verify."""
    now = time.time()
    from_us, to_us = _us(since, now - 86400), _us(until, now)
    if to_us <= from_us:
        typer.echo("error: --to must be after --from", err=True)
        raise typer.Exit(2)
    settings = cli_settings(database_url=database_url)
    sink = checkpoint_sink(settings, checkpoints)
    own = (
        settings.config.read_text(encoding="utf-8"),
        {p.name: p.read_text(encoding="utf-8") for p in policy_files(settings.policies)},
    )

    async def _verified_control(engine: AsyncEngine, settings: Settings) -> ControlState | None:
        """Who approved what, from the control log verified with GTM_DOCUMENT_KEYS."""
        control = ControlLog(load_public_keys(settings.document_keys))
        try:
            await control.refresh(engine)
        except LogRefused as exc:
            typer.echo(f"warning: the control log is refused: {exc}", err=True)
            return None
        return control.good

    async def main() -> Compliance:
        engine = make_async_engine(settings.database_url)
        try:
            return await compliance_report(
                engine,
                from_us,
                to_us,
                sink=sink,
                own_documents=[own],
                control=await _verified_control(engine, settings),
                reads=READS,
            )
        finally:
            await engine.dispose()

    report = run_with_sink(main)
    text = render(report) if fmt == "html" else json.dumps(report.to_json(), indent=2)
    if output is None:
        typer.echo(text)
    else:
        output.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}", err=True)
    typer.echo(
        f"{report.answers} answer(s) in {report.rows} row(s); {report.outside_allowed} outside "
        f"the allowed regions (recomputed); {sum(report.unverifiable.values())} not recomputable; "
        f"{len(report.verification['breaks'])} chain break(s)",
        err=True,
    )
    if report.outside_allowed or report.unverifiable or report.verification["breaks"]:
        raise typer.Exit(1)
