"""The console's only way to the data: the admin API, called in this process with the signed-in
person's bearer token, through the same routes, role checks and event log as any client."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.types import ASGIApp

# Never resolved: requests go straight to the ASGI app in this process.
_BASE = "http://admin.console.internal"


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def message(self) -> str:
        """The API's own words for a refusal, with every problem it listed."""
        if self.ok:
            return ""
        if not isinstance(self.body, dict):
            return f"HTTP {self.status}"
        text = str(self.body.get("message") or self.body.get("error") or f"HTTP {self.status}")
        problems = self.body.get("problems") or []
        details = [
            f"{p.get('location') or p.get('source') or ''}: {p.get('message', '')}".lstrip(": ")
            for p in problems
            if isinstance(p, dict)
        ]
        return text if not details else text + " — " + "; ".join(details)


class Api:
    def __init__(self, app: ASGIApp, token: str) -> None:
        self._client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url=_BASE,
            headers={"authorization": f"Bearer {token}"},
            timeout=120,
        )

    async def __aenter__(self) -> Api:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def get(self, path: str, params: Mapping[str, Any] | None = None) -> Reply:
        clean = {k: v for k, v in (params or {}).items() if v not in (None, "")}
        return _reply(await self._client.get(path, params=clean))

    async def post(self, path: str, body: Any = None) -> Reply:
        return _reply(await self._client.post(path, json=body))

    async def put(self, path: str, body: Any = None) -> Reply:
        return _reply(await self._client.put(path, json=body))

    async def delete(self, path: str) -> Reply:
        return _reply(await self._client.delete(path))

    async def raw(self, path: str, params: Mapping[str, Any] | None = None) -> httpx.Response:
        clean = {k: v for k, v in (params or {}).items() if v not in (None, "")}
        return await self._client.get(path, params=clean)


def _reply(response: httpx.Response) -> Reply:
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = response.text
    return Reply(response.status_code, body, dict(response.headers))


__all__ = ["Api", "Reply"]
