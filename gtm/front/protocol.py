"""The front's HTTP/1.1 protocol: uvicorn's httptools protocol with bounded heads, connection
slots and deadlines, and cached redirects answered without an ASGI request cycle.

A redirect that the front's answer cache holds is answered here, in the protocol, as soon as
the request head is parsed: :meth:`gtm.front.answers.AnswerCache.respond` renders and counts
it, and the protocol writes it, with no ASGI request cycle (a task, a scope, two messages), which
costs more than the whole decision. Everything else (cache misses that are not redirects, refusals,
bad input, proxy mode, the front's own endpoints, a request pipelined behind one still being
answered) goes through uvicorn's request cycle to the ASGI app, as before.

Request heads are bounded here, at the protocol, before anything reaches the application:
uvicorn's httptools protocol has no limit of its own on header size, so a client could make it
buffer a head without end. Heads over the limits get 431 (414 for the target) and the connection
is closed; uvicorn's own 400 for unparseable requests stays, and both are counted in the audit
like every other response.

Connections are bounded here too (:mod:`gtm.front.connections`): a cap in total and per client,
taken when the connection is accepted, a deadline for each request head (408 when a head is
still incomplete at it) and one for each request body (a stall or a trickle below the minimum
rate: the application answers 408, or the connection is closed when the request was answered
already). uvicorn bounds none of these. With TLS the connection's slot is taken by the TLS gate
(:func:`gtm.front.server.tls_gate_for`) before the handshake and handed over to this protocol
once it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gtm.front.app import FrontApp
from gtm.front.client_address import parse_peer
from gtm.front.connections import BODY_TIMED_OUT, ConnectionBudget, peer_host


@dataclass(frozen=True, slots=True)
class HeadLimits:
    max_head_bytes: int = 32 * 1024  # request line and every header together
    max_target_bytes: int = 8 * 1024
    max_headers: int = 100


class _HeadRefused(httptools.HttpParserError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Event:
    def set(self) -> None:
        pass


class _Answered:
    """The request cycle of a request the protocol answered itself: complete from the start.
    uvicorn's own callbacks read these attributes of the current cycle (a body arriving for
    it is dropped, as for any request answered before its body)."""

    response_started = True
    response_complete = True
    more_body = False
    disconnected = False
    keep_alive = True
    message_event = _Event()


_ANSWERED = cast(RequestResponseCycle, _Answered())


class SlotProtocol(HttpToolsProtocol):
    """uvicorn's protocol holding a slot of the connection budget while its connection lasts."""

    _admitted = False  # holds a slot of the budget, released when the connection ends
    _gated = False  # the TLS gate took the slot; this protocol takes it over when made
    _took_over = False  # it did (set once: the gate's callback may run after the release)
    _peer: str | None = None

    def gated(self, peer: str | None) -> None:
        self._gated, self._peer = True, peer

    def took_over(self) -> bool:
        return self._took_over


