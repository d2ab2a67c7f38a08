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


def _send(method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
    with _client() as client:
        try:
            return client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise fail(GTMError(f"admin API unreachable: {exc}")) from exc


def _error_of(response: httpx.Response) -> dict[str, Any]:
    try:
        error = response.json()
    except ValueError:
        error = None
    if not isinstance(error, dict):
        error = {"error": str(response.status_code), "message": response.text}
    return error


def _exit_with(response: httpx.Response) -> typer.Exit:
    error = _error_of(response)
    code, message = error.get("error"), error.get("message")
    typer.echo(f"error: {response.status_code} {code}: {message}", err=True)
    for problem in error.get("problems", []):
        where = f"{problem['source']}: {problem['location']}"
        typer.echo(f"  {where}: {problem['message']}", err=True)
    return typer.Exit(1 if response.status_code in (403, 409) else 2)


def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON of a successful response; anything else is printed and exits."""
    response = _send(method, path, body)
    if response.status_code >= 400:
        raise _exit_with(response)
    return response.json() if response.content else None


def call_or_refusal(
    method: str, path: str, body: dict[str, Any] | None, code: str
) -> tuple[Any, dict[str, Any] | None]:
    """(JSON, None) on success; (None, the error) when the API refused with ``code``, which the
    command answers itself (an acknowledgement to ask for, say); anything else exits."""
    response = _send(method, path, body)
    if response.status_code < 400:
        return (response.json() if response.content else None), None
    error = _error_of(response)
    if error.get("error") == code:
        return None, error
    raise _exit_with(response)
