"""Writing whole responses as ASGI messages: the JSON body every unit of the front shares."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

NO_STORE = (b"cache-control", b"no-store")
_JSON = (b"content-type", b"application/json")


async def send_json(
    send: Send, status: int, body: Mapping[str, object], extra: list[tuple[bytes, bytes]]
) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = [_JSON, NO_STORE, (b"content-length", str(len(payload)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


__all__ = ["NO_STORE", "Message", "Receive", "Scope", "Send", "send_json"]
