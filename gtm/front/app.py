"""The HTTP front as a raw ASGI callable: one decision per request, answered from memory.

No framework sits on the redirect path: a request is a scan of its headers, a dictionary lookup
of its host, ``decide()`` and one audit count, and the response is a handful of byte strings
(a framework's routing, request objects and middleware cost several times the whole decision).

Hosts that belong to a service are the traffic: every path of them is redirected (or proxied),
so a service may use any path at all. The front's own endpoints (``/livez``, ``/readyz``,
``/metrics``) are answered on any other host (the node's address, ``localhost``), where any other
path is "unknown host" (404). Every response to traffic, including 404s and rejected input, is
counted in the audit store (rule 2); the operational endpoints are not decisions and are not.

Redirects are answered from memory twice over: a decision once made is rendered into an
:class:`_Answer` (status, region, base URL and audit record) and reused for every request with the
same decision inputs (host, method, client network and GeoIP bucket, residency classes, tenant)
within one decision epoch (successor snapshots that decide alike,
:mod:`gtm.decision.answer_window`), until the next instant at which a decision can change with time
alone (a capacity report turning stale). A first level keys the answer by the request's raw
inputs (method, peer, and the values of the headers the decision reads; credentials by the
tenant they name), so a repeat skips the parsing as well. Only the path, query and decision id
are per response. Answers given are tallied on the answer (an integer) and the audit writer
drains the tallies at each flush (:meth:`FrontApp.drain_tallies`): every response is counted,
and nothing is done per response beyond the increment. :meth:`FrontApp.respond` is the same
path for the HTTP protocol itself (:mod:`gtm.front.server`), which answers a cached redirect
without an ASGI request cycle.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from http import HTTPStatus
from ipaddress import IPv4Address
from typing import Any, cast

import httptools
import structlog
from prometheus_client import generate_latest

from gtm.audit.decision_id import id_tail, render_id
from gtm.audit.record import AuditRecord, record_of
from gtm.audit.writer import Tally
from gtm.decision.answer_window import AnswerWindow
from gtm.decision.model import Decision, IPAddress, Outcome, Status
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Service
from gtm.fleet.capacity import Rejected
from gtm.front.client_address import ForwardingError, TrustedProxies, client_address, parse_peer
from gtm.front.metrics import FrontStats
from gtm.front.proxy import BodyTooLarge, ClientGone, Forwarder, Target, read_body
from gtm.front.signals import (
    API_KEY_HEADER,
    AUTHORIZATION,
    RESIDENCY_HEADER,
    TENANT_HEADER,
    SignalError,
    TenantIndex,
    credentials_tenant,
    signals_of,
)
from gtm.metrics import CAPACITY_REPORTS
from gtm.runtime import Runtime

log = structlog.get_logger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ALLOWED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_ALLOW = ", ".join(sorted(ALLOWED_METHODS)).encode()
OPS_PATHS = frozenset({"/livez", "/readyz", "/metrics"})
# Regional balancers push their signed capacity reports here (DESIGN.md "Interfaces").
CAPACITY_PATH = "/v1/capacity"
CAPACITY_MAX_BYTES = 64 * 1024

# Header kinds the front reads; everything else is passed over in one dictionary lookup.
_HOST, _FORWARDED, _XFF, _RESIDENCY, _TENANT, _AUTH, _API_KEY = range(7)
_WANTED = {
    b"host": _HOST,
    b"forwarded": _FORWARDED,
    b"x-forwarded-for": _XFF,
    RESIDENCY_HEADER: _RESIDENCY,
    TENANT_HEADER: _TENANT,
    AUTHORIZATION: _AUTH,
    API_KEY_HEADER: _API_KEY,
}
_HOST_RE = re.compile(
    r"^(?:[a-z0-9_](?:[a-z0-9_.-]{0,251}[a-z0-9_.])?|\[[0-9a-f:.]+\])(?::\d{1,5})?$"
)
_NO_HOST = ""  # the audit name of a request whose host could not be read
_UNSPECIFIED = IPv4Address(0)

_NO_STORE = (b"cache-control", b"no-store")
_JSON = (b"content-type", b"application/json")
_CACHE_LIMIT = 10_000
_RECORDS_LIMIT = 100_000
_ANSWERS_LIMIT = 100_000  # per level of the answer cache
_METHODS = {m.encode(): m for m in ALLOWED_METHODS}
# What a response head may not carry in a header value (as uvicorn checks): the request target
# goes into Location. The parser already refuses such targets; this is the second lock.
_UNSAFE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_END = b"\r\ncontent-length: 0\r\n\r\n"
_END_CLOSE = b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_EMPTY_BODY = {"type": "http.response.body", "body": b""}
_MISSING = object()


class _Tally:
    """Responses counted towards one audit record since the audit writer last drained them:
    how many, and the first and last one's time."""

    __slots__ = ("first", "last", "n", "record")

    def __init__(self, record: AuditRecord) -> None:
        self.record = record
        self.n = 0
        self.first = self.last = 0.0


