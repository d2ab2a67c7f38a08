"""Proxy (anycast) mode: forward a request to the chosen region and stream the answer back.

One retry at most, and only while nothing has reached the client: when the chosen region
refuses the connection or answers 5xx, the next allowed, healthy region (the caller passes the
targets, all inside the allowed set) gets the request, if the retry budget allows. Once the
first byte of a response has been sent the answer belongs to that region: a failure mid-stream
ends the client's response abruptly (the connection is closed without the final chunk, so the
client sees an incomplete message rather than a silently truncated "success") and is never
retried, because part of an answer has already been delivered.

The request body is read in full (bounded) before forwarding, so a retry can send it again;
inference requests are small JSON documents, and the bound answers 413 rather than buffering
without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import structlog
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context

from gtm import tracing
from gtm.front.connections import body_timed_out

log = structlog.get_logger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
RegionHeaders = Callable[[str, int], list[tuple[bytes, bytes]]]

# Hop-by-hop headers (RFC 9110 section 7.6.1) are for one connection, never forwarded; host and
# content-length are set again for the upstream request; forwarding headers are rebuilt from
# what the front itself believes about the client.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED = _HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"forwarded",
    b"x-forwarded-for",
    b"x-forwarded-host",
    b"x-forwarded-proto",
    b"expect",
}
_NOT_RETURNED = _HOP_BY_HOP | {b"date", b"server"}
# While tracing, the front's own trace context replaces the client's (gtm.tracing: the client's
# is linked, not continued).
_NOT_FORWARDED_TRACED = _NOT_FORWARDED | tracing.TRACE_HEADERS


def end_to_end(
    headers: Sequence[tuple[bytes, bytes]], dropped: frozenset[bytes] | set[bytes]
) -> list[tuple[bytes, bytes]]:
    """``headers`` (lower-case names) without ``dropped`` and without the headers the message's
    own ``Connection`` header names: those are hop-by-hop too, and a proxy must not pass them
    on (RFC 9110 section 7.6.1)."""
    listed: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            listed.update(token.strip().lower() for token in value.split(b","))
    return [(k, v) for k, v in headers if k not in dropped and k not in listed]


@dataclass(frozen=True, slots=True)
class ProxyLimits:
    connect_timeout_s: float = 2.0
    # Between two chunks of a response: a model can take a while to produce the first token.
    read_timeout_s: float = 300.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 5.0
    max_connections: int = 1000
    max_keepalive: int = 200
    max_body_bytes: int = 4 * 1024 * 1024
    # Retry budget: each request earns ``retry_ratio`` of a retry, at most ``retry_burst`` banked
    # (a region going down does not turn every request into two).
    retry_ratio: float = 0.2
    retry_burst: float = 20.0


class RetryBudget:
    """A token bucket of retries, filled by requests rather than by time."""

    def __init__(self, ratio: float, burst: float) -> None:
        self.ratio = ratio
        self.burst = burst
        self.tokens = burst
        self.spent = 0
        self.refused = 0

    def deposit(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def try_spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.spent += 1
            return True
        self.refused += 1
        return False


class Target(NamedTuple):
    region: str
    base_url: str


class ProxyResult(NamedTuple):
    status: int  # what the client was sent (0: nothing, the client went away first)
    region: str | None  # the region that answered
    base_url: str | None
    note: str  # retries and failures, for the audit row's response field
    aborted: bool  # the response started and then broke off


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class BodyTimedOut(Exception):
    """The body stalled or trickled past its deadline (:mod:`gtm.front.connections`)."""


async def read_body(receive: Receive, limit: int, scope: Scope | None = None) -> bytes:
    """The whole request body, or :class:`BodyTooLarge` / :class:`ClientGone` /
    :class:`BodyTimedOut` (the protocol gave up on it; ``scope`` says so)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        if scope is not None and message.get("more_body", False) and body_timed_out(scope):
            raise BodyTimedOut
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Forwarder:
    """The pooled upstream client and the retry budget, shared by every proxied request."""

    def __init__(self, limits: ProxyLimits = ProxyLimits()) -> None:
        self.limits = limits
        self.budget = RetryBudget(limits.retry_ratio, limits.retry_burst)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=limits.connect_timeout_s,
                read=limits.read_timeout_s,
                write=limits.write_timeout_s,
                pool=limits.pool_timeout_s,
            ),
            limits=httpx.Limits(
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive,
            ),
            follow_redirects=False,
            trust_env=False,  # an HTTP_PROXY in the environment must not reroute regions
        )
        self.tracer = tracing.tracer("gtm.front")  # None while tracing is off

    async def aclose(self) -> None:
        await self.client.aclose()

    async def forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        targets: Sequence[Target],
        body: bytes,
        upstream_headers: list[tuple[bytes, bytes]],
        response_headers: list[tuple[bytes, bytes]],
        span: Span | None = None,
        region_headers: RegionHeaders | None = None,
    ) -> ProxyResult:
        """Forward to ``targets[0]``, retrying ``targets[1]`` once before the first byte.
        ``span``: the request's span while tracing; each attempt is a child of it, and the
        region continues the attempt's trace context. ``region_headers``: more headers for the
        client, given the region whose answer it gets and that answer's status."""
        self.budget.deposit()
        method = scope["method"]
        path = scope["raw_path"] or scope["path"].encode()
        query = scope["query_string"]
        tracer = self.tracer if span is not None else None
        headers = end_to_end(
            scope["headers"], _NOT_FORWARDED if tracer is None else _NOT_FORWARDED_TRACED
        )
        headers.extend(upstream_headers)
        notes: list[str] = []
        for attempt, target in enumerate(targets[:2]):
            if attempt == 1 and not self.budget.try_spend():
                notes.append("retry budget exhausted")
                break
            url = target.base_url + path.decode("latin-1")
            if query:
                url += "?" + query.decode("latin-1")
            hop = None
            sent = headers
            if tracer is not None:
                hop = tracer.start_span(
                    f"{method} {target.region}",
                    context=set_span_in_context(span) if span is not None else None,
                    kind=SpanKind.CLIENT,
                    attributes={"gtm.region": target.region, "gtm.attempt": attempt + 1},
                )
                sent = [*headers, *tracing.traceparent(hop)]
            try:
                request = self.client.build_request(method, url, headers=sent, content=body)
                try:
                    response = await self.client.send(request, stream=True)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    notes.append(f"{target.region}: connect failed ({type(exc).__name__})")
                    _failed(hop, notes[-1])
                    continue
                except httpx.TimeoutException as exc:
                    # The region accepted the request and did not answer in time: it may be
                    # working on it, so it is not sent elsewhere as well.
                    notes.append(f"{target.region}: {type(exc).__name__}")
                    _failed(hop, notes[-1])
                    await _send_error(send, 504, "upstream timed out", response_headers)
                    return ProxyResult(504, target.region, target.base_url, "; ".join(notes), False)
                except httpx.HTTPError as exc:
                    notes.append(f"{target.region}: {type(exc).__name__}")
                    _failed(hop, notes[-1])
                    await _send_error(send, 502, "upstream failed", response_headers)
                    return ProxyResult(502, target.region, target.base_url, "; ".join(notes), False)
                if hop is not None:
                    hop.set_attribute("http.response.status_code", response.status_code)
                    if response.status_code >= 500:
                        hop.set_status(StatusCode.ERROR)
                if (
                    response.status_code >= 500
                    and attempt == 0
                    and len(targets) > 1
                    and self.budget.tokens >= 1.0
                ):
                    notes.append(f"{target.region}: {response.status_code}")
                    await response.aclose()
                    continue
                extra = response_headers
                if region_headers is not None:
                    extra = [*extra, *region_headers(target.region, response.status_code)]
                result = await self._stream(receive, send, response, target, extra, notes)
                if result.aborted:
                    _failed(hop, result.note)
                return result
            finally:
                if hop is not None:
                    hop.end()
        await _send_error(send, 502, "no region could be reached", response_headers)
        return ProxyResult(502, None, None, "; ".join(notes), False)

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        response: httpx.Response,
        target: Target,
        response_headers: list[tuple[bytes, bytes]],
        notes: list[str],
    ) -> ProxyResult:
        headers = end_to_end([(k.lower(), v) for k, v in response.headers.raw], _NOT_RETURNED)
        headers.append((b"x-gtm-region", target.region.encode()))
        headers.extend(response_headers)
        aborted = False
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": headers}
            )
            pump = asyncio.ensure_future(self._pump(response, send))
            done, _ = await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump not in done:
                # The client went away: stop reading the region's stream so it can stop
                # generating (closing the upstream connection is its cancel signal).
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
                notes.append("client disconnected")
                aborted = True
            elif (exc := pump.exception()) is not None:
                notes.append(f"{target.region}: failed mid-stream ({type(exc).__name__})")
                log.warning("front.proxy_midstream_failure", region=target.region, error=str(exc))
                aborted = True
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await response.aclose()
        return ProxyResult(
            response.status_code, target.region, target.base_url, "; ".join(notes), aborted
        )

    @staticmethod
    async def _pump(response: httpx.Response, send: Send) -> None:
        async for chunk in response.aiter_raw():
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _failed(span: Span | None, why: str) -> None:
    if span is not None:
        span.set_status(StatusCode.ERROR, why)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _send_error(
    send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]]
) -> None:
    body = b'{"error":"' + message.replace(" ", "_").encode() + b'","message":"'
    body += message.encode() + b'"}'
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
