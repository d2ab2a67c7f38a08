"""The console's only way to the data: the admin API, called in this process with the signed-in
person's bearer token, through the same routes, role checks and event log as any client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx
from starlette.types import ASGIApp, Message

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


@dataclass
class Stream:
    """A response whose body arrives as the API sends it (an export of any size)."""

    status: int
    headers: Mapping[str, str]
    body: AsyncIterator[bytes]


class Api:
    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._token = token
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

    async def stream(self, path: str, params: Mapping[str, Any] | None = None) -> Stream:
        """GET ``path`` with the body passed on chunk by chunk. httpx's ASGI transport gathers
        a whole body before it returns, which for an export means the whole audit in memory;
        this calls the app itself, with a short queue between it and the reader, so the API's
        streaming stays bounded through the console."""
        clean = {k: str(v) for k, v in (params or {}).items() if v not in (None, "")}
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": urlencode(clean).encode(),
            "root_path": "",
            "headers": [(b"authorization", f"Bearer {self._token}".encode())],
            "client": ("127.0.0.1", 0),
            "server": ("admin.console.internal", 80),
        }
        messages: asyncio.Queue[Message] = asyncio.Queue(maxsize=8)  # backpressure
        done = asyncio.Event()

        async def receive() -> Message:
            await done.wait()  # a GET has no body; after the response, the client is gone
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await messages.put(message)

        async def run() -> None:
            try:
                await self._app(scope, receive, send)
            finally:
                await messages.put({"type": "http.response.body", "more_body": False})

        task = asyncio.create_task(run())
        start = await messages.get()
        status = int(start.get("status", 500))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    message = await messages.get()
                    if message["type"] != "http.response.body":
                        continue
                    if chunk := message.get("body", b""):
                        yield chunk
                    if not message.get("more_body", False):
                        break
            finally:
                done.set()
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        return Stream(status, headers, body())


def _reply(response: httpx.Response) -> Reply:
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = response.text
    return Reply(response.status_code, body, dict(response.headers))


__all__ = ["Api", "Reply", "Stream"]
