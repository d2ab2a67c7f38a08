"""Diagnostic only: the ceiling of the front's own serving path, a fixed 307 answered in the
HTTP protocol as soon as the request head is parsed, with no ASGI request cycle.

The front answers its cached redirects this way (:mod:`gtm.front.protocol`), so beside it
``bare_asgi.py`` is no longer a ceiling: this is. The gap between this and ``gtm`` is what a
decision, its answer cache and audit counting cost; uvicorn (uvloop, httptools) serves both.

    python bench/http/bare_protocol.py 127.0.0.1:PORT
"""

from __future__ import annotations

import socket
import sys
from typing import Any, cast

import uvicorn
import uvloop
from bare_asgi import _START, app
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _Event:
    def set(self) -> None:
        pass


class _Answered:
    response_complete = True
    more_body = False
    disconnected = False
    keep_alive = True
    message_event = _Event()


_ANSWERED = cast(RequestResponseCycle, _Answered())
_HEADERS = b"".join(
    n + b": " + v + b"\r\n" for n, v in cast(list[tuple[bytes, bytes]], _START["headers"])
)


class BareProtocol(HttpToolsProtocol):
    """The same conditions as the front's protocol for answering without a request cycle."""

    _date_key: object = None
    _date_head = b""

    def on_headers_complete(self) -> None:
        cycle = self.cycle
        parser = self.parser
        if (
            (cycle is None or cycle.response_complete)
            and not self.pipeline
            and not self.flow.write_paused
            and not parser.should_upgrade()
            and parser.get_http_version() != "1.0"
            and parser.should_keep_alive()
        ):
            default = self.server_state.default_headers
            if default is not self._date_key:
                BareProtocol._date_key = default
                BareProtocol._date_head = b"".join(n + b": " + v + b"\r\n" for n, v in default)
            self.cycle = _ANSWERED
            self.transport.write(
                b"HTTP/1.1 307 Temporary Redirect\r\n" + self._date_head + _HEADERS + b"\r\n"
            )
            self.on_response_complete()
            return
        super().on_headers_complete()


async def main(listen: str) -> None:
    host, _, port = listen.rpartition(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(2048)
    config: Any = uvicorn.Config(
        app,
        loop="none",
        http=BareProtocol,
        lifespan="off",
        access_log=False,
        log_config=None,
        server_header=False,
    )
    await uvicorn.Server(config).serve(sockets=[sock])


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
