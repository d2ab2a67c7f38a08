"""Forwarding one leased request to its instance, with the lease ended on every path.

Streams are relayed chunk by chunk as they arrive. The lease (the request's claim on the
instance's outstanding work, rule 5) is ended by whichever comes first: the stream's normal
end, an upstream failure, the client going away, or cancellation; :func:`relay` ends it in
``finally`` too, so a path nobody thought of still releases the work.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

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


_DEFAULT_CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    429: "rate_limit_exceeded",
}


def upstream_error(status: int, content: bytes) -> bytes:
    """An instance's error answer in the OpenAI shape, with its own words: servers say them as
    OpenAI does (vLLM, llama-cpp-python's 500s), as ``{"error": "..."}`` (TGI, vLLM's 401),
    as FastAPI's ``{"detail": ...}`` (llama-cpp-python's 401), or as plain text."""
    message: str | None = None
    fields: dict[str, Any] = {}
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict):
            fields = err
            message = err.get("message") if isinstance(err.get("message"), str) else None
        elif isinstance(err, str):
            message = err
            fields = {"type": doc.get("error_type")}
        detail = doc.get("detail")
        if message is None and isinstance(detail, str):
            message = detail
        elif message is None and isinstance(detail, list) and detail:
            first = detail[0]
            message = str(first.get("msg")) if isinstance(first, dict) else str(first)
        if message is None and isinstance(doc.get("message"), str):
            message = doc["message"]
    if message is None:
        text = content.decode("utf-8", "replace").strip()
        message = text[:2000] or f"the instance answered {status} without a message"
    type_ = fields.get("type")
    if not isinstance(type_, str) or not type_:
        type_ = "server_error" if status >= 500 else "invalid_request_error"
    code = fields.get("code")
    if code is None or code == "":
        code = _DEFAULT_CODES.get(status) or ("upstream_error" if status >= 500 else None)
    param = fields.get("param")
    body = error_body(
        message,
        type_,
        None if code is None else str(code),
        param if isinstance(param, str) else None,
    )
    return json.dumps(body).encode()


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


_DONE = b"data: [DONE]"
# The end of an OpenAI stream at the start of a line; the space after the colon is optional
# in SSE, and some servers leave it out.
_DONE_LINE = re.compile(rb"(?:^|(?<=[\r\n]))data: ?\[DONE\]")
_EVENT_ENDS = (b"\r\n\r\n", b"\n\n", b"\r\r")


def done_end(carry: bytes, chunk: bytes) -> int | None:
    """Where the ``data: [DONE]`` event ends in ``chunk`` (with its blank line, when it is in
    this chunk), or None when the chunk does not finish one; ``carry``: the bytes before the
    chunk, so a marker split between two chunks is found."""
    window = carry + chunk
    match = _DONE_LINE.search(window)
    if match is None:
        return None
    end = match.end()
    for sep in _EVENT_ENDS:
        if window.startswith(sep, end):
            end += len(sep)
            break
    return max(0, end - len(carry))


def _finish_event(piece: bytes) -> bytes:
    """Complete the blank line after ``[DONE]`` when the server's was cut off with the rest."""
    if piece.endswith(_EVENT_ENDS):
        return piece
    if piece.endswith(b"\r\n"):
        return piece + b"\r\n"
    if piece.endswith((b"\n", b"\r")):
        return piece + piece[-1:]
    return piece + b"\n\n"


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
    a silently truncated one; the client can tell a failure from a finished answer. A stream
    ends once: nothing is relayed after ``data: [DONE]``, and a server that closes the
    connection after it (llama-cpp-python does, when it interrupts a stream) has answered."""
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
            cut = done_end(tail[-len(_DONE) - 1 :], chunk)
            if cut is not None:
                chunk = _finish_event(chunk[:cut])
            events += chunk.count(b"data:")
            tail = (tail + chunk)[-4096:]
            lease.progress(events, clock())
            if cut is not None:
                tokens = usage_tokens(tail)
                lease.end("ok", tokens if tokens is not None else max(events - 2, 0))
                yield chunk
                await _discard_rest(resp, stall_s)
                return
            yield chunk
        # The instance closed the stream cleanly but without finishing it.
        lease.end("upstream_error")
        on_failure("truncated")
        yield sse_error("the instance ended the stream early")
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


async def _discard_rest(resp: HopResponse, stall_s: float) -> None:
    """Read what follows ``[DONE]`` to the end of the response (normally nothing but the
    chunked terminator, which makes the connection reusable), relaying none of it; a close
    or a silence there costs the answer nothing."""
    try:
        while await resp.next_chunk(min(stall_s, 1.0)) is not None:
            pass
    except HopError:
        pass
