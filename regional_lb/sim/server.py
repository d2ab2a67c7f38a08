"""``regional-lb sim-backend``: an OpenAI-compatible inference server without a GPU.

Serves ``/v1/chat/completions``, ``/v1/completions`` (streamed or not), ``/v1/embeddings``,
``/v1/models`` and ``/v1/models/{id}``, on top of :class:`regional_lb.sim.engine.Engine`, and
plays one kind of server (``EngineConfig.kind``): its readiness path (``/health``, Triton's
``/v2/health/ready``) and its metrics (:mod:`regional_lb.sim.metrics`; Triton's on a port of
their own through :func:`create_metrics_app`). Like ``vllm serve --api-key``, an
``api_key`` guards every ``/v1`` route. Streams send their headers before the first token,
as real servers do, so a request waiting in the engine's queue has headers and no tokens.
``POST /sim/faults`` injects failures for tests and demos: the next N requests answer 500, or
token generation stalls for some seconds.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from regional_lb.errors import RequestError
from regional_lb.protocol.disconnect import ClientGone, unless_disconnected
from regional_lb.protocol.kv_prompt import prompt_token_ids
from regional_lb.protocol.openai_io import PATHS, error_body, parse_request
from regional_lb.sim.engine import Engine, EngineConfig, Sequence, UnknownModel
from regional_lb.sim.kv_publisher import KvEventPublisher
from regional_lb.sim.metrics import EngineCollector


def _chunk(
    kind: str, rid: str, model: str, created: int, text: str | None, finish: str | None
) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {} if text is None else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def _usage(seq: Sequence) -> dict[str, int]:
    return {
        "prompt_tokens": seq.prompt_tokens,
        "completion_tokens": seq.produced,
        "total_tokens": seq.prompt_tokens + seq.produced,
    }


class _ApiKey:
    """``vllm serve --api-key``: every /v1 route needs ``Authorization: Bearer <key>``;
    health and metrics do not."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps({"error": "Unauthorized"}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def create_metrics_app(engine: Engine, kind: str = "triton") -> FastAPI:
    """The simulated server's metrics alone, for a kind that serves them on their own port
    (Triton's 8002), read from a running server's engine."""
    metrics_app = FastAPI(title="GTM simulated server metrics")
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, kind))

    @metrics_app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics_app


