"""What every ``gtm`` sub-command shares: option types, settings, error reporting, asyncio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from gtm.errors import ConfigError, GTMError

# Imported where used: every command imports this module, `gtm --help` included.
if TYPE_CHECKING:
    from gtm.audit.checkpoints import CheckpointSink
    from gtm.settings import Settings

T = TypeVar("T")

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="topology YAML [GTM_CONFIG]")]
PoliciesOpt = Annotated[
    list[Path] | None, typer.Option("--policies", help="policy file or directory [GTM_POLICIES]")
]
DbOpt = Annotated[str | None, typer.Option("--database-url", help="[GTM_DATABASE_URL]")]
GeoOpt = Annotated[Path | None, typer.Option("--geoip-path", help="[GTM_GEOIP_PATH]")]


def fail(exc: GTMError) -> typer.Exit:
    if isinstance(exc, ConfigError):
        typer.echo(f"error: {len(exc.problems)} problem(s):", err=True)
        for problem in exc.problems:
            typer.echo(f"  {problem}", err=True)
    else:
        typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2)


def human_time(t: float, now: float | None = None) -> str:
    """A unix time as people read it, with how long ago (or until):
    ``2026-11-27 14:46:14 UTC (3 min ago)``."""
    now = time.time() if now is None else now
    stamp = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    delta = now - t
    span = abs(delta)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if span >= size or unit == "s":
            amount = f"{int(span // size)} {unit}"
            break
    if span < 1:
        return f"{stamp} (now)"
    return f"{stamp} ({amount} ago)" if delta > 0 else f"{stamp} (in {amount})"


def cli_settings(**overrides: Any) -> Settings:
    from gtm.logs import configure as configure_logs
    from gtm.settings import load_settings

    if overrides.get("policies"):
        overrides["policies"] = tuple(overrides["policies"])
    try:
        settings = load_settings(**overrides)
    except ConfigError as exc:
        raise fail(exc) from exc
    configure_logs(settings.log_format, settings.log_level)
    return settings


def run_async(coro: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await coro()

    return asyncio.run(main())


def checkpoint_sink(settings: Settings, where: str | None) -> CheckpointSink:
    """The checkpoint sink a command reads (``where``: a directory or ``s3://BUCKET/PREFIX``;
    None: the settings'); exit 2 with every problem when it cannot be used (loose credentials,
    say)."""
    from gtm.audit.checkpoints import open_sink

    try:
        return open_sink(settings, where)
    except ConfigError as exc:
        raise fail(exc) from exc


def run_with_sink(coro: Callable[[], Awaitable[T]]) -> T:
    """:func:`run_async` for a command that reads or writes the checkpoint sink: a sink that
    refuses (a bucket without Object Lock) or cannot be reached is an error, exit 2."""
    try:
        return run_async(coro)
    except ConfigError as exc:
        raise fail(exc) from exc
    except OSError as exc:
        typer.echo(f"error: the checkpoint sink: {exc}", err=True)
        raise typer.Exit(2) from exc
