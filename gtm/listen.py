"""Listening: addresses (``HOST:PORT`` or ``[V6]:PORT``, a literal address), and uvicorn
servers embedded in a node's event loop (the HTTP front and the admin API)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Generator
from ipaddress import ip_address

import uvicorn


def parse_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:5353"`` or ``"[::1]:5353"`` -> ``(host, port)``; ValueError otherwise.

    Literal addresses only: a listener binds exactly where it is told, and the address family
    (UDP and TCP sockets of the right kind) follows from it.
    """
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (IPv6 as [ADDR]:PORT)")
    try:
        ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address") from None
    return host, int(port)


class EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers (the node owns the process's signals) and
    with a hook for "listening"."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()
