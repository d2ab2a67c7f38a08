"""The balancer's operational endpoints (FastAPI): models, capacity report, health, metrics,
and the admin API for drain and membership.

None of these is on the request path, so they keep the framework's conveniences; the
OpenAI endpoints themselves are served by :mod:`regional_lb.proxy.app` without it.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from regional_lb.balancing.admission import retry_after_header
from regional_lb.balancing.health import end_drain, start_drain
from regional_lb.capacity_report import SIGNATURE_HEADER, sign
from regional_lb.config import InstanceConfig
from regional_lb.errors import RequestError
from regional_lb.metrics import BalancerMetrics
from regional_lb.protocol.openai_io import error_body
from regional_lb.upstream.kv_streams import KvStreams
from regional_lb.upstream.pool import Pool


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    retry_after: float | None = None,
) -> JSONResponse:
    headers = {} if retry_after is None else {"Retry-After": retry_after_header(retry_after)}
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_guard(
    token: str | None,
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    """/admin/* needs ``Authorization: Bearer <admin token>``; with no token configured, only
    loopback callers are served (an operator's shell or a sidecar on the same host)."""
    expected = f"Bearer {token}".encode() if token else None

    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path.startswith("/admin"):
            if expected is not None:
                given = request.headers.get("authorization", "").encode("latin-1", "replace")
                if not hmac.compare_digest(given, expected):
                    return error_response(
                        401, "the admin API needs the admin token", code="invalid_api_key"
                    )
            elif not _loopback(request):
                return error_response(
                    403,
                    "the admin API is served on loopback only unless admin.token is set",
                    code="forbidden",
                )
        return await call_next(request)

    return guard


def create_admin_app(
    pool: Pool,
    metrics: BalancerMetrics,
    secret: bytes | None,
    next_report: Callable[[], tuple[bytes, int]],
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
    kv: KvStreams | None = None,
) -> FastAPI:
    app = FastAPI(title="GTM regional balancer", lifespan=lifespan)
    config = pool.config
    app.middleware("http")(admin_guard(config.admin.token.read() if config.admin.token else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # OpenAI clients parse every error body: never FastAPI's {"detail": ...}.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = "Not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message, code=code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(400, str(exc.errors()[0].get("msg", "invalid request")))

    def cards() -> dict[str, dict[str, Any]]:
        """Every model the region serves, with the fields its servers gave (max_model_len,
        owned_by, ...), the first serving instance's card winning."""
        out: dict[str, dict[str, Any]] = {}
        for inst in pool.serving():
            for name, card in pool.model_cards.get(inst.id, {}).items():
                if name in inst.loaded or name in inst.servable:
                    out.setdefault(name, {k: v for k, v in card.items() if k != "loaded"})
            for name in [*inst.loaded, *inst.servable]:
                out.setdefault(name, {"id": name, "object": "model", "owned_by": config.region})
        for name in config.models:
            out.setdefault(name, {"id": name, "object": "model", "owned_by": config.region})
        return out

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        listed = cards()
        return {"object": "list", "data": [listed[n] for n in sorted(listed)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        card = cards().get(model)
        if card is None:
            return error_response(
                404, f"The model `{model}` does not exist.", code="model_not_found"
            )
        return JSONResponse(card)

    @app.get("/health")
    async def health() -> Response:
        # vLLM's path, for clients and load balancers that check it: 200 when work is taken.
        ready = bool(pool.serving()) and not pool.draining
        return Response(status_code=200 if ready else 503)

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
            if kv is not None:
                kv.join(ic)
        except ValidationError as exc:
            return error_response(400, str(exc).splitlines()[0])
        except RequestError as exc:
            return error_response(exc.status, str(exc), code=exc.code)
        return JSONResponse({"id": inst.id, "joined": True}, status_code=201)

    @app.delete("/admin/instances/{instance_id}")
    async def leave(instance_id: str) -> Response:
        try:
            pool.leave(instance_id)
            if kv is not None:
                kv.leave(instance_id)
        except KeyError:
            return error_response(404, f"no instance {instance_id!r}", code="not_found")
        except RequestError as exc:
            return error_response(exc.status, str(exc), code=exc.code)
        return JSONResponse({"id": instance_id, "left": True})

    @app.get("/admin/kv")
    async def kv_status() -> dict[str, Any]:
        """The KV-cache index: on or off, its bound, what it did with the events it was sent,
        and per instance its stream (live, waiting, fallback and why) and entries."""
        index = pool.kv_index
        if kv is None or index is None:
            return {"enabled": False, "instances": []}
        return {
            "enabled": True,
            "block_size": index.block_size,
            "max_blocks": index.max_blocks,
            "counts": dataclasses.asdict(index.counts),
            "instances": kv.status(i.id for i in pool.instances),
        }

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