def create_app(config: EngineConfig) -> FastAPI:
    engine: Engine | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal engine
        engine = Engine(config)
        app.state.engine = engine
        publisher = None
        if config.kv_events_endpoint:
            publisher = KvEventPublisher(config.kv_events_endpoint, config.kv_events_topic)
            engine.on_kv_events = publisher.publish
            engine.kv_publisher = publisher
        app.state.kv_publisher = publisher
        registry = CollectorRegistry()
        registry.register(EngineCollector(engine, config.kind))
        app.state.registry = registry
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if publisher is not None:
                publisher.close()

    app = FastAPI(title="GTM simulated inference server", lifespan=lifespan)

    def eng() -> Engine:
        assert engine is not None, "engine runs inside the app's lifespan"
        return engine

    def err(
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> JSONResponse:
        return JSONResponse(error_body(message, type_, code, param), status_code=status)

    @app.get("/v2/health/ready" if config.kind == "triton" else "/health")
    async def health() -> Response:
        return Response(status_code=200)

    def card(e: Engine, m: str) -> dict[str, Any]:
        return {
            "id": m,
            "object": "model",
            "created": 0,
            "owned_by": "sim",
            "root": m,
            "max_model_len": config.max_model_len,
            "loaded": m in e.loaded,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        e = eng()
        return {"object": "list", "data": [card(e, m) for m in e.catalog]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        e = eng()
        if model not in e.catalog:
            return err(404, f"The model `{model}` does not exist.", code="model_not_found")
        return JSONResponse(card(e, model))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(app.state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/sim/faults")
    async def faults(request: Request) -> dict[str, Any]:
        body = await request.json()
        e = eng()
        e.fail_next = int(body.get("fail_next", e.fail_next))
        stall = float(body.get("stall_s", 0.0))
        if stall > 0:
            e.stalled_until = time.monotonic() + stall
        return {
            "fail_next": e.fail_next,
            "stalled_for": max(0.0, e.stalled_until - time.monotonic()),
        }

    async def generate(request: Request, path: str) -> Response:
        response = await _generate(request, path)
        # Servers give each request an id (vLLM and OpenAI echo or make an x-request-id).
        response.headers["x-request-id"] = request.headers.get("x-request-id", uuid.uuid4().hex)
        return response

    async def _generate(request: Request, path: str) -> Response:
        e = eng()
        try:
            parsed = parse_request(PATHS[path], await request.body())
            e.check_model(parsed.shape.model)
        except RequestError as exc:
            return err(exc.status, str(exc), param=exc.param)
        except UnknownModel as exc:
            return err(404, str(exc), code="model_not_found", param="model")
        if e.fail_next > 0:
            e.fail_next -= 1
            return err(500, "simulated failure", type_="server_error")
        shape = parsed.shape
        if shape.endpoint == "embedding":
            await e.embed(shape.model, shape.prompt_tokens)
            return JSONResponse(
                {
                    "object": "list",
                    "model": shape.model,
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.0] * 8}],
                    "usage": {
                        "prompt_tokens": shape.prompt_tokens,
                        "total_tokens": shape.prompt_tokens,
                    },
                }
            )
        exact = bool(parsed.body.get("ignore_eos", False))
        # Cut as the balancer cuts it (regional_lb.protocol.kv_prompt): the same blocks.
        token_ids = prompt_token_ids(parsed.body)
        seq = e.submit(
            shape.model, shape.prompt_tokens, shape.max_tokens, exact, token_ids=token_ids or None
        )
        kind = "chat" if shape.endpoint == "chat" else "text"
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        include_usage = bool((parsed.body.get("stream_options") or {}).get("include_usage"))
        if not parsed.stream:

            async def all_tokens() -> None:
                while await seq.tokens.get() is not None:
                    pass

            try:
                await unless_disconnected(request, all_tokens())
            except ClientGone:
                return Response(status_code=499)
            finally:
                e.abort(seq)  # no-op when finished; frees the slot if the client left
            text = "".join(f"tok{i} " for i in range(1, seq.produced + 1))
            finish = "length" if seq.produced >= shape.max_tokens else "stop"
            if kind == "chat":
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": finish,
                    "message": {"role": "assistant", "content": text},
                }
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": created,
                    "model": shape.model,
                    "choices": [choice],
                    "usage": _usage(seq),
                }
            )

        async def stream() -> AsyncIterator[bytes]:
            try:
                while (tok := await seq.tokens.get()) is not None:
                    chunk = _chunk(kind, rid, shape.model, created, f"tok{tok} ", None)
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                if seq.aborted:
                    return  # engine stopped under us: end without [DONE]
                finish = "length" if seq.produced >= shape.max_tokens else "stop"
                last = _chunk(kind, rid, shape.model, created, None, finish)
                if include_usage:
                    last["usage"] = _usage(seq)
                yield f"data: {json.dumps(last)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                e.abort(seq)

        return StreamingResponse(stream(), media_type="text/event-stream")

    for path in PATHS:
        app.add_api_route(path, _bind(generate, path), methods=["POST"])
    if config.api_key:
        app.add_middleware(_ApiKey, key=config.api_key)
    return app


def _bind(handler: Any, path: str) -> Any:
    async def endpoint(request: Request) -> Response:
        return await handler(request, path)  # type: ignore[no-any-return]

    return endpoint


async def serve(config: EngineConfig, host: str, port: int) -> None:
    """Run the simulated server until SIGTERM/SIGINT (used by the CLI)."""
    import signal

    from regional_lb.protocol.serving import bind, make_server

    server = make_server(create_app(config), graceful_s=2)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    sock = bind(host, port)
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