class _Counted(_Tally):
    """A tally of the general path (refusals, rejections, proxied exchanges)."""

    __slots__ = ("decision",)

    def __init__(self, record: AuditRecord, decision: Decision) -> None:
        super().__init__(record)
        self.decision = decision  # keeps the ids in the memo key from being reused


class _Answer(_Tally):
    """One decision rendered as a redirect: everything of the response but its date, path,
    query and decision id, and its audit record (with the responses given from it)."""

    __slots__ = ("base", "id_tail", "middle", "region", "status", "status_line")

    def __init__(
        self, record: AuditRecord, status: int, base: bytes, region: bytes, middle: bytes
    ) -> None:
        super().__init__(record)
        self.status = status
        self.base = base
        self.region = region
        self.status_line = _status_line(status)
        self.middle = middle
        self.id_tail = id_tail(record.client_network, record.name)


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        phrase = HTTPStatus(status).phrase.encode()
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


class _Reject(Exception):
    """Bad input: answered with ``status`` and a JSON body, nothing else happens."""

    def __init__(self, status: int, error: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": error, "message": message, **extra}


class FrontApp:
    def __init__(self, runtime: Runtime, forwarder: Forwarder | None = None) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.trusted = TrustedProxies(runtime.settings.trusted_proxies)
        self.forwarder = forwarder
        self.stats = FrontStats()
        self.ready = False
        self.draining = False
        # Decision ids (gtm.audit.decision_id): unique per response (a serial), and leading
        # to the audit row that counts it (node, time, client network and name).
        self._ids = itertools.count(1)
        self._node_b = runtime.settings.node_id.encode() + b"~"
        self._now = 0.0  # the time redirect() last answered at: the id's time
        self._tenants = TenantIndex(runtime.store.current.topology)
        self._topology = runtime.store.current.topology
        self._hosts: dict[bytes, tuple[str | None, Service | None]] = {}
        self._bases: dict[str, bytes] = {}
        # region -> (its name, the response head from after Location to the decision id)
        self._regions: dict[str, tuple[bytes, bytes]] = {}
        # The general path's records, memoised (see _count).
        self._records: dict[tuple[object, ...], _Counted] = {}
        # The answer cache: request inputs -> answer (None: not answered by a cached redirect,
        # the general path answers), and decision inputs -> answer. Valid while the window
        # holds: one decision epoch, until a capacity report turns stale.
        self._exact: dict[tuple[object, ...], _Answer | None] = {}
        self._answers: dict[tuple[object, ...], _Answer] = {}
        self._window = AnswerWindow()
        # Tallies counted since the audit writer last drained them. They stay here when the
        # caches are dropped, so no count is lost to a new snapshot.
        self._tallied: list[_Tally] = []
        self._closed = False
        self._date_key: object = None
        self._date_head = b""
        self.responses = 0  # responses to traffic since start (rule 2 bookkeeping)
        self.clock: Callable[[], float] = time.time
        runtime.writer.add_source(self.drain_tallies)

    # -- the request path ----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off and websockets are not served; nothing to answer
        method: str = scope["method"]
        raw_path: bytes = scope["raw_path"] or scope["path"].encode()
        peer_info = scope.get("client")
        answer = (
            self.redirect(method, scope["headers"], peer_info[0] if peer_info else None)
            if raw_path[:1] == b"/"  # else the general path refuses the target
            else None
        )
        if answer is not None:  # counted
            query: bytes = scope["query_string"]
            location = answer.base + raw_path + b"?" + query if query else answer.base + raw_path
            await send(
                {
                    "type": "http.response.start",
                    "status": answer.status,
                    "headers": [
                        (b"location", location),
                        _NO_STORE,
                        (b"x-gtm-region", answer.region),
                        (b"x-gtm-decision-id", self._cached_id(answer)),
                        (b"content-length", b"0"),
                    ],
                }
            )
            await send(_EMPTY_BODY)
            return
        await self._general(scope, receive, send, method)

    async def _general(self, scope: Scope, receive: Receive, send: Send, method: str) -> None:
        """Every request that is not answered by a cached redirect."""
        snapshot = self.store.current
        host_values, forwarded, xff, residency, tenant, auth, api_key = _scan(scope["headers"])
        peer_info = scope.get("client")
        peer = parse_peer(peer_info[0]) if peer_info else _UNSPECIFIED
        self._same_topology(snapshot)
        host, service = self._host(host_values, snapshot)
        if service is None and host is not None:
            if scope["path"] in OPS_PATHS and method in ("GET", "HEAD"):
                await self._ops(scope["path"], send)
                return
            if scope["path"] == CAPACITY_PATH and method == "POST":
                await self._capacity(scope, receive, send)
                return
        try:
            if host is None:
                raise _Reject(400, "bad_host", "a request needs exactly one valid Host header")
            if service is None:
                raise _Reject(404, "unknown_host", f"no service is configured for host {host!r}")
            if method not in ALLOWED_METHODS:
                raise _Reject(405, "method_not_allowed", f"method {method} is not served")
            if (scope["raw_path"] or scope["path"].encode())[:1] != b"/":
                # "*" (OPTIONS *) or an authority: nothing to redirect or forward to.
                raise _Reject(400, "bad_request_target", "the request target must be a path")
            try:
                client = client_address(peer, self.trusted, forwarded, xff)
            except ForwardingError as exc:
                raise _Reject(400, "bad_forwarding_header", str(exc)) from None
            index = self._tenant_index(snapshot)
            try:
                classes, tenant_id = signals_of(index, service, residency, tenant, auth, api_key)
            except SignalError as exc:
                raise _Reject(400, "bad_residency_or_tenant", str(exc)) from None
        except _Reject as reject:
            await self._reject(reject, scope, send, snapshot, peer, host, method)
            return
        request = DecisionRequest(Channel.HTTP, client, service.id, host, None, classes, tenant_id)
        try:
            decision = decide(request, snapshot, self.clock())
        except Exception:  # a bug, not input: answered and counted like everything else
            log.exception("front.decide_failed", host=host, service=service.id)
            await _send_json(send, 500, {"error": "internal", "message": "no decision"}, [])
            self.count_rejected(snapshot, peer, host, method, 500)
            return
        if service.http.mode == "proxy" and self.forwarder is not None:
            await self._proxy(scope, receive, send, snapshot, decision, client, host, tenant_id)
        else:
            await self._redirect(scope, send, snapshot, service, decision, host, tenant_id)

    # -- the answer cache ----------------------------------------------------------------------

    def respond(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        peer: str | None,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> bytes | None:
        """The whole HTTP/1.1 response to a request that a cached redirect answers, counted;
        None (and nothing counted) for any other request. For the HTTP protocol, which has
        parsed the request head: ``target`` is the request target as sent, ``default_headers``
        the server's own (the date), sent first as uvicorn sends them."""
        name = _METHODS.get(method)
        if name is None:
            return None
        if target[:1] == b"/" and b"#" not in target:
            tail = target[:-1] if target[-1:] == b"?" else target
        else:  # absolute-form, or a fragment the path ends at: as uvicorn reads them
            url = httptools.parse_url(target)
            tail = url.path + b"?" + url.query if url.query else url.path
        if tail[:1] != b"/" or _UNSAFE.search(tail) is not None:
            return None  # "*", an authority, or unsafe bytes: the general path refuses them
        if default_headers is not self._date_key:
            self._date_key = default_headers
            self._date_head = b"".join(n + b": " + v + b"\r\n" for n, v in default_headers)
        answer = self.redirect(name, headers, peer)
        if answer is None:
            return None
        return b"".join(
            (
                answer.status_line,
                self._date_head,
                b"location: ",
                answer.base,
                tail,
                answer.middle,
                self._cached_id(answer),
                _END if keep_alive else _END_CLOSE,
            )
        )

    def redirect(
        self, method: str, headers: Sequence[tuple[bytes, bytes]], peer: str | None
    ) -> _Answer | None:
        """The redirect that answers this request, counted as given; None (nothing counted)
        when a redirect does not answer it: the general path answers and counts those.

        ``headers`` are the request's headers with lower-case names, ``peer`` the socket
        peer's address as the server gives it.
        """
        snapshot = self.store.current
        now = self._now = self.clock()
        window = self._window
        if not window.holds(snapshot, now) and not window.advance(snapshot, now):
            self._exact.clear()
            self._answers.clear()
        # The request's inputs to a decision: every value of every header the decision reads,
        # in order, with its kind; credentials only through the tenant they name.
        parts: list[object] = [method, peer]
        auth: bytes | None = None
        api_key: bytes | None = None
        for header, value in headers:
            kind = _WANTED.get(header)
            if kind is None:
                continue
            if kind == _AUTH:
                auth = value
            elif kind == _API_KEY:
                api_key = value
            else:
                parts.append(kind)
                parts.append(value)
        if auth is not None or api_key is not None:
            parts.append(_AUTH)
            parts.append(credentials_tenant(self._tenant_index(snapshot), auth, api_key))
        key = tuple(parts)
        hit = self._exact.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._resolve(snapshot, now, method, headers, peer)
            if len(self._exact) >= _ANSWERS_LIMIT:
                self._exact.clear()
            self._exact[key] = hit
        if hit is None:
            return None
        answer = cast(_Answer, hit)
        if answer.n:
            answer.n += 1
        else:
            answer.n = 1
            answer.first = now
            self._tallied.append(answer)
        answer.last = now
        responses = self.stats.responses
        responses[answer.status] = responses.get(answer.status, 0) + 1
        self.responses += 1
        return answer

    def _resolve(
        self,
        snapshot: Snapshot,
        now: float,
        method: str,
        headers: Sequence[tuple[bytes, bytes]],
        peer: str | None,
    ) -> _Answer | None:
        """The answer for request inputs not seen in this snapshot: from the decision-input
        level of the cache, or a new decision. None when a redirect does not answer them."""
        if method not in ALLOWED_METHODS:
            return None
        host_values, forwarded, xff, residency, tenant_header, auth, api_key = _scan(headers)
        self._same_topology(snapshot)
        host, service = self._host(host_values, snapshot)
        if host is None or service is None:
            return None
        if service.http.mode == "proxy" and self.forwarder is not None:
            return None
        try:
            client = client_address(
                parse_peer(peer) if peer else _UNSPECIFIED, self.trusted, forwarded, xff
            )
            classes, tenant = signals_of(
                self._tenant_index(snapshot), service, residency, tenant_header, auth, api_key
            )
        except (ForwardingError, SignalError):
            return None
        # The decision reads the client through its network (/24, /56: the spillover hash) and
        # its GeoIP location: the network keys it, unless the GeoIP network is narrower and
        # splits it, when the address does.
        location = snapshot.geo.locate(client)
        net = location.network
        address = int(client)
        if client.version == 4:
            where: tuple[int, int] = (4, address >> 8)
            split = net is None or net.prefixlen > 24
        else:
            where = (6, address >> 72)
            split = net is None or net.prefixlen > 56
        key = (host, method, where, address if split else None, classes, tenant)
        answer = self._answers.get(key)
        if answer is None:
            request = DecisionRequest(Channel.HTTP, client, service.id, host, None, classes, tenant)
            self.stats.decided += 1
            try:
                decision = decide(request, snapshot, now)
            except Exception:  # the general path answers (500) and logs it
                return None
            outcome = decision.outcome
            if outcome is Outcome.ANSWER and decision.region and decision.base_url:
                region, base = decision.region, decision.base_url
            elif outcome is Outcome.FAIL_STATIC and decision.regions:
                # Unrestricted traffic with no healthy region: the policy says answer anyway,
                # with its first allowed region (a redirect names one).
                region = decision.regions[0]
                base = snapshot.regions[region].base_url
            else:
                return None  # a refusal: the general path renders it
            status = service.http.redirect_status
            record = record_of(
                decision,
                channel="http",
                name=host,
                tenant=tenant,
                query_type=method,
                response=str(status),
                answer=(base,),
            )
            named = self._regions.get(region)
            if named is None:
                name = region.encode()
                middle = b"\r\ncache-control: no-store\r\nx-gtm-region: %s\r\nx-gtm-decision-id: "
                named = self._regions[region] = (name, middle % name)
            answer = _Answer(record, status, self._base(base), *named)
            if len(self._answers) >= _ANSWERS_LIMIT:
                self._answers.clear()
            self._answers[key] = answer
        return answer

    def drain_tallies(self) -> Iterator[Tally]:
        """The audit writer's source: the responses counted since the last drain. Runs on the
        loop, interleaved with answering (the writer slices its flush): a tally counted again
        before its turn here is drained with that count too, and one counted after its turn
        is listed again for the next drain."""
        tallied, self._tallied = self._tallied, []
        for tally in tallied:
            n = tally.n
            if n:
                tally.n = 0
                yield tally.record, n, tally.first, tally.last
        if self._closed and not self._tallied:
            self.runtime.writer.remove_source(self.drain_tallies)

    def close(self) -> None:
        """No more requests: drop the caches. What was counted stays with the audit writer's
        next drain (the runtime's stop flushes), after which the source removes itself."""
        self._closed = True
        self._exact.clear()
        self._answers.clear()
        self._records.clear()

    # -- the general path ----------------------------------------------------------------------

    def _same_topology(self, snapshot: Snapshot) -> None:
        if snapshot.topology is not self._topology:
            self._topology = snapshot.topology
            self._hosts.clear()

    def _tenant_index(self, snapshot: Snapshot) -> TenantIndex:
        index = self._tenants
        if index.topology is not snapshot.topology:
            index = self._tenants = TenantIndex(snapshot.topology)
        return index

    def _host(self, values: list[bytes], snapshot: Snapshot) -> tuple[str | None, Service | None]:
        """The host named by the Host header (port and trailing dot dropped) and its service;
        host None when the header is missing, repeated or malformed. Memoised per topology."""
        if len(values) != 1:
            return None, None
        raw = values[0]
        hit = self._hosts.get(raw)
        if hit is None:
            host: str | None = None
            text = raw.decode("latin-1").strip().lower()
            if _HOST_RE.match(text):
                host = text.rsplit(":", 1)[0] if not text.endswith("]") else text
                host = host.rstrip(".") if not host.startswith("[") else host
            service = snapshot.topology.service_by_host(host) if host else None
            hit = (host, service)
            if len(self._hosts) >= _CACHE_LIMIT:
                self._hosts.clear()
            self._hosts[raw] = hit
        return hit

    def _cached_id(self, answer: _Answer) -> bytes:
        """The id of a response ``redirect()`` has just given from ``answer``."""
        return render_id(self._node_b, self._now, answer.id_tail, next(self._ids))

    def _decision_id(self, decision: Decision, name: str, at: float) -> bytes:
        """The id of a response the general path gives at ``at`` (the time it is counted
        with, so that its audit row's time span holds the id's time)."""
        tail = id_tail(str(decision.client_network), name)
        return render_id(self._node_b, at, tail, next(self._ids))

    def _base(self, url: str) -> bytes:
        hit = self._bases.get(url)
        if hit is None:
            hit = self._bases[url] = url.encode()
        return hit

    async def _redirect(
        self,
        scope: Scope,
        send: Send,
        snapshot: Snapshot,
        service: Service,
        decision: Decision,
        host: str,
        tenant: str | None,
    ) -> None:
        outcome = decision.outcome
        if outcome is Outcome.ANSWER:
            region, base = decision.region, decision.base_url
        elif outcome is Outcome.FAIL_STATIC and decision.regions:
            # Unrestricted traffic with no healthy region: the policy says answer anyway, with
            # its first allowed region (a redirect names one).
            region = decision.regions[0]
            base = snapshot.regions[region].base_url
        else:
            await self._refuse(scope, send, snapshot, decision, host, tenant)
            return
        assert region is not None
        assert base is not None
        status = service.http.redirect_status
        raw_path: bytes = scope["raw_path"] or scope["path"].encode()
        query: bytes = scope["query_string"]
        base_b = self._base(base)
        location = base_b + raw_path + b"?" + query if query else base_b + raw_path
        at = self.clock()
        decision_id = self._decision_id(decision, host, at)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"location", location),
                    _NO_STORE,
                    (b"x-gtm-region", region.encode()),
                    (b"x-gtm-decision-id", decision_id),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})
        self._count(decision, host, tenant, scope["method"], status, base, at=at)

    def _count(
        self,
        decision: Decision,
        host: str,
        tenant: str | None,
        method: str,
        status: int,
        answer: str | None,
        response: str | None = None,
        *,
        at: float | None = None,
    ) -> None:
        """Count a response of the general path; ``at``: the time its decision id names
        (default now)."""
        self.stats.count(status)
        # The record is memoised: building one walks every candidate and costs more than the
        # decision itself, and almost every response repeats a recent one. The parts of a
        # decision that come from the snapshot's memos are keyed by identity; the entry holds
        # them, so an id cannot be reused by another object while its entry exists.
        key = (
            id(decision.candidates),
            id(decision.location),
            id(decision.client_network),
            id(decision.versions),
            id(decision.matched_rules),
            id(decision.residency_classes),
            decision.outcome,
            decision.region,
            decision.service,
            decision.ttl,
            host,
            tenant,
            method,
            status,
            response,
            answer,
        )
        entry = self._records.get(key)
        if entry is None:
            record = record_of(
                decision,
                channel="http",
                name=host,
                tenant=tenant,
                query_type=method,
                response=response or str(status),
                answer=(answer,) if answer else (),
            )
            if len(self._records) >= _RECORDS_LIMIT:
                self._records.clear()  # tallies being counted stay in self._tallied
            entry = self._records[key] = _Counted(record, decision)
        now = self.clock() if at is None else at
        if entry.n:
            entry.n += 1
            # Responses counted at their decision's time (``at``) can end out of order (a
            # long proxied exchange decided first): the row must span every one of them.
            if now < entry.first:
                entry.first = now
            if now > entry.last:
                entry.last = now
        else:
            entry.n = 1
            entry.first = entry.last = now
            self._tallied.append(entry)
        self.responses += 1

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        snapshot: Snapshot,
        decision: Decision,
        host: str,
        tenant: str | None,
    ) -> None:
        """451 when the request's class is allowed nowhere; 503 with Retry-After when its
        allowed regions are all unavailable. Never an answer from outside the allowed set."""
        reasons = sorted(
            {c.detail or c.reason.value for c in decision.candidates if c.status is Status.DROPPED}
        )
        body: dict[str, object]
        extra: list[tuple[bytes, bytes]] = []
        if decision.outcome is Outcome.DENIED:
            status = 451
            body = {
                "error": "residency_denied",
                "message": "the request's residency classes are allowed in no region",
                "residency_classes": list(decision.residency_classes),
                "rules": list(decision.matched_rules),
                "reasons": reasons,
            }
        elif decision.outcome is Outcome.NO_SERVICE:
            status = 404  # the topology changed under the request; nothing to decide
            body = {"error": "unknown_host", "message": f"no service for host {host!r}"}
        else:
            status = 503
            retry_after = max(1, snapshot.topology.routing.degraded_ttl)
            extra.append((b"retry-after", str(retry_after).encode()))
            body = {
                "error": "no_allowed_region_available",
                "message": "every region this request may be served from is unavailable",
                "residency_classes": list(decision.residency_classes),
                "rules": list(decision.matched_rules),
                "regions": [
                    {"region": c.region, "reason": c.reason.value, "detail": c.detail}
                    for c in decision.candidates
                ],
                "retry_after_s": retry_after,
            }
        at = self.clock()
        body["decision_id"] = self._decision_id(decision, host, at).decode()
        body["snapshot_version"] = decision.versions.snapshot
        await _send_json(send, status, body, extra)
        self._count(decision, host, tenant, scope["method"], status, None, at=at)

    async def _reject(
        self,
        reject: _Reject,
        scope: Scope,
        send: Send,
        snapshot: Snapshot,
        peer: IPAddress,
        host: str | None,
        method: str,
    ) -> None:
        extra = [(b"allow", _ALLOW)] if reject.status == 405 else []
        await _send_json(send, reject.status, reject.body, extra)
        self.count_rejected(snapshot, peer, host, method, reject.status)

    def count_rejected(
        self, snapshot: Snapshot, peer: IPAddress, host: str | None, method: str, status: int
    ) -> None:
        """Count a response that no decision stood behind (bad input, unknown host): the
        audit row holds a no-service decision for the peer, so these answers add up too."""
        decision = decide(DecisionRequest(Channel.HTTP, peer, "", host or _NO_HOST), snapshot, 0.0)
        self._count(decision, host or _NO_HOST, None, method, status, None)

    async def _proxy(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        snapshot: Snapshot,
        decision: Decision,
        client: IPAddress,
        host: str,
        tenant: str | None,
    ) -> None:
        assert self.forwarder is not None
        targets = proxy_targets(decision, snapshot)
        if not targets:
            await self._refuse(scope, send, snapshot, decision, host, tenant)
            return
        method: str = scope["method"]
        # Counted at the decision's time, however long the exchange takes: the id names it.
        at = self.clock()
        decision_id = self._decision_id(decision, host, at)
        try:
            body = await read_body(receive, self.forwarder.limits.max_body_bytes)
        except BodyTooLarge:
            limit = self.forwarder.limits.max_body_bytes
            await _send_json(
                send,
                413,
                {"error": "body_too_large", "message": f"request bodies are limited to {limit}"},
                [],
            )
            self._count(decision, host, tenant, method, 413, None, at=at)
            return
        except ClientGone:
            self._count(decision, host, tenant, method, 499, None, "499 client went away", at=at)
            return
        upstream_headers = [
            (b"x-forwarded-for", str(client).encode()),
            (b"x-forwarded-host", host.encode()),
            (b"x-forwarded-proto", scope.get("scheme", "http").encode()),
            (b"x-gtm-decision-id", decision_id),
            (b"x-gtm-residency", ",".join(decision.residency_classes).encode()),
        ]
        result = None
        try:
            result = await self.forwarder.forward(
                scope,
                receive,
                send,
                targets=targets,
                body=body,
                upstream_headers=upstream_headers,
                response_headers=[(b"x-gtm-decision-id", decision_id)],
            )
        finally:
            # Counted however the exchange ended, cancellation included (rule 2).
            if result is None:
                self._count(
                    decision, host, tenant, method, 502, None, "502 proxy interrupted", at=at
                )
            else:
                served = decision
                if result.region is not None and result.region != decision.region:
                    served = decision._replace(region=result.region, base_url=result.base_url)
                response = str(result.status)
                if result.aborted:
                    response += " aborted"
                if result.note:
                    response += f" ({result.note})"
                self._count(
                    served, host, tenant, method, result.status, result.base_url, response, at=at
                )

    # -- the front's own endpoints -------------------------------------------------------------

    async def _ops(self, path: str, send: Send) -> None:
        self.stats.ops += 1
        if path == "/livez":
            await _send_json(send, 200, {"status": "live"}, [])
        elif path == "/readyz":
            ok = self.ready and not self.draining
            body = {
                "status": "ready" if ok else ("draining" if self.draining else "starting"),
                "snapshot_version": self.store.current.version,
            }
            await _send_json(send, 200 if ok else 503, body, [])
        else:
            payload = generate_latest()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})

    async def _capacity(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A pushed capacity report: verified (HMAC, freshness, order), then folded into the
        snapshot. Not a routing decision, so not an audit row; counted in metrics."""
        signature = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"x-gtm-signature"), None
        )
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > CAPACITY_MAX_BYTES:
                CAPACITY_REPORTS.labels("too_large").inc()
                await _send_json(
                    send,
                    413,
                    {"error": "too_large", "message": "a capacity report is a few hundred bytes"},
                    [],
                )
                return
            if not message.get("more_body", False):
                break
        result = self.runtime.intake.accept(body, signature, self.clock())
        if isinstance(result, Rejected):
            status = (
                401
                if result.reason.startswith("signature")
                else 409
                if result.reason.startswith(("replayed", "stale"))
                else 400
            )
            CAPACITY_REPORTS.labels("rejected").inc()
            await _send_json(
                send, status, {"error": "report_rejected", "message": result.reason}, []
            )
            return
        self.runtime.apply_report(result)
        CAPACITY_REPORTS.labels("accepted").inc()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _scan(
    headers: Sequence[tuple[bytes, bytes]],
) -> tuple[
    list[bytes],
    list[bytes],
    list[bytes],
    list[bytes] | None,
    list[bytes] | None,
    bytes | None,
    bytes | None,
]:
    """The values of the headers a decision reads: host, Forwarded, X-Forwarded-For, residency
    and tenant (each every value, in order), Authorization and X-API-Key (the last value)."""
    host_values: list[bytes] = []
    forwarded: list[bytes] = []
    xff: list[bytes] = []
    residency: list[bytes] | None = None
    tenant: list[bytes] | None = None
    auth: bytes | None = None
    api_key: bytes | None = None
    for name, value in headers:
        kind = _WANTED.get(name)
        if kind is None:
            continue
        if kind == _HOST:
            host_values.append(value)
        elif kind == _XFF:
            xff.append(value)
        elif kind == _FORWARDED:
            forwarded.append(value)
        elif kind == _RESIDENCY:
            residency = [*residency, value] if residency else [value]
        elif kind == _TENANT:
            tenant = [*tenant, value] if tenant else [value]
        elif kind == _AUTH:
            auth = value
        else:
            api_key = value
    return host_values, forwarded, xff, residency, tenant, auth, api_key


def proxy_targets(decision: Decision, snapshot: Snapshot) -> list[Target]:
    """The chosen region, then the next allowed and healthy one by distance (configured order
    when the client's location is unknown). Dropped regions are never targets: the retry stays
    inside the allowed set."""
    if decision.outcome is Outcome.ANSWER and decision.region is not None:
        first = decision.region
        others = [c.region for c in decision.candidates if c.status is Status.ELIGIBLE]
        distances = decision.distances
        if distances:
            others.sort(key=lambda r: distances.get(r, float("inf")))
        order = [first, *others]
    elif decision.outcome is Outcome.FAIL_STATIC:
        order = list(decision.regions)
    else:
        return []
    return [Target(r, snapshot.regions[r].base_url) for r in order]


async def _send_json(
    send: Send, status: int, body: Mapping[str, object], extra: list[tuple[bytes, bytes]]
) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = [_JSON, _NO_STORE, (b"content-length", str(len(payload)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


__all__ = ["ALLOWED_METHODS", "FrontApp", "proxy_targets"]
