"""The CLI's client of the admin API: ``GTM_ADMIN_URL`` and the bearer token in
``GTM_ADMIN_TOKEN``; errors printed in the API's own shape (code, message, every problem).

Exit codes: 1 when the API refused the change (403, 409: a rule, not a typo), 2 for bad input
or an unreachable API.
"""

from __future__ import annotations

from typing import Any

import httpx
import typer

from gtm.cli.common import cli_settings, fail
from gtm.errors import GTMError


def _client() -> httpx.Client:
    settings = cli_settings()
    if not settings.admin_url or settings.admin_token is None:
        raise fail(GTMError("set GTM_ADMIN_URL and GTM_ADMIN_TOKEN (the admin API and a token)"))
    return httpx.Client(
        base_url=settings.admin_url,
        headers={"authorization": f"Bearer {settings.admin_token.get_secret_value()}"},
        timeout=30,
    )


def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON of a successful response; anything else is printed and exits."""
    with _client() as client:
        try:
            response = client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise fail(GTMError(f"admin API unreachable: {exc}")) from exc
    if response.status_code >= 400:
        try:
            error = response.json()
        except ValueError:
            error = {"error": str(response.status_code), "message": response.text}
        code, message = error.get("error"), error.get("message")
        typer.echo(f"error: {response.status_code} {code}: {message}", err=True)
        for problem in error.get("problems", []):
            where = f"{problem['source']}: {problem['location']}"
            typer.echo(f"  {where}: {problem['message']}", err=True)
        raise typer.Exit(1 if response.status_code in (403, 409) else 2)
    return response.json() if response.content else None
