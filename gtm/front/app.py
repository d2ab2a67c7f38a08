"""The HTTP front as a raw ASGI callable: one decision per request, answered from memory.

No framework sits on the redirect path: a request is a scan of its headers, a dictionary lookup
of its host, ``decide()`` and one audit count, and the response is a handful of byte strings
(a framework's routing, request objects and middleware cost several times the whole decision).

Hosts that belong to a service are the traffic: every path of them is redirected (or proxied),
so a service may use any path at all. The front's own endpoints (``/livez``, ``/readyz``,
``/metrics``) are answered on any other host (the node's address, ``localhost``), where any other
path is "unknown host" (404). Every response to traffic, including 404s and rejected input, is
counted in the audit store (rule 2); the operational endpoints are not decisions and are not.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from ipaddress import IPv4Address
from typing import Any

import structlog
from prometheus_client import generate_latest

from gtm.audit.record import record_of
from gtm.capacity import Rejected
from gtm.decision import Decision, IPAddress, Outcome, Status
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
    signals_of,
)
from gtm.metrics import CAPACITY_REPORTS
from gtm.routing import Channel, DecisionRequest, decide
from gtm.runtime import Runtime
from gtm.snapshot import Snapshot
from gtm.topology import Service

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
        # Decision ids: unique per response, cheap to make (a counter), and traceable to the
        # node and process that made them.
        self._ids = itertools.count(1)
        self._id_prefix = f"{runtime.settings.node_id}-{secrets.token_hex(3)}-"
        self._tenants = TenantIndex(runtime.store.current.topology)
        self._topology = runtime.store.current.topology
        self._hosts: dict[bytes, tuple[str | None, Service | None]] = {}
        self._bases: dict[str, bytes] = {}
        # memo key -> [record, decision (keeps the key's ids alive), responses not yet handed
        # to the audit writer]
        self._records: dict[tuple[object, ...], list[Any]] = {}
        self._dirty: list[list[Any]] = []
        self.responses = 0  # responses to traffic since start (rule 2 bookkeeping)
        self.clock: Callable[[], float] = time.time

    # -- the request path ----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off and websockets are not served; nothing to answer
        snapshot = self.store.current
        host_values: list[bytes] = []
        forwarded: list[bytes] = []
        xff: list[bytes] = []
        residency: list[bytes] | None = None
        tenant: list[bytes] | None = None
        auth: bytes | None = None
        api_key: bytes | None = None
        for name, value in scope["headers"]:
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
        peer_info = scope.get("client")
        peer = parse_peer(peer_info[0]) if peer_info else _UNSPECIFIED
        method: str = scope["method"]
        if snapshot.topology is not self._topology:
            self._topology = snapshot.topology
            self._hosts.clear()
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
            try:
                client = client_address(peer, self.trusted, forwarded, xff)
            except ForwardingError as exc:
                raise _Reject(400, "bad_forwarding_header", str(exc)) from None
            index = self._tenants
            if index.topology is not snapshot.topology:
                index = self._tenants = TenantIndex(snapshot.topology)
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

    def _decision_id(self) -> bytes:
        return (self._id_prefix + format(next(self._ids), "x")).encode()

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
        decision_id = self._decision_id()
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
        self._count(decision, host, tenant, scope["method"], status, base)

    def _count(
        self,
        decision: Decision,
        host: str,
        tenant: str | None,
        method: str,
        status: int,
        answer: str | None,
        response: str | None = None,
    ) -> None:
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
                self.flush_counts()
                self._records.clear()
            entry = self._records[key] = [record, decision, 0]
        if not entry[2]:
            self._dirty.append(entry)
        entry[2] += 1
        self.responses += 1

    def flush_counts(self) -> int:
        """Hand the responses counted since the last call to the audit writer.

        The request path counts into its memo entries (an integer increment) and this runs
        beside it every few milliseconds (and once more after the last response, before the
        caller stops the runtime): the writer's own count costs a clock read, a record hash
        and a labelled metric per call, a noticeable share of a redirect. Nothing is lost by
        the delay: the counts are in memory either way until the writer's flush.
        """
        handed = 0
        writer = self.runtime.writer
        for entry in self._dirty:
            n = entry[2]
            if n:
                writer.count(entry[0], n)
                entry[2] = 0
                handed += n
        self._dirty.clear()
        return handed

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
        body["decision_id"] = self._decision_id().decode()
        body["snapshot_version"] = decision.versions.snapshot
        await _send_json(send, status, body, extra)
        self._count(decision, host, tenant, scope["method"], status, None)

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
        decision_id = self._decision_id()
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
            self._count(decision, host, tenant, method, 413, None)
            return
        except ClientGone:
            self._count(decision, host, tenant, method, 499, None, "499 client went away")
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
                self._count(decision, host, tenant, method, 502, None, "502 proxy interrupted")
            else:
                served = decision
                if result.region is not None and result.region != decision.region:
                    served = decision._replace(region=result.region, base_url=result.base_url)
                response = str(result.status)
                if result.aborted:
                    response += " aborted"
                if result.note:
                    response += f" ({result.note})"
                self._count(served, host, tenant, method, result.status, result.base_url, response)

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
