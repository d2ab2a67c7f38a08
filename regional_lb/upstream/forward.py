"""Forwarding one leased request to its instance, with the lease ended on every path.

Streams are relayed chunk by chunk as they arrive. The lease (the request's claim on the
instance's outstanding work, rule 5) is ended by whichever comes first: the stream's normal
end, an upstream failure, the client going away, or cancellation; :func:`relay` ends it in
``finally`` too, so a path nobody thought of still releases the work.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

from regional_lb.protocol.asgi import Scope
from regional_lb.protocol.openai_io import error_body
from regional_lb.upstream.h1client import HopError, HopResponse, HopTimeout
from regional_lb.upstream.pool import Lease

# Only what an instance needs; hop-by-hop and client-specific headers stay here.
FORWARD_HEADERS = frozenset((b"authorization", b"accept", b"x-request-id"))
_JSON_TYPE = (b"content-type", b"application/json")


def upstream_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in scope["headers"] if k in FORWARD_HEADERS]
    out.append(_JSON_TYPE)
    return out


def sse_error(message: str, type_: str = "upstream_error") -> bytes:
    return f"data: {json.dumps(error_body(message, type_))}\n\n".encode()


def usage_tokens(tail: bytes) -> int | None:
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


def completion_tokens(content: bytes) -> int | None:
    """``usage.completion_tokens`` of a unary answer."""
    try:
        usage = json.loads(content).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    value = usage.get("completion_tokens")
    return value if isinstance(value, int) else None


async def relay(
    resp: HopResponse, lease: Lease, on_failure: Callable[[str], None], stall_s: float
) -> AsyncGenerator[bytes, None]:
    """Pass the instance's SSE bytes through, tracking progress for the estimator.

    A broken or stalled upstream ends the stream with an OpenAI-style error event instead of
    a silently truncated one; the client can tell a failure from a finished answer."""
    events = 0
    tail = b""
    clock = lease.pool.clock
    try:
        async for chunk in resp.chunks(stall_s):
            events += chunk.count(b"data:")
            tail = (tail + chunk)[-4096:]
            lease.progress(events, clock())
            yield chunk
        if b"[DONE]" not in tail:
            # The instance closed the stream cleanly but without finishing it.
            lease.end("upstream_error")
            on_failure("truncated")
            yield sse_error("the instance ended the stream early")
            return
        tokens = usage_tokens(tail)
        lease.end("ok", tokens if tokens is not None else max(events - 2, 0))
    except HopTimeout:
        lease.end("upstream_error")  # stalled: no tokens for the stall timeout
        on_failure("stall")
        yield sse_error("the instance stalled (no tokens within the stall timeout)")
    except HopError as exc:
        lease.end("upstream_error")
        on_failure("broken_stream")
        yield sse_error(f"the instance failed mid-stream: {exc}")
    except (asyncio.CancelledError, GeneratorExit):
        lease.end("client_gone")
        raise
    finally:
        resp.close()  # aborting an unfinished answer is what cancels the upstream request
        lease.end("cancelled")
