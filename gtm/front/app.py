"""The HTTP front as a raw ASGI callable: one decision per request, answered from memory.

No framework sits on the redirect path: a request is a scan of its headers, a dictionary lookup
of its host, ``decide()`` and one audit count, and the response is a handful of byte strings
(a framework's routing, request objects and middleware cost several times the whole decision).

Hosts that belong to a service are the traffic: every path of them is redirected (or proxied),
so a service may use any path at all. The node's own hosts (its address, ``localhost``) get the
operational endpoints (:mod:`gtm.front.ops`) and the capacity-report intake
(:mod:`gtm.front.intake`); any other path there is "unknown host" (404). Every response to
traffic, including 404s and rejected input, is counted in the audit store (rule 2,
:mod:`gtm.front.ledger`); the operational endpoints are not decisions and are not.

:class:`FrontApp` puts the units together. A request is first offered to the answer cache
(:mod:`gtm.front.answers`, the hot path); what it does not answer takes the general path here:
bad input is rejected, a decision is made, and the answer is a redirect, a refusal (451, 503)
or a proxied exchange (:mod:`gtm.front.proxy`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import structlog
from opentelemetry.trace import Span, SpanKind, StatusCode

from gtm import tracing
from gtm.decision.model import Decision, IPAddress, Outcome, Status
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Service
from gtm.front.affinity import Affinity, AffinitySettings, Session
from gtm.front.answers import ALLOWED_METHODS, UNSPECIFIED, AnswerCache
from gtm.front.client_address import ForwardingError, TrustedProxies, client_address, parse_peer
from gtm.front.headers import HostIndex, scan
from gtm.front.intake import CAPACITY_PATH, CapacityEndpoint
from gtm.front.ledger import Ledger
from gtm.front.metrics import FrontStats
from gtm.front.ops import OPS_PATHS, OpsEndpoints
from gtm.front.proxy import (
    BodyTimedOut,
    BodyTooLarge,
    ClientGone,
    Forwarder,
    RegionHeaders,
    Target,
    read_body,
)
from gtm.front.respond import NO_STORE, Receive, Scope, Send, send_json
from gtm.front.signals import SignalError, signals_of
from gtm.runtime import Runtime

log = structlog.get_logger(__name__)

_ALLOW = ", ".join(sorted(ALLOWED_METHODS)).encode()
_EMPTY_BODY = {"type": "http.response.body", "body": b""}


# Served only to GTM_OPS_ALLOW when it is set: reports move traffic, metrics describe it.
_RESTRICTED = frozenset({CAPACITY_PATH, "/metrics"})


class _Reject(Exception):
    """Bad input: answered with ``status`` and a JSON body, nothing else happens."""

    def __init__(self, status: int, error: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": error, "message": message, **extra}


class FrontApp:
    """One front: the answer cache, the general path, the intake and the ops endpoints, with
    one ledger counting every response to traffic."""

    def __init__(
        self,
        runtime: Runtime,
        forwarder: Forwarder | None = None,
        affinity: AffinitySettings | None = None,
    ) -> None:
        """``affinity``: keep proxied sessions in their region (:mod:`gtm.front.affinity`);
        None: every request is decided afresh."""
        self.runtime = runtime
        self.store = runtime.store
        self.forwarder = forwarder
        self.stats = FrontStats()
        self.trusted = TrustedProxies(runtime.settings.trusted_proxies)
        self.hosts = HostIndex(runtime.store.current.topology)
        self.ledger = Ledger(runtime, self.stats)
        self.answers = AnswerCache(
            self.store, self.ledger, self.hosts, self.trusted, proxying=forwarder is not None
        )
        self.ops = OpsEndpoints(self.store, self.stats)
        self.affinity = (
            Affinity(affinity) if affinity is not None and forwarder is not None else None
        )
        self.stats.affinity = self.affinity
        self.capacity = CapacityEndpoint(runtime)
        self.ops_allow = runtime.settings.ops_allow
        # Proxied exchanges are traced while tracing is on (gtm.tracing); redirects never are.
        self.tracer = tracing.tracer("gtm.front")

    @property
    def clock(self) -> Callable[[], float]:
        """The front's time source (decisions, audit times, report freshness)."""
        return self.ledger.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.ledger.clock = self.capacity.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off and websockets are not served; nothing to answer
        method: str = scope["method"]
        raw_path: bytes = scope["raw_path"] or scope["path"].encode()
        peer_info = scope.get("client")
        answer = (
            self.answers.redirect(method, scope["headers"], peer_info[0] if peer_info else None)
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
                        NO_STORE,
                        (b"x-gtm-region", answer.region),
                        (b"x-gtm-decision-id", self.ledger.cached_id(answer.id_tail)),
                        (b"content-length", b"0"),
                    ],
                }
            )
            await send(_EMPTY_BODY)
            return
        await self._general(scope, receive, send, method)

    def close(self) -> None:
        """No more requests: drop the caches. What was counted stays with the audit writer's
        next drain (the runtime's stop flushes), after which the ledger's source removes
        itself."""
        self.answers.close()
        self.ledger.close()

    async def _general(self, scope: Scope, receive: Receive, send: Send, method: str) -> None:
        """Every request that is not answered by a cached redirect."""
        snapshot = self.store.current
        host_values, forwarded, xff, residency, tenant, auth, api_key = scan(scope["headers"])
        peer_info = scope.get("client")
        peer = parse_peer(peer_info[0]) if peer_info else UNSPECIFIED
        host, service = self.hosts.host(host_values, snapshot)
        if service is None and host is not None:
            path = scope["path"]
            if (
                path in _RESTRICTED
                and self.ops_allow
                and not any(peer in n for n in self.ops_allow)
            ):
                await send_json(
                    send,
                    403,
                    {"error": "forbidden", "message": f"{path} is not served to {peer}"},
                    [],
                )
                return
            if scope["path"] in OPS_PATHS and method in ("GET", "HEAD"):
                await self.ops.answer(scope["path"], send)
                return
            if scope["path"] == CAPACITY_PATH and method == "POST":
                await self.capacity(scope, receive, send)
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
            index = self.hosts.tenants(snapshot)
            try:
                classes, tenant_id = signals_of(index, service, residency, tenant, auth, api_key)
            except SignalError as exc:
                raise _Reject(400, "bad_residency_or_tenant", str(exc)) from None
        except _Reject as reject:
            await self._reject(reject, scope, send, snapshot, peer, host, method)
            return
        request = DecisionRequest(Channel.HTTP, client, service.id, host, None, classes, tenant_id)
        try:
            decision = decide(request, snapshot, self.ledger.clock())
        except Exception as exc:  # a bug, not input: answered and counted like everything else
            self.runtime.failures.record("front.decide", exc, host=host, service=service.id)
            await send_json(send, 500, {"error": "internal", "message": "no decision"}, [])
            self.ledger.count_rejected(snapshot, peer, host, method, 500)
            return
        if service.http.mode == "proxy" and self.forwarder is not None:
            await self._proxy(scope, receive, send, snapshot, decision, client, host, tenant_id)
        else:
            await self._redirect(scope, send, snapshot, service, decision, host, tenant_id)

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
        base_b = self.answers.base(base)
        location = base_b + raw_path + b"?" + query if query else base_b + raw_path
        at = self.ledger.clock()
        decision_id = self.ledger.decision_id(decision, host, at)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"location", location),
                    NO_STORE,
                    (b"x-gtm-region", region.encode()),
                    (b"x-gtm-decision-id", decision_id),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})
        self.ledger.count(decision, host, tenant, scope["method"], status, base, at=at)

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
        at = self.ledger.clock()
        body["decision_id"] = self.ledger.decision_id(decision, host, at).decode()
        body["snapshot_version"] = decision.versions.snapshot
        await send_json(send, status, body, extra)
        self.ledger.count(decision, host, tenant, scope["method"], status, None, at=at)

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
        await send_json(send, reject.status, reject.body, extra)
        self.ledger.count_rejected(snapshot, peer, host, method, reject.status)

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
        session = None
        if self.affinity is not None:
            now = self.ledger.clock()
            secure = scope.get("scheme") == "https"
            try:
                session = self.affinity.read(scope["headers"], decision, tenant, now, secure)
                decision, session = self.affinity.keep(decision, session, snapshot, now)
            except Exception as exc:  # a bug, not input: the fresh decision serves (counted)
                self.runtime.failures.record("front.affinity", exc, host=host)
                session = None
        targets = proxy_targets(decision, snapshot)
        if not targets:
            await self._refuse(scope, send, snapshot, decision, host, tenant)
            return
        method: str = scope["method"]
        # Counted at the decision's time, however long the exchange takes: the id names it.
        at = self.ledger.clock()
        decision_id = self.ledger.decision_id(decision, host, at)
        exchange = _Exchange(decision, targets, client, host, tenant, at, decision_id, session)
        if self.tracer is None:
            await self._exchange(scope, receive, send, exchange, None)
            return
        span = self.tracer.start_span(
            f"proxy {decision.service}",
            context=tracing.ROOT,
            kind=SpanKind.SERVER,
            links=tracing.client_links(scope["headers"]),
            attributes={
                "http.request.method": method,
                "gtm.decision_id": decision_id.decode(),
                "gtm.service": decision.service,
                "gtm.outcome": decision.outcome.value,
                "gtm.policy_version": decision.versions.policy,
                "gtm.snapshot_version": decision.versions.snapshot,
            },
        )
        if decision.region is not None:  # none when failing static: every allowed region
            span.set_attribute("gtm.region", decision.region)
        if session is not None:
            span.set_attribute("gtm.affinity", session.verdict.value)
        try:
            status, served = await self._exchange(scope, receive, send, exchange, span)
            span.set_attribute("http.response.status_code", status)
            if served is not None and served != decision.region:
                span.set_attribute("gtm.region.served", served)  # the retry's region
            if status >= 500:
                span.set_status(StatusCode.ERROR)
        finally:
            span.end()

    async def _exchange(
        self, scope: Scope, receive: Receive, send: Send, exchange: _Exchange, span: Span | None
    ) -> tuple[int, str | None]:
        """Read the body and forward it, counting the response at the decision's time; the
        status sent (499: none, the client went away) and the region that answered."""
        assert self.forwarder is not None
        decision, host, tenant, at = exchange.decision, exchange.host, exchange.tenant, exchange.at
        client, decision_id = exchange.client, exchange.decision_id
        method: str = scope["method"]
        try:
            body = await read_body(receive, self.forwarder.limits.max_body_bytes, scope)
        except BodyTimedOut:
            await send_json(
                send,
                408,
                {
                    "error": "request_body_timeout",
                    "message": "the request body did not arrive in time",
                },
                [(b"connection", b"close")],
            )
            self.ledger.count(
                decision, host, tenant, method, 408, None, "408 request body timeout", at=at
            )
            return 408, None
        except BodyTooLarge:
            limit = self.forwarder.limits.max_body_bytes
            await send_json(
                send,
                413,
                {"error": "body_too_large", "message": f"request bodies are limited to {limit}"},
                [],
            )
            self.ledger.count(decision, host, tenant, method, 413, None, at=at)
            return 413, None
        except ClientGone:
            self.ledger.count(
                decision, host, tenant, method, 499, None, "499 client went away", at=at
            )
            return 499, None
        upstream_headers = [
            (b"x-forwarded-for", str(client).encode()),
            (b"x-forwarded-host", host.encode()),
            (b"x-forwarded-proto", scope.get("scheme", "http").encode()),
            (b"x-gtm-decision-id", decision_id),
            (b"x-gtm-residency", ",".join(decision.residency_classes).encode()),
        ]
        result = None
        session = exchange.session
        cookie: RegionHeaders | None = None
        if session is not None and self.affinity is not None:
            cookie = _cookie_for(self.affinity, session, at)

        try:
            result = await self.forwarder.forward(
                scope,
                receive,
                send,
                targets=exchange.targets,
                body=body,
                upstream_headers=upstream_headers,
                response_headers=[(b"x-gtm-decision-id", decision_id)],
                span=span,
                region_headers=cookie,
            )
        finally:
            # Counted however the exchange ended, cancellation included (rule 2).
            if result is None:
                self.ledger.count(
                    decision, host, tenant, method, 502, None, "502 proxy interrupted", at=at
                )
            else:
                served = decision
                if result.region is not None and result.region != decision.region:
                    served = decision._replace(region=result.region, base_url=result.base_url)
                response = str(result.status)
                if result.aborted:
                    response += " aborted"
                notes = [result.note] if result.note else []
                if session is not None and session.note():
                    notes.append(session.note())
                if notes:
                    response += f" ({'; '.join(notes)})"
                self.ledger.count(
                    served, host, tenant, method, result.status, result.base_url, response, at=at
                )
        assert result is not None  # else what interrupted the exchange propagates
        return result.status, result.region


class _Exchange(NamedTuple):
    """A proxied request once decided: what forwarding it and counting its response need."""

    decision: Decision
    targets: list[Target]
    client: IPAddress
    host: str
    tenant: str | None
    at: float  # the decision's time: the response is counted at it, and its id names it
    decision_id: bytes
    session: Session | None  # the request's affinity session, when affinity is on


def _cookie_for(affinity: Affinity, session: Session, at: float) -> RegionHeaders:
    def cookie(region: str, status: int) -> list[tuple[bytes, bytes]]:
        # The session follows the region that answered (the retry's, if it came to that);
        # an error from it is no reason to come back.
        if status >= 500:
            return []
        return [(b"set-cookie", affinity.issue(region, session, at))]

    return cookie


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


__all__ = ["ALLOWED_METHODS", "FrontApp", "proxy_targets"]