def protocol_for(
    app: FrontApp,
    limits: HeadLimits,
    budget: ConnectionBudget | None = None,
) -> type[SlotProtocol]:
    """uvicorn's httptools protocol with bounded request heads, counted protocol errors, and
    cached redirects answered without an ASGI request cycle; with a ``budget``, connections
    over its caps are closed at once and request heads and bodies have its deadlines."""
    header_timeout_s = budget.limits.header_timeout_s if budget is not None else None
    body_limits = budget.limits if budget is not None else None

    class FrontProtocol(SlotProtocol):
        _head_bytes = 0
        _header_bytes = 0
        _refused_head: _HeadRefused | None = None
        _discarded = -1  # >= 0 once the answer is sent and the rest of the input is dropped
        _in_head = False  # a request head is being parsed
        _in_body = False  # a request's head is parsed and its body is not complete
        _made = False  # uvicorn's connection_made ran (its connection_lost needs it)
        _head_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None
        _body_start = 0.0  # when the body's clock started (the head complete, or reading resumed)
        _body_last = 0.0  # when the last of it came
        _body_bytes = 0  # received since its clock started
        _body_cut = False  # the application was told the body is past its deadline

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if self._gated:
                # The handshake is done: the slot is this protocol's to release.
                self._admitted = self._took_over = True
            elif budget is not None:
                # Plain TCP: the slot is taken here, before a byte is read.
                peer = peer_host(transport.get_extra_info("peername"))
                if budget.admit(peer) is not None:
                    transport.close()
                    return
                self._admitted, self._peer = True, peer
            self._made = True
            super().connection_made(cast(asyncio.Transport, transport))
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()
            if self._admitted:
                self._admitted = False
                assert budget is not None
                budget.release(self._peer)
            if self._made:
                super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if header_timeout_s is not None and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            assert budget is not None
            budget.head_timeouts += 1
            if self._in_head:
                # Part of a head came and the rest did not (slowloris): say so, and close.
                self._refused_head = _HeadRefused(408, "request head timeout")
                self.send_400_response(self._refused_head.message)
            else:
                # Nothing of a request came: there is no one to answer.
                self.transport.close()

        def _start_body_clock(self) -> None:
            assert body_limits is not None
            now = self.loop.time()
            self._body_start = self._body_last = now
            self._body_bytes = 0
            self._body_timer = self.loop.call_later(body_limits.body_timeout_s, self._body_due)

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_due(self) -> None:
            self._body_timer = None
            assert body_limits is not None
            assert budget is not None
            if self.transport.is_closing() or not self._in_body:
                return
            if self.flow.read_paused and not self._body_cut:
                # The front is not reading (the application has not taken what came, or a
                # pipelined request waits its turn): the client is not the slow one. Its clock
                # starts again when reading does.
                self._start_body_clock()
                return
            now = self.loop.time()
            due = body_limits.body_deadline(self._body_start, self._body_last, self._body_bytes)
            if now < due and not self._body_cut:
                self._body_timer = self.loop.call_later(due - now, self._body_due)
                return
            cycle = self.cycle
            if self._body_cut or cycle is None or cycle.response_started:
                # Answered already (a redirect does not wait for its body), or the application
                # was told and did not answer within another grace: nothing more to say here.
                if not self._body_cut:
                    budget.body_timeouts += 1
                self.transport.close()
                return
            # The application is reading the body: it answers 408 and counts that response
            # with its decision (rule 2); the connection closes after it. Should it not answer
            # within another grace, the connection is closed all the same.
            budget.body_timeouts += 1
            self._body_cut = True
            cycle.scope["state"][BODY_TIMED_OUT] = True
            cycle.message_event.set()
            self._body_timer = self.loop.call_later(body_limits.body_timeout_s, self._body_due)

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            if self._body_timer is not None:
                self._body_last = self.loop.time()
            super().on_body(body)

        def _discard(self, n: int) -> None:
            self._discarded += n
            if self._discarded > _LINGER_BYTES:
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._discarded >= 0:
                self._discard(len(data))
                return
            # Bytes that arrive while a head is pending (or between requests) count towards it.
            if not self._in_body:
                self._head_bytes += len(data)
            super().data_received(data)
            if not self._in_head:
                # No head in progress: the last one completed (its request is being answered
                # or its body read), so nothing is buffered towards a head.
                self._head_bytes = 0
            elif (
                self._head_bytes > limits.max_head_bytes
                and self._refused_head is None
                and not self.transport.is_closing()
            ):
                # Still inside a head that has outgrown the limit (one huge header without an
                # end, say): the parser would buffer it all, so the connection ends here.
                self._refused_head = _HeadRefused(431, "request head too large")
                self.send_400_response(self._refused_head.message)
            if (
                self._in_body
                and self._body_timer is None
                and body_limits is not None
                and not self.transport.is_closing()
            ):
                # A head is complete and its body is not (a request without a body completes
                # in the same call, and costs no timer).
                self._start_body_clock()

        def on_header(self, name: bytes, value: bytes) -> None:
            n = len(self.headers)  # uvicorn's list of this request's headers so far
            size = (self._header_bytes if n else 0) + len(name) + len(value) + 4
            self._header_bytes = size
            if len(self.url) > limits.max_target_bytes:
                self._refused_head = _HeadRefused(414, "request target too long")
                raise self._refused_head
            if n >= limits.max_headers:
                self._refused_head = _HeadRefused(431, "too many request headers")
                raise self._refused_head
            if size + len(self.url) > limits.max_head_bytes:
                self._refused_head = _HeadRefused(431, "request head too large")
                raise self._refused_head
            super().on_header(name, value)

        def on_message_begin(self) -> None:
            self._in_head = True
            self._in_body = False
            self._body_cut = False
            # A kept-alive connection's next head has the deadline from its first byte.
            self._arm_head_timer()
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._in_body = False
            if self._body_timer is not None:
                self._cancel_body_timer()
            if (
                self.cycle is _ANSWERED
                and self.timeout_keep_alive_task is None
                and not self.transport.is_closing()
            ):
                # Answered before its body arrived: the body's bytes cancelled the keep-alive
                # timer that the answer armed, and nothing else would arm it again.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._in_body = True
            self._cancel_head_timer()
            cycle = self.cycle
            parser = self.parser
            if (
                (cycle is None or cycle.response_complete)
                and not self.pipeline  # requests ahead of this one are answered first
                and not self.flow.write_paused  # the request cycle waits for the client
                and self.limit_concurrency is None
                and not parser.should_upgrade()
            ):
                keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
                client = self.client
                try:
                    response = app.answers.respond(
                        parser.get_method(),
                        self.url,
                        self.headers,
                        client[0] if client else None,
                        self.server_state.default_headers,
                        keep_alive,
                    )
                except Exception as exc:  # nothing was counted: the request cycle answers
                    app.runtime.failures.record("front.fast_path", exc)
                    response = None
                if response is not None:
                    self.cycle = _ANSWERED
                    self.transport.write(response)
                    if not keep_alive:
                        self.transport.close()
                    self.on_response_complete()  # the next pipelined request, keep-alive timer
                    return
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            # This answer ends the connection: no deadline may answer again after it (the
            # lingering close below keeps the transport open a while).
            self._cancel_head_timer()
            status, message = 400, "invalid HTTP request"
            if self._refused_head is not None:
                status, message = self._refused_head.status, self._refused_head.message
            code = message.replace(" ", "_").encode()
            body = b'{"error":"' + code + b'","message":"' + message.encode() + b'"}'
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Bad Request')}\r\n"
                "content-type: application/json\r\ncache-control: no-store\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            idle = self.cycle is None or self.cycle.response_complete
            if self._refused_head is not None and idle and self.transport.can_write_eof():
                # Lingering close: the client may still be sending the head it was refused
                # for; closing now would reset the connection and could destroy the answer in
                # its receive buffer. Half-close, drop what still comes (bounded), close later.
                self.transport.write_eof()
                self._discarded = 0
                self.loop.call_later(_LINGER_S, self.transport.close)
            else:
                self.transport.close()
            peer = parse_peer(self.client[0]) if self.client else parse_peer("0.0.0.0")
            method = ""
            with contextlib.suppress(Exception):
                method = self.parser.get_method().decode("ascii", "replace")
            app.ledger.count_rejected(app.store.current, peer, None, method, status)

    return FrontProtocol


_LINGER_S = 2.0
_LINGER_BYTES = 1024 * 1024
_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
}


__all__ = ["HeadLimits", "SlotProtocol", "protocol_for"]
