"""What every ``gtm`` sub-command shares: option types, settings, error reporting, asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from gtm.errors import ConfigError, GTMError
from gtm.logs import configure as configure_logs
from gtm.settings import Settings, load_settings

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


def cli_settings(**overrides: Any) -> Settings:
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
