"""Running an ASGI app on a real socket inside the current event loop.

Used by the CLI, the tests and the wire benchmark alike, so all of them exercise the same
uvicorn server on loopback rather than an in-process transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it a response written as head then body
    # waits for the peer's delayed ACK (~40 ms on Linux) before the body leaves (Nagle).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals alone: the owner decides what they mean (the
    balancer drains before exiting; tests must not have their handlers replaced)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_server(app: Any, graceful_s: int = 5) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=graceful_s,
        # X-Forwarded-* rewriting is for servers behind a proxy; these are the proxy (or its
        # instances). Skipping the middleware takes a layer off every request.
        proxy_headers=False,
        server_header=False,
    )
    return _Server(config)


@asynccontextmanager
async def running(
    app: Any, host: str = "127.0.0.1", port: int = 0, graceful_s: int = 2
) -> AsyncIterator[str]:
    """Serve ``app`` until the block exits; yields its base URL."""
    sock = bind(host, port)
    server = make_server(app, graceful_s)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise a start-up failure
                raise RuntimeError("server stopped during start-up")
            await asyncio.sleep(0.005)
        bound = sock.getsockname()
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
