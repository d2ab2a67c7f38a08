"""Forwarding one request to an instance, with the lease ended on every path.

Streams are relayed chunk by chunk as they arrive. The lease (the request's claim on the
instance's outstanding work, rule 5) is ended by whichever comes first: the stream's normal
end, an upstream failure, the client going away, or the response object being torn down
(:class:`LeasedStream` ends it in ``finally`` even when the body was never iterated).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from regional_lb.openai_io import error_body
from regional_lb.pool import Lease

FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


class LeasedStream(StreamingResponse):
    """A streaming response that always runs ``on_close``, however the ASGI call ends."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def sse_error(message: str, type_: str = "upstream_error") -> bytes:
    return f"data: {json.dumps(error_body(message, type_))}\n\n".encode()


def _usage_tokens(tail: bytes) -> int | None:
    """``usage.completion_tokens`` from the last events of a stream, when the server sent it."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = json.loads(line[6:]).get("usage") or {}
            except ValueError:
                return None
            value = usage.get("completion_tokens")
            return value if isinstance(value, int) else None
    return None


async def relay(
    resp: httpx.Response, lease: Lease, on_failure: Callable[[str], None]
) -> AsyncIterator[bytes]:
    """Pass the instance's SSE bytes through, tracking progress for the estimator.

    A broken or stalled upstream ends the stream with an OpenAI-style error event instead of
    a silently truncated one; the client can tell a failure from a finished answer."""
    events = 0
    tail = b""
    try:
        async for chunk in resp.aiter_raw():
            events += chunk.count(b"data:")
            tail = (tail + chunk)[-4096:]
            lease.progress(events, time.monotonic())
            yield chunk
        if b"[DONE]" not in tail:
            # The instance closed the stream cleanly but without finishing it.
            lease.end("upstream_error")
            on_failure("truncated")
            yield sse_error("the instance ended the stream early")
            return
        tokens = _usage_tokens(tail)
        lease.end("ok", tokens if tokens is not None else max(events - 2, 0))
    except httpx.ReadTimeout:
        lease.end("upstream_error")  # stalled: no tokens for the stall timeout
        on_failure("stall")
        yield sse_error("the instance stalled (no tokens within the stall timeout)")
    except httpx.HTTPError as exc:
        lease.end("upstream_error")
        on_failure("broken_stream")
        yield sse_error(f"the instance failed mid-stream: {type(exc).__name__}")
    except (asyncio.CancelledError, GeneratorExit):
        lease.end("client_gone")
        raise
    finally:
        await resp.aclose()  # closing the connection is what cancels the upstream request
        lease.end("cancelled")


def build_request(
    client: httpx.AsyncClient,
    lease: Lease,
    path: str,
    content: bytes,
    headers: Mapping[str, str],
    timeout: httpx.Timeout,
) -> httpx.Request:
    """The upstream request: the client's own bytes when unchanged (no re-encoding), only the
    headers an instance needs, and this request's timeouts."""
    forwarded = {k: v for k, v in headers.items() if k in FORWARD_HEADERS}
    forwarded["content-type"] = "application/json"
    return client.build_request(
        "POST", lease.instance.url + path, content=content, headers=forwarded, timeout=timeout
    )


async def open_upstream(
    client: httpx.AsyncClient, request: httpx.Request, first_byte_s: float
) -> httpx.Response:
    """Send and wait for the response head, within the first-byte timeout."""
    try:
        async with asyncio.timeout(first_byte_s):  # no extra task, unlike wait_for
            return await client.send(request, stream=True)
    except TimeoutError:
        raise httpx.ReadTimeout(
            "no response head within the first-byte timeout", request=request
        ) from None


def close_task(resp: httpx.Response) -> BackgroundTask:
    return BackgroundTask(resp.aclose)
