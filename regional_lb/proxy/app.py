"""``regional-lb serve``: the OpenAI-compatible balancer in front of one region's instances.

Request path: read the body (size-limited) -> validate -> tenant rate limit -> tier ->
model version -> cost estimate -> admission (queue or 429) -> pick -> lease -> forward.
Nothing is counted as outstanding until the lease is taken, so rejected input never is; from
then on the lease is ended on every path (rule 5).

The OpenAI endpoints are raw ASGI on a lean upstream client (:mod:`regional_lb.upstream.h1client`):
with FastAPI and httpx on this path the balancer spent ~2 ms of CPU per request, against a
budget of 1 ms for the whole hop at p99. Everything else (admin, reports, metrics) is a
FastAPI app the dispatcher hands over to (:mod:`regional_lb.proxy.admin`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
from fastapi import FastAPI
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer

from regional_lb import tracing
from regional_lb.balancing.affinity import key_of, prompt_prefix
from regional_lb.balancing.cost import Endpoint, RequestShape
from regional_lb.balancing.instance import InstanceState
from regional_lb.balancing.kv_index import KvIndex
from regional_lb.config import BalancerConfig, body_limit, kv_index_on
from regional_lb.errors import NoInstanceError, Overloaded, RequestError
from regional_lb.metrics import BalancerMetrics
from regional_lb.protocol.asgi import (
    Disconnected,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    respond_error,
    text_header,
)
from regional_lb.protocol.kv_prompt import prompt_block_hashes
from regional_lb.protocol.openai_io import PATHS, parse_request
from regional_lb.proxy.admin import create_admin_app
from regional_lb.proxy.identity import Caller, Identities
from regional_lb.upstream.cache_stats import CacheStats
from regional_lb.upstream.forward import (
    completion_tokens,
    relay,
    relayed_headers,
    upstream_error,
    upstream_headers,
)
from regional_lb.upstream.h1client import ConnectFailed, H1Client, HopError, HopResponse, HopTimeout
from regional_lb.upstream.kv_streams import KvCollector, KvStreams
from regional_lb.upstream.pool import Lease, Pool
from regional_lb.upstream.probes import Background

_SSE = b"text/event-stream"
# The global front names its decision to the region in proxy mode (gtm.front.app).
_DECISION_ID = b"x-gtm-decision-id"


class _DisconnectWatch:
    """Cancels the request's task when its client goes away.

    uvicorn does not cancel a handler whose client disconnected; it only makes ``receive()``
    return ``http.disconnect``. One small task waits for that and cancels the handler, which
    then stops waiting in the admission queue or on the instance, and aborts the upstream
    connection (which is what stops the instance working on it). ``done`` is set before the
    last response message, because completing the response also wakes ``receive()``."""

    __slots__ = ("done", "gone", "task", "watcher")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.done = False
        self.gone = False
        self.watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.done = True
        if not self.watcher.done():
            self.watcher.cancel()

    def claim_cancel(self) -> bool:
        """True when a CancelledError came from this watch (the client left); it is then
        consumed, so the handler can finish its bookkeeping instead of unwinding."""
        if self.gone:
            self.task.uncancel()
            return True
        return False


class Balancer:
    """The ASGI app: the OpenAI endpoints on the fast path, the rest to FastAPI."""

    def __init__(self, config: BalancerConfig, secret: bytes | None, clock: Any) -> None:
        self.config = config
        self.pool = pool = Pool(config, clock=clock)
        self.metrics = metrics = BalancerMetrics(
            lambda: pool.instances,
            pool.admission.depth,
            pool.estimator.learned,
            pool.utilisation,
        )
        pool.on_ejected = lambda inst: metrics.ejections.labels(inst.id).inc()
        # Prefix-cache routing: the index, fed by the instances' KV events where configured.
        self.kv: KvStreams | None = None
        if kv_index_on(config):
            kc = config.kv_cache
            pool.kv_index = KvIndex(kc.max_blocks, kc.block_size)
            self.kv = KvStreams(config, pool.kv_index, pool.clock)
            metrics.registry.register(KvCollector(self.kv, lambda: [i.id for i in pool.instances]))
        t = config.timeouts
        self.upstream = H1Client(connect_timeout=t.connect_s)
        # None while tracing is off (regional_lb.tracing): the request path checks only that.
        self.tracer = tracing.tracer("regional_lb.proxy")
        self._seq = 0
        self.cache = CacheStats()  # fed by the metrics scrapes (Background)
        # ASGI header names arrive lower-cased, as bytes.
        self.identities = Identities(config)
        self._tier_h = config.tier_header.lower().encode("latin-1")
        self._session_h = config.affinity.session_header.lower().encode("latin-1")
        # Counters resolved once: a labels() lookup per request is measurable here.
        self._handled = metrics.requests.labels("handled")
        self._bad = metrics.requests.labels("bad_request")
        self._gone = metrics.requests.labels("client_gone")
        self._r429 = metrics.rejected.labels("429", "overloaded")
        self._r503 = metrics.rejected.labels("503", "no_instance")
        self.admin = create_admin_app(
            pool, metrics, secret, self.next_report, self._lifespan, self.kv
        )
        self.admin.state.pool = pool
        self.admin.state.metrics = metrics
        self.state = self.admin.state
        self.secret = secret

    def next_report(self) -> tuple[bytes, int]:
        self._seq += 1
        pool = self.pool
        cache = self.cache.figures(
            [i.id for i in pool.serving()], time.monotonic(), self.config.scrape.stale_after_s
        )
        report = pool.capacity_report(self._seq, cache)
        return report.model_dump_json().encode(), 200 if report.can_take_work else 503

    @asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        t = self.config.timeouts
        timeouts = httpx.Timeout(t.connect_s, read=t.read_s, write=t.read_s, pool=t.pool_s)
        # Probes, scrapes and report pushes: pooled keep-alive, no Nagle delay.
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        )
        async with httpx.AsyncClient(transport=transport, timeout=timeouts) as client:
            background = Background(
                self.pool, client, self.metrics, self.secret, self.next_report, self.cache
            )
            spec = self.config.clients.jwt
            verifier = self.identities.jwt
            if spec is not None and spec.jwks_url is not None and verifier is not None:
                url = spec.jwks_url

                async def refresh_jwks() -> None:
                    r = await client.get(url)
                    r.raise_for_status()
                    verifier.load(r.json())

                await refresh_jwks()  # fails start-up when the provider's keys are unreachable
                background.every(spec.refresh_s, refresh_jwks, "jwks")
            kv = self.kv
            if kv is not None:
                kv.start()
                background.every(min(1.0, kv.silent_after_s / 4), kv.check_job, "kv-streams")
            background.start()
            try:
                yield
            finally:
                await background.stop()
                if kv is not None:
                    await kv.stop()
                self.upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = PATHS.get(scope["path"])
            if endpoint is not None:
                if scope["method"] != "POST":
                    message = f"{scope['method']} is not allowed here; use POST"
                    await respond_error(send, 405, message, code="method_not_allowed")
                    return
                if self.tracer is None:
                    await self.handle(scope, receive, send, endpoint)
                else:
                    await self._traced(self.tracer, scope, receive, send, endpoint)
                return
        await self.admin(scope, receive, send)

    async def _traced(
        self, tracer: Tracer, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
    ) -> None:
        """:meth:`handle` inside a server span that continues the caller's trace context."""
        path: str = scope["path"]  # one of the OpenAI paths: a bounded set of span names
        attributes: dict[str, str] = {
            "http.request.method": "POST",
            "http.route": path,
            "gtm.region": self.config.region,
        }
        decision = text_header(scope, _DECISION_ID)
        if decision:
            attributes["gtm.decision_id"] = decision[:128]  # a header: bounded before keeping
        with tracer.start_as_current_span(
            f"POST {path}",
            context=tracing.incoming(scope),
            kind=SpanKind.SERVER,
            attributes=attributes,
        ) as span:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status: int = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(StatusCode.ERROR)
                await send(message)

            await self.handle(scope, receive, traced_send, endpoint)

    # -- the request path --------------------------------------------------------------------

    def _failure(self, inst: InstanceState, kind: str) -> None:
        self.metrics.upstream_failures.labels(inst.id, kind).inc()

    def _affinity(self, scope: Scope, body: dict[str, Any]) -> int | None:
        """The request's affinity key, when affinity is on and the request names one."""
        spec = self.config.affinity
        if spec.mode == "session":
            session = text_header(scope, self._session_h)
            if session is None and isinstance(body.get("user"), str):
                session = body["user"]
            return key_of(f"{body.get('model')}\x00{session}") if session else None
        if spec.mode == "prefix":
            prefix = prompt_prefix(body, spec.prefix_chars)
            return key_of(f"{body.get('model')}\x00{prefix}") if prefix else None
        return None

    async def _traced_pick(
        self,
        tracer: Tracer,
        tier: str,
        cost: float,
        shape: RequestShape,
        affinity: int | None,
        blocks: list[int],
    ) -> Lease:
        """:meth:`_admit_and_route` as a span: the queue wait, the cost and the instance."""
        with tracer.start_as_current_span(
            "pick",
            attributes={"gtm.tier": tier, "gtm.estimated_cost": cost, "gtm.model": shape.model},
        ) as span:
            queued = time.perf_counter()
            lease = await self._admit_and_route(tier, cost, shape, affinity, blocks)
            span.set_attribute("gtm.queue_wait_s", time.perf_counter() - queued)
            span.set_attribute("gtm.instance", lease.instance.id)
            return lease

    async def _admit_and_route(
        self, tier: str, cost: float, shape: RequestShape, affinity: int | None, blocks: list[int]
    ) -> Lease:
        pool = self.pool
        granted = await pool.admission.acquire(tier, cost)
        try:
            t0 = time.perf_counter()
            # The routing decision: pick() + lease, prefill priced by the KV blocks held.
            lease = pool.route(shape, cost, affinity, blocks)
            self.metrics.pick_seconds.observe(time.perf_counter() - t0)
        except BaseException:
            pool.admission.release()
            raise
        if self.kv is not None:
            self.kv.routed(lease, blocks)
        lease.on_end.append(lambda: pool.admission.release(granted))
        return lease

    async def _refuse(self, send: Send, exc: Overloaded) -> None:
        self._r429.inc()
        await respond_error(
            send, 429, str(exc), "requests", "rate_limit_exceeded", retry_after=exc.retry_after
        )

    async def _unavailable(self, send: Send, exc: NoInstanceError) -> None:
        self._r503.inc()
        await respond_error(
            send, 503, str(exc), "server_error", "service_unavailable", retry_after=1.0
        )

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        started = time.perf_counter()
        self._handled.inc()
        config, pool = self.config, self.pool
        try:
            caller = self.identities.identify(scope)
            raw = await read_body(scope, receive, body_limit(config, endpoint))
            parsed = parse_request(endpoint, raw)
            pool.check_rate(caller.bucket, caller.spec, caller.label)
            tier = pool.tier_for(text_header(scope, self._tier_h), caller.spec)
            served = pool.resolve_model(parsed.shape.model)
            shape = parsed.shape
            if served != shape.model:
                shape = replace(shape, model=served)
            state = pool.model_state(served)
            if state == "pending":
                raise NoInstanceError(f"no instance has listed its models yet ({served!r})")
            if state == "unknown":
                raise RequestError(
                    404, f"The model `{served}` does not exist.", "model_not_found", "model"
                )
            if not pool.can_serve(served):
                raise NoInstanceError(f"no instance in service can serve {served!r}")
            # The client's own bytes unless a canary rewrote the model: no re-encoding.
            content = (
                raw
                if served == parsed.shape.model
                else json.dumps({**parsed.body, "model": served}).encode()
            )
            cost = pool.estimate(shape)
            affinity = self._affinity(scope, parsed.body)
            # Cut as the servers cut it (regional_lb.protocol.kv_prompt), for the KV index.
            blocks = (
                prompt_block_hashes(parsed.body, config.kv_cache.block_size)
                if pool.kv_index is not None
                else []
            )
        except Disconnected:
            self._gone.inc()
            return
        except RequestError as exc:
            self._bad.inc()
            await respond_error(send, exc.status, str(exc), code=exc.code, param=exc.param)
            return
        except Overloaded as exc:
            await self._refuse(send, exc)
            return
        except NoInstanceError as exc:
            await self._unavailable(send, exc)
            return
        await self._route_and_forward(
            scope,
            receive,
            send,
            tier,
            cost,
            shape,
            content,
            parsed.stream,
            started,
            caller,
            affinity,
            blocks,
        )

    async def _route_and_forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        tier: str,
        cost: float,
        shape: RequestShape,
        content: bytes,
        stream: bool,
        started: float,
        caller: Caller,
        affinity: int | None = None,
        blocks: list[int] | None = None,
    ) -> None:
        # Waiting in the admission queue and waiting for the instance are both abandoned
        # (and the upstream request aborted) if the client goes away.
        watch = _DisconnectWatch(receive)
        lease: Lease | None = None
        tracer = self.tracer
        hop: Span | None = None  # the call to the instance, while tracing is on
        try:
            resp: HopResponse | None = None
            first_byte = self.config.timeouts.first_byte_s
            sent = started
            budget = self.pool.retry_budget
            budget.deposit(self.pool.clock())
            for attempt in (1, 2):
                # A retry goes where the load says: the affine instance just failed.
                key = affinity if attempt == 1 else None
                if tracer is None:
                    lease = await self._admit_and_route(tier, cost, shape, key, blocks or [])
                    headers = upstream_headers(
                        scope, self.pool.upstreams[lease.instance.id], caller.key_used
                    )
                else:
                    lease = await self._traced_pick(tracer, tier, cost, shape, key, blocks or [])
                    hop = tracer.start_span(
                        "upstream",
                        kind=SpanKind.CLIENT,
                        attributes={"gtm.instance": lease.instance.id, "gtm.attempt": attempt},
                    )
                    headers = upstream_headers(
                        scope,
                        self.pool.upstreams[lease.instance.id],
                        caller.key_used,
                        tracing.traceparent(hop),
                    )
                # A model listing that could disturb work there finishes first (a dict
                # lookup when none runs: regional_lb.upstream.profiles).
                await self.pool.listing_done(lease.instance.id)
                sent = time.perf_counter()
                try:
                    resp = await self.upstream.post(
                        lease.instance.url, scope["path"], content, headers, first_byte
                    )
                    break
                except ConnectFailed:
                    # Nothing reached the instance: safe to try another one once, within
                    # the retry budget (a dead pool must not see its load doubled).
                    if hop is not None:
                        _end_hop(hop, None, "connect failed")
                        hop = None
                    lease.end("upstream_error")
                    self._failure(lease.instance, "connect")
                    if attempt == 2 or not budget.withdraw(self.pool.clock()):
                        raise
            assert resp is not None
            assert lease is not None
            if hop is not None:
                hop.set_attribute("http.response.status_code", resp.status)
            if stream and resp.status < 400:
                await self._stream(send, resp, lease, watch)
            else:
                await self._unary(send, resp, lease, watch, sent - started)
        except asyncio.CancelledError:
            if not watch.claim_cancel():
                if lease is not None:
                    lease.end("cancelled")
                raise
            self._gone.inc()
            if lease is not None:
                lease.end("client_gone")
        except Overloaded as exc:
            await self._refuse(send, exc)
        except NoInstanceError as exc:
            await self._unavailable(send, exc)
        except RequestError as exc:
            self._bad.inc()
            await respond_error(send, exc.status, str(exc), code=exc.code, param=exc.param)
        except HopTimeout as exc:
            if hop is not None:
                _end_hop(hop, None, "timeout")
                hop = None
            self._end_failed(lease, "timeout")
            await respond_error(
                send, 504, f"the instance timed out: {exc}", "server_error", "upstream_timeout"
            )
        except HopError as exc:
            if hop is not None:
                _end_hop(hop, None, str(exc))
                hop = None
            self._end_failed(lease, "transport")
            await respond_error(
                send, 502, f"the instance failed: {exc}", "server_error", "upstream_error"
            )
        except BaseException:
            if lease is not None:
                lease.end("cancelled")
            raise
        finally:
            watch.stop()
            if hop is not None:
                _end_hop(hop, lease, None)

    def _end_failed(self, lease: Lease | None, kind: str) -> None:
        if lease is not None and not lease.ended:
            lease.end("upstream_error")
            self._failure(lease.instance, kind)

    async def _unary(
        self,
        send: Send,
        resp: HopResponse,
        lease: Lease,
        watch: _DisconnectWatch,
        before_hop: float,
    ) -> None:
        """Relay a whole answer. ``before_hop``: seconds the request spent here before it was
        sent to the instance, part of what the balancer adds (the overhead histogram)."""
        try:
            # Nothing arrives until the whole answer is ready: the first-byte budget applies.
            body = await resp.read(self.config.timeouts.first_byte_s)
        finally:
            resp.close()
        answered = time.perf_counter()
        status = resp.status
        named = (b"x-regional-instance", lease.instance.id.encode())
        if status >= 400:
            # The instance's status and words, in the OpenAI shape; only a server error is
            # the instance's failure (a 4xx is about the request, or our credential).
            if status >= 500:
                lease.end("upstream_error")
                self._failure(lease.instance, f"http_{status}")
            else:
                lease.end("client_error")
            watch.done = True
            await respond(
                send, status, upstream_error(status, body), extra=[*relayed_headers(resp), named]
            )
            return
        lease.end("ok", completion_tokens(body))
        watch.done = True
        await respond(
            send,
            status,
            body,
            resp.header(b"content-type") or b"application/json",
            [*relayed_headers(resp), named],
        )
        self.metrics.overhead_seconds.observe(before_hop + time.perf_counter() - answered)

    async def _stream(
        self, send: Send, resp: HopResponse, lease: Lease, watch: _DisconnectWatch
    ) -> None:
        inst = lease.instance
        chunks = relay(
            resp,
            lease,
            lambda kind: self._failure(inst, kind),
            self.config.health.stall_timeout_s,
            self.config.health.first_token_timeout_s,
            # The server's own waiting count (fresh scrapes only), or more of ours in flight
            # than its batch holds: the request is queued there, not stuck.
            lambda: bool(inst.scraped_waiting) or inst.in_flight > inst.speed.slots,
        )
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": [
                        (b"content-type", resp.header(b"content-type") or _SSE),
                        (b"cache-control", b"no-cache"),
                        *relayed_headers(resp),
                        (b"x-regional-instance", lease.instance.id.encode()),
                    ],
                }
            )
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await chunks.aclose()  # ends the lease and closes the upstream on every path
            resp.close()


def _end_hop(hop: Span, lease: Lease | None, error: str | None) -> None:
    """End the span of a call to an instance: failed with ``error``, or as its lease ended."""
    outcome = lease.outcome if lease is not None else None
    if outcome is not None:
        hop.set_attribute("gtm.outcome", outcome)
    # A client that left, or a busy instance, is no failure of the call.
    if error is not None or outcome == "upstream_error":
        hop.set_status(StatusCode.ERROR, error)
    hop.end()


def create_app(
    config: BalancerConfig, secret: bytes | None = None, clock: Callable[[], float] = time.monotonic
) -> Balancer:
    return Balancer(config, secret, clock)
