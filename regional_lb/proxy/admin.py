"""The balancer's operational endpoints (FastAPI): models, capacity report, health, metrics,
and the admin API for drain and membership.

None of these is on the request path, so they keep the framework's conveniences; the
OpenAI endpoints themselves are served by :mod:`regional_lb.proxy.app` without it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from regional_lb.balancing.admission import retry_after_header
from regional_lb.balancing.health import end_drain, start_drain
from regional_lb.capacity_report import SIGNATURE_HEADER, sign
from regional_lb.config import InstanceConfig
from regional_lb.errors import RequestError
from regional_lb.metrics import BalancerMetrics
from regional_lb.protocol.openai_io import error_body
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


def create_admin_app(
    pool: Pool,
    metrics: BalancerMetrics,
    secret: bytes | None,
    next_report: Callable[[], tuple[bytes, int]],
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
) -> FastAPI:
    app = FastAPI(title="GTM regional balancer", lifespan=lifespan)
    config = pool.config

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
            return error_response(400, str(exc).splitlines()[0])
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
