"""Forwarding one leased request to its instance, with the lease ended on every path.

Streams are relayed chunk by chunk as they arrive. The lease (the request's claim on the
instance's outstanding work, rule 5) is ended by whichever comes first: the stream's normal
end, an upstream failure, the client going away, or cancellation; :func:`relay` ends it in
``finally`` too, so a path nobody thought of still releases the work.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Sequence

from regional_lb.protocol.asgi import Scope
from regional_lb.protocol.openai_io import error_body
from regional_lb.upstream.h1client import HopError, HopResponse, HopTimeout
from regional_lb.upstream.pool import Lease
from regional_lb.upstream.profiles import Upstream

# Only what an instance needs; hop-by-hop and client-specific headers stay here.
FORWARD_HEADERS = frozenset((b"authorization", b"accept", b"x-request-id"))
_JSON_TYPE = (b"content-type", b"application/json")
# Never relayed from an instance: hop-by-hop, the framing the balancer redoes, and the ones it
# sets itself. Everything else (request ids, x-ratelimit-*, processing times) reaches the client.
_NOT_RELAYED = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"content-length",
        b"content-type",
        b"cache-control",
        b"date",
        b"server",
    )
)


def upstream_headers(
    scope: Scope,
    upstream: Upstream,
    client_key_used: bool,
    trace: Sequence[tuple[bytes, bytes]] = (),
) -> list[tuple[bytes, bytes]]:
    """The headers sent to an instance. Its credential replaces the client's Authorization
    (or fills in for a missing one, in pass mode); a client key the balancer verified is
    the balancer's, never an instance's, so it is not passed on. ``trace``: the balancer's
    own W3C trace context (``traceparent``) while tracing is on; a client's is never passed
    on (it is not in :data:`FORWARD_HEADERS`), since the instance's spans belong under ours."""
    ours = upstream.auth_header_name
    out: list[tuple[bytes, bytes]] = []
    client_auth = False
    for k, v in scope["headers"]:
        if k not in FORWARD_HEADERS or k == ours:
            if k == ours and not upstream.replace_client_auth and not client_key_used:
                out.append((k, v))
                client_auth = True
            continue
        if k == b"authorization" and (client_key_used or (ours and upstream.replace_client_auth)):
            continue
        out.append((k, v))
    if ours is not None and not client_auth:
        out.extend(upstream.auth_bytes)
    out.append(_JSON_TYPE)
    out.extend(trace)
    return out


def relayed_headers(resp: HopResponse) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in resp.headers if k.lower() not in _NOT_RELAYED]


def sse_error(message: str, type_: str = "server_error", code: str = "upstream_error") -> bytes:
    return f"data: {json.dumps(error_body(message, type_, code))}\n\n".encode()


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
    resp: HopResponse,
    lease: Lease,
    on_failure: Callable[[str], None],
    stall_s: float,
    first_token_s: float | None = None,
    queued: Callable[[], bool] = lambda: False,
) -> AsyncGenerator[bytes, None]:
    """Pass the instance's SSE bytes through, tracking progress for the estimator.

    The stall timer runs between events, from the first one on: servers send their headers
    before the first token, and a request may sit in the server's queue until then, which
    ``first_token_s`` bounds instead. Running out of that while the server reports queued
    requests (``queued``) is a busy instance, not a broken one: the client gets the error,
    the instance is not charged with a failure.

    A broken or stalled upstream ends the stream with an OpenAI-style error event instead of
    a silently truncated one; the client can tell a failure from a finished answer."""
    events = 0
    tail = b""
    clock = lease.pool.clock
    try:
        while True:
            try:
                chunk = await resp.next_chunk(stall_s if events else (first_token_s or stall_s))
            except HopTimeout:
                if events or first_token_s is None:
                    raise
                if queued():
                    lease.end("cancelled")  # busy: counts nothing against the instance
                    yield sse_error(
                        f"no first token within {first_token_s:g} s: the instance is queueing",
                        "server_error",
                        "first_token_timeout",
                    )
                    return
                lease.end("upstream_error")
                on_failure("first_token_timeout")
                yield sse_error(f"the instance sent no first token within {first_token_s:g} s")
                return
            if chunk is None:
                break
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
