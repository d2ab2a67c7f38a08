"""``regional-lb serve``: the OpenAI-compatible balancer in front of one region's instances.

Request path: read the body (size-limited) -> validate -> tenant rate limit -> tier ->
model version -> cost estimate -> admission (queue or 429) -> pick -> lease -> forward.
Nothing is counted as outstanding until the lease is taken, so rejected input never is; from
then on the lease is ended on every path (see :mod:`regional_lb.upstream`).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from regional_lb.admission import retry_after_header
from regional_lb.balancer_metrics import BalancerMetrics
from regional_lb.capacity_report import SIGNATURE_HEADER, sign
from regional_lb.config import BalancerConfig, InstanceConfig
from regional_lb.cost import Endpoint
from regional_lb.disconnect import ClientGone, unless_disconnected
from regional_lb.errors import NoInstanceError, Overloaded, RequestError
from regional_lb.health import end_drain, start_drain
from regional_lb.instance import InstanceState
from regional_lb.openai_io import PATHS, error_body, parse_request
from regional_lb.pool import Lease, Pool
from regional_lb.probes import Background
from regional_lb.upstream import LeasedStream, build_request, open_upstream, relay


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    retry_after: float | None = None,
) -> JSONResponse:
    headers = {} if retry_after is None else {"Retry-After": retry_after_header(retry_after)}
    return JSONResponse(
        error_body(message, type_, code, param), status_code=status, headers=headers
    )


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"The body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(
                413, f"The body is larger than {limit} bytes", code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(
    config: BalancerConfig, secret: bytes | None = None, clock: Any = time.monotonic
) -> FastAPI:
    pool = Pool(config, clock=clock)
    metrics = BalancerMetrics(lambda: pool.instances, pool.admission.depth)
    pool.on_ejected = lambda inst: metrics.ejections.labels(inst.id).inc()
    t = config.timeouts
    timeouts = httpx.Timeout(t.connect_s, read=t.read_s, write=t.read_s, pool=t.pool_s)
    state: dict[str, Any] = {"seq": 0}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        # Pooled keep-alive connections to the instances; no Nagle delay on small writes.
        transport = httpx.AsyncHTTPTransport(
            limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        )
        async with httpx.AsyncClient(transport=transport, timeout=timeouts) as client:
            app.state.client = client
            background = Background(pool, client, metrics, secret, next_report)
            background.start()
            try:
                yield
            finally:
                await background.stop()

    app = FastAPI(title="GTM regional balancer", lifespan=lifespan)
    app.state.pool = pool
    app.state.metrics = metrics

    def next_report() -> tuple[bytes, int]:
        state["seq"] += 1
        report = pool.capacity_report(state["seq"])
        return report.model_dump_json().encode(), 200 if report.can_take_work else 503

    def failure(inst: InstanceState, kind: str) -> None:
        metrics.upstream_failures.labels(inst.id, kind).inc()

    # Streams: a read that waits longer than the stall timeout is a stalled stream.
    # Unary: nothing arrives until the whole answer is ready, so the first-byte budget applies.
    stream_timeout = httpx.Timeout(
        t.connect_s, read=config.health.stall_timeout_s, write=t.read_s, pool=t.pool_s
    )
    unary_timeout = httpx.Timeout(t.connect_s, read=t.first_byte_s, write=t.read_s, pool=t.pool_s)

    async def forward(
        request: Request, path: str, lease: Lease, content: bytes, stream: bool
    ) -> Response:
        client: httpx.AsyncClient = app.state.client
        up = build_request(
            client,
            lease,
            path,
            content,
            request.headers,
            stream_timeout if stream else unary_timeout,
        )
        resp = await open_upstream(client, up, t.first_byte_s)
        headers = {"X-Regional-Instance": lease.instance.id}
        if resp.status_code >= 400 or not stream:
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
            if resp.status_code >= 500:
                lease.end("upstream_error")
                failure(lease.instance, f"http_{resp.status_code}")
                return error_response(
                    502, f"instance answered {resp.status_code}", "upstream_error"
                )
            if resp.status_code >= 400:
                lease.end("client_error")
            else:
                lease.end("ok", _completion_tokens(content))
            return Response(
                content,
                status_code=resp.status_code,
                headers=headers,
                media_type=resp.headers.get("content-type"),
            )

        async def close() -> None:
            await resp.aclose()
            lease.end("client_gone")  # no-op unless the body was never (fully) sent

        return LeasedStream(
            relay(resp, lease, lambda kind: failure(lease.instance, kind)), close, headers=headers
        )

    async def admit_and_route(tier: str, cost: float, shape: Any) -> Lease:
        await pool.admission.acquire(tier, cost)
        try:
            t0 = time.perf_counter()
            lease = pool.route(shape, cost)  # the routing decision: pick() plus the lease
            metrics.pick_seconds.observe(time.perf_counter() - t0)
        except BaseException:
            pool.admission.release()
            raise
        lease.on_end.append(pool.admission.release)
        return lease

    async def handle(request: Request, endpoint: Endpoint, path: str) -> Response:
        leases: list[Lease] = []  # the current attempt's lease is the last one
        try:
            raw = await read_body(request, config.max_body_bytes)
            parsed = parse_request(endpoint, raw)
            tenant = request.headers.get(config.tenant_header)
            pool.check_rate(tenant)
            tier = pool.tier_for(request.headers.get(config.tier_header), tenant)
            served = pool.resolve_model(parsed.shape.model)
            shape = replace(parsed.shape, model=served)
            content = (
                raw
                if served == parsed.shape.model
                else json.dumps({**parsed.body, "model": served}).encode()
            )
            if not pool.known_model(served):
                raise RequestError(
                    404,
                    f"The model `{served}` does not exist.",
                    code="model_not_found",
                    param="model",
                )
            if not pool.can_serve(served):
                raise NoInstanceError(f"no instance in service can serve {served!r}")
            cost = pool.estimate(shape)

            async def route_and_forward() -> Response:
                for attempt in (1, 2):
                    lease = await admit_and_route(tier, cost, shape)
                    leases.append(lease)
                    try:
                        return await forward(request, path, lease, content, parsed.stream)
                    except (httpx.ConnectError, httpx.ConnectTimeout):
                        # Nothing reached the instance: safe to try another one once.
                        lease.end("upstream_error")
                        failure(lease.instance, "connect")
                        if attempt == 2:
                            raise
                raise AssertionError("unreachable")

            # Waiting in the admission queue and waiting for the instance are both abandoned
            # (and the upstream request cancelled) if the client goes away.
            return await unless_disconnected(request, route_and_forward())
        except RequestError as exc:
            metrics.requests.labels("bad_request").inc()
            return error_response(exc.status, str(exc), code=exc.code, param=exc.param)
        except Overloaded as exc:
            metrics.rejected.labels("429", "overloaded").inc()
            return error_response(429, str(exc), "rate_limit_exceeded", retry_after=exc.retry_after)
        except NoInstanceError as exc:
            metrics.rejected.labels("503", "no_instance").inc()
            return error_response(503, str(exc), "service_unavailable", retry_after=1.0)
        except ClientGone:
            metrics.requests.labels("client_gone").inc()
            if leases:
                leases[-1].end("client_gone")
            return Response(status_code=499)
        except httpx.TimeoutException:
            if leases and not leases[-1].ended:
                leases[-1].end("upstream_error")
                failure(leases[-1].instance, "timeout")
            return error_response(504, "the instance timed out", "upstream_error")
        except httpx.HTTPError as exc:
            if leases and not leases[-1].ended:
                leases[-1].end("upstream_error")
                failure(leases[-1].instance, "transport")
            return error_response(
                502, f"the instance failed: {type(exc).__name__}", "upstream_error"
            )
        except BaseException:
            if leases:
                leases[-1].end("cancelled")
            raise
        finally:
            metrics.requests.labels("handled").inc()

    for path, endpoint in PATHS.items():
        app.add_api_route(path, _route(handle, endpoint, path), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names: set[str] = set(config.models)
        for inst in pool.serving():
            names.update(inst.loaded)
            names.update(inst.servable)
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "owned_by": config.region} for n in sorted(names)
            ],
        }

    @app.get("/gtm/capacity")
    async def capacity() -> Response:
        body, status = next_report()
        headers = {SIGNATURE_HEADER: sign(body, secret)} if secret else {}
        return Response(body, status_code=status, media_type="application/json", headers=headers)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = bool(pool.serving()) and not pool.draining
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/instances")
    async def instances() -> list[dict[str, Any]]:
        now = pool.clock()
        return [
            {
                "id": i.id,
                "url": i.url,
                "gpu": i.gpu,
                "healthy": i.healthy,
                "draining": i.draining,
                "ejected": i.ejected(now),
                "in_flight": i.in_flight,
                "outstanding": i.outstanding,
                "speed": i.speed.speed,
                "models": sorted(i.loaded),
                "completed": i.completed,
            }
            for i in pool.instances
        ]

    @app.post("/admin/instances")
    async def join(request: Request) -> Response:
        try:
            ic = InstanceConfig.model_validate_json(await request.body())
            inst = pool.join(ic)
        except ValidationError as exc:
            return error_response(400, str(exc).splitlines()[0], param="body")
        except RequestError as exc:
            return error_response(exc.status, str(exc), code=exc.code)
        return JSONResponse({"id": inst.id, "joined": True}, status_code=201)

    @app.delete("/admin/instances/{instance_id}")
    async def leave(instance_id: str) -> Response:
        try:
            pool.leave(instance_id)
        except KeyError:
            return error_response(404, f"no instance {instance_id!r}", code="not_found")
        except RequestError as exc:
            return error_response(exc.status, str(exc), code=exc.code)
        return JSONResponse({"id": instance_id, "left": True})

    @app.post("/admin/drain")
    async def drain_region() -> dict[str, Any]:
        pool.draining = True
        return {"draining": True, "in_flight": sum(i.in_flight for i in pool.instances)}

    @app.delete("/admin/drain")
    async def undrain_region() -> dict[str, Any]:
        pool.draining = False
        return {"draining": False}

    @app.post("/admin/drain/{instance_id}")
    async def drain(instance_id: str) -> Response:
        try:
            inst = pool.by_id(instance_id)
        except KeyError:
            return error_response(404, f"no instance {instance_id!r}", code="not_found")
        start_drain(inst)
        return JSONResponse({"id": inst.id, "draining": True, "in_flight": inst.in_flight})

    @app.delete("/admin/drain/{instance_id}")
    async def undrain(instance_id: str) -> Response:
        try:
            inst = pool.by_id(instance_id)
        except KeyError:
            return error_response(404, f"no instance {instance_id!r}", code="not_found")
        end_drain(inst, pool.clock())
        pool.admission.wake()
        return JSONResponse({"id": inst.id, "draining": False})

    return app


def _completion_tokens(content: bytes) -> int | None:
    try:
        usage = json.loads(content).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    value = usage.get("completion_tokens")
    return value if isinstance(value, int) else None


def _route(handler: Any, endpoint: Endpoint, path: str) -> Any:
    async def endpoint_fn(request: Request) -> Response:
        return await handler(request, endpoint, path)  # type: ignore[no-any-return]

    return endpoint_fn
