"""``gtm dns``: the DNS responder's secrets (the DNS cookie secret)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gtm.geodns.cookies import new_secret
from gtm.secret_files import write_new_owner_only

dns_app = typer.Typer(help="The DNS responder: its cookie secret.", no_args_is_help=True)


@dns_app.command("cookie-secret")
def cookie_secret(
    path: Annotated[Path, typer.Argument(help="the new secret file (must not exist)")],
) -> None:
    """Write a new DNS cookie secret (RFC 9018: 16 random octets as hex), mode 0600. Give the
    same file to every node of an anycast set as GTM_DNS_COOKIE_SECRET_FILE. The first line
    makes cookies, a second is accepted too. To roll it over, everywhere: add the new secret as
    the second line; then swap the two lines; an hour later, drop the old one (docs/runbook.md)."""
    try:
        write_new_owner_only(path, new_secret().encode())
    except FileExistsError as exc:
        typer.echo(f"error: {path} exists: a secret file is never overwritten", err=True)
        raise typer.Exit(2) from exc
    except OSError as exc:
        typer.echo(f"error: {path}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {path} (mode 0600): GTM_DNS_COOKIE_SECRET_FILE={path}", err=True)
