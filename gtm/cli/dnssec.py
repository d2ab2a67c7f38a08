"""``gtm dnssec``: the zone's DNSSEC keys (make one; show the DS and DNSKEY for the parent)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import dns.name
import typer

from gtm.cli.common import ConfigOpt, cli_settings, fail
from gtm.decision.topology import load_topology
from gtm.errors import ConfigError, GTMError
from gtm.geodns.dnssec_keys import ZoneKey, generate, load_keys

dnssec_app = typer.Typer(
    help="DNSSEC online signing: keys, and the DS record for the parent zone.",
    no_args_is_help=True,
)

KeyOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--key-file",
        help="key file (repeatable); default: GTM_DNSSEC_KEY_FILE and GTM_DNSSEC_PUBLISH_KEY_FILES",
    ),
]
ZoneOpt = Annotated[
    str | None, typer.Option("--zone", help="the zone's apex; default: the topology's")
]


def _records(key: ZoneKey, apex: str, ttl: int, role: str, digest: str = "SHA256") -> list[str]:
    return [
        f"; key tag {key.tag}, {role}: {key.path}",
        f"{apex} {ttl} IN DS {key.ds(apex, digest).to_text()}",
        f"{apex} {ttl} IN DNSKEY {key.dnskey.to_text()}",
    ]


def _apex(zone: str | None, config: Path | None) -> tuple[str, int]:
    if zone is not None:
        try:
            return dns.name.from_text(zone).to_text().lower(), 3600
        except dns.name.NameTooLong as exc:
            typer.echo(f"error: --zone {zone!r}: {exc}", err=True)
            raise typer.Exit(2) from exc
    settings = cli_settings(config=config)
    try:
        topology = load_topology(settings.config)
    except GTMError as exc:
        raise fail(exc) from exc
    return topology.zone.apex, topology.zone.ttl


@dnssec_app.command("keygen")
def keygen(
    path: Annotated[Path, typer.Argument(help="the new key file (must not exist)")],
    zone: ZoneOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Write a new ECDSA P-256 (algorithm 13) signing key, mode 0600, and print its DS and
    DNSKEY. Give it to GTM as GTM_DNSSEC_KEY_FILE (signing) or in GTM_DNSSEC_PUBLISH_KEY_FILES
    (pre-published for a rollover)."""
    if path.exists():
        typer.echo(f"error: {path} exists: a key file is never overwritten", err=True)
        raise typer.Exit(2)
    apex, ttl = _apex(zone, config)
    try:
        key = generate(path)
    except OSError as exc:
        typer.echo(f"error: {path}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {path} (mode 0600), key tag {key.tag}", err=True)
    for line in _records(key, apex, ttl, "new"):
        typer.echo(line)


@dnssec_app.command("ds")
def ds(
    key_file: KeyOpt = None,
    zone: ZoneOpt = None,
    config: ConfigOpt = None,
    digest: Annotated[
        str, typer.Option("--digest", help="SHA256 (RFC 4509) or SHA384 (RFC 6605)")
    ] = "SHA256",
) -> None:
    """Print the DS record (for the parent zone) and the DNSKEY of every key: the signing one
    first, then the publish-only ones. A DS line is also what a validating resolver takes as
    the zone's trust anchor (unbound: trust-anchor: "<DS line>")."""
    if digest.upper() not in ("SHA256", "SHA384"):
        typer.echo(f"error: --digest {digest!r}: SHA256 or SHA384", err=True)
        raise typer.Exit(2)
    if key_file:
        paths = tuple(key_file)
    else:
        settings = cli_settings(config=config)
        if settings.dnssec_key_file is None:
            typer.echo("error: no key: give --key-file or set GTM_DNSSEC_KEY_FILE", err=True)
            raise typer.Exit(2)
        paths = (settings.dnssec_key_file, *settings.dnssec_publish_key_files)
    try:
        keys = load_keys(paths[0], paths[1:])
    except ConfigError as exc:
        raise fail(exc) from exc
    apex, ttl = _apex(zone, config)
    for i, key in enumerate(keys.all):
        role = "signing" if i == 0 else "published only"
        for line in _records(key, apex, ttl, role, digest.upper()):
            typer.echo(line)
