"""Raw ASGI helpers for the proxy's hot path.

The OpenAI endpoints are served without a framework: routing, request objects, dependency
resolution and response classes cost more CPU per request than the whole routing decision
(the same choice ``gtm/front`` makes for the global front). A request here is its scope's
header list, the body read with a size limit, and responses written as two ASGI messages.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from regional_lb.balancing.admission import retry_after_header
from regional_lb.errors import RequestError
from regional_lb.protocol.openai_io import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"


class Disconnected(Exception):
    """The client went away while its request body was being read."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """First value of a (lower-case) header: a scan of a short list beats building a dict."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def text_header(scope: Scope, name: bytes) -> str | None:
    value = header(scope, name)
    return None if value is None else value.decode("latin-1")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refusing (413) past ``limit`` bytes without reading it all."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"The body is larger than {limit} bytes", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestError(
                    413, f"The body is larger than {limit} bytes", code="request_too_large"
                )
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_error(
    send: Send,
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    retry_after: float | None = None,
) -> None:
    """An OpenAI-style error body, with Retry-After when the client should come back."""
    extra = []
    if retry_after is not None:
        extra.append((b"retry-after", retry_after_header(retry_after).encode()))
        # Whole seconds are too coarse to spread retries; the OpenAI SDKs read this first.
        if 0 < retry_after < 3600:
            extra.append((b"retry-after-ms", str(max(1, round(retry_after * 1000))).encode()))
    body = json.dumps(error_body(message, type_, code, param)).encode()
    await respond(send, status, body, extra=extra)
