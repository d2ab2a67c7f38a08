"""The ceiling of Python here: a bare ASGI app that answers every request with a fixed 307.

Served by uvicorn with uvloop and httptools, like the front, with the same response headers;
whatever the front does beyond this (a decision, residency signals, audit counting) shows as
the gap to this app's rate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

_START = {
    "type": "http.response.start",
    "status": 307,
    "headers": [
        (b"location", b"http://127.0.0.1:8103/v1/chat/completions"),
        (b"cache-control", b"no-store"),
        (b"x-gtm-region", b"eu-west"),
        (b"x-gtm-decision-id", b"bench-000000-1"),
        (b"content-length", b"0"),
    ],
}
_BODY = {"type": "http.response.body", "body": b""}


async def app(
    scope: dict[str, Any],
    receive: Callable[[], Awaitable[Any]],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    if scope["type"] == "http":
        await send(_START)
        await send(_BODY)
