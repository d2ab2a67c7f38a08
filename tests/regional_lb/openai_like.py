"""A small OpenAI-compatible server that behaves as llama-cpp-python's does where the
balancer must cope with it, for tests that cannot build llama.cpp: one request at a time, no
``/health``, a ``/v1/models`` that ends any running stream (``interrupt_requests``, its
default: ``data: [DONE]`` early, then the connection closes) or waits behind it (with
``interrupt_requests`` off), and errors in its own shapes (FastAPI's ``{"detail": ...}`` for a
401, ``{"error": {...}}`` for a 500).

A stream sends one chunk, then one every ``tick_s`` until ``finish`` is set (the test decides
when it ends, so nothing depends on timing), then the last chunk with its finish_reason and
``[DONE]``. Served by uvicorn on loopback with :func:`regional_lb.protocol.serving.running`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from regional_lb.protocol.asgi import Receive, Scope, Send


class Interrupted(Exception):
    """Raised inside the app to drop the connection mid-answer (uvicorn closes it)."""


@dataclass
class OpenAILike:
    models: list[str] = field(default_factory=lambda: ["m1"])
    interrupt: bool = True  # /v1/models ends a running stream (llama-cpp-python's default)
    serialise: bool = False  # /v1/models and /health wait for the running stream to end
    has_health: bool = False  # llama-cpp-python has no /health
    close_after_done: bool = False  # drop the connection after a complete answer
    tick_s: float = 0.005  # the pace of tokens while a stream runs
    # What the next requests to the generation routes answer: (status, body) or None.
    errors: list[tuple[int, bytes]] = field(default_factory=list)
    finish: asyncio.Event = field(default_factory=asyncio.Event)
    listing_open: asyncio.Event = field(default_factory=asyncio.Event)
    streaming: int = 0  # streams running now
    probes: int = 0  # GET requests that arrived while a stream ran
    listings: int = 0
    generations: int = 0
    interrupted: int = 0  # streams a /v1/models call ended early
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _interrupt: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()
        self.listing_open.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        if method == "GET":
            if self.streaming:
                self.probes += 1
            if path == "/v1/models":
                self.listings += 1
                if self.streaming and self.interrupt:
                    self._interrupt.set()
                await self.listing_open.wait()
                if self.serialise:
                    await self._idle.wait()
                data = [{"id": m, "object": "model", "owned_by": "me"} for m in self.models]
                await _json(send, 200, {"object": "list", "data": data})
            elif path == "/health" and self.has_health:
                if self.serialise:
                    await self._idle.wait()
                await _json(send, 200, {"status": "ok"})
            else:
                await _json(send, 404, {"detail": "Not Found"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.errors:
            status, content = self.errors.pop(0)
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": content})
            return
        self.generations += 1
        request = json.loads(body)
        if not request.get("stream"):
            answer = {
                "id": "cmpl-1",
                "object": "chat.completion",
                "model": request["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
            }
            await _json(send, 200, answer)
            return
        await self._stream(request["model"], send)

    async def _stream(self, model: str, send: Send) -> None:
        self.streaming += 1
        self._idle.clear()
        self._interrupt.clear()
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": _chunk(model), "more_body": True})
            while not self.finish.is_set():
                if self._interrupt.is_set():
                    # llama-cpp-python: [DONE] at once, then the request is cancelled and
                    # its connection closed before the response ends.
                    self.interrupted += 1
                    done = b"data: [DONE]\r\n\r\n"
                    await send({"type": "http.response.body", "body": done, "more_body": True})
                    raise Interrupted("a /v1/models call interrupted the stream")
                await send({"type": "http.response.body", "body": _chunk(model), "more_body": True})
                await asyncio.sleep(self.tick_s)
            end = _chunk(model, "length") + b"data: [DONE]\r\n\r\n"
            await send({"type": "http.response.body", "body": end, "more_body": True})
            if self.close_after_done:
                raise Interrupted("the connection closes after the answer")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.streaming -= 1
            if not self.streaming:
                self._idle.set()


def _chunk(model: str, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {} if finish else {"content": "x"}
    doc = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(doc)}\r\n\r\n".encode()


async def _json(send: Send, status: int, doc: Any) -> None:
    body = json.dumps(doc).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
