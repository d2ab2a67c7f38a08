"""The answer cache: redirects answered from memory, the front's hot path.

A decision once made is rendered into an :class:`Answer` (status, region, base URL and audit
record) and reused for every request with the same decision inputs (host, method, client
network and GeoIP bucket, residency classes, tenant) within one decision epoch (successor
snapshots that decide alike, :mod:`gtm.decision.answer_window`), until the next instant at
which a decision can change with time alone (a capacity report turning stale). A first level
keys the answer by the request's raw inputs (method, peer, and the values of the headers the
decision reads; credentials by the tenant they name), so a repeat skips the parsing as well.
Only the path, query and decision id are per response.

:meth:`AnswerCache.redirect` gives the answer (counted) or None, when a redirect does not
answer the request: a refusal, bad input, a proxied service, all left to the general path
(:mod:`gtm.front.app`). :meth:`AnswerCache.respond` is the same path for the HTTP protocol
itself (:mod:`gtm.front.server`), which answers a cached redirect without an ASGI request cycle.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from http import HTTPStatus
from ipaddress import IPv4Address
from typing import cast

import httptools

from gtm.audit.decision_id import id_tail
from gtm.audit.record import AuditRecord, record_of
from gtm.decision.answer_window import AnswerWindow
from gtm.decision.model import Outcome
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot, SnapshotStore
from gtm.front.client_address import ForwardingError, TrustedProxies, client_address, parse_peer
from gtm.front.headers import API_KEY, AUTH, WANTED, HostIndex, scan
from gtm.front.ledger import Ledger, Tally
from gtm.front.signals import SignalError, credentials_tenant, signals_of

ALLOWED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNSPECIFIED = IPv4Address(0)  # the peer of a request whose socket peer is unknown

_ANSWERS_LIMIT = 100_000  # per level of the answer cache
_METHODS = {m.encode(): m for m in ALLOWED_METHODS}
# What a response head may not carry in a header value (as uvicorn checks): the request target
# goes into Location. The parser already refuses such targets; this is the second lock.
_UNSAFE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_END = b"\r\ncontent-length: 0\r\n\r\n"
_END_CLOSE = b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_MISSING = object()


class Answer(Tally):
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


class AnswerCache:
    """Cached redirects of one front app, counted in its ledger as they are given."""

    def __init__(
        self,
        store: SnapshotStore,
        ledger: Ledger,
        hosts: HostIndex,
        trusted: TrustedProxies,
        proxying: bool,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.hosts = hosts
        self.trusted = trusted
        self.proxying = proxying  # proxy-mode services are proxied, not redirected
        self._bases: dict[str, bytes] = {}
        # region -> (its name, the response head from after Location to the decision id)
        self._regions: dict[str, tuple[bytes, bytes]] = {}
        # Request inputs -> answer (None: not answered by a cached redirect, the general path
        # answers), and decision inputs -> answer. Valid while the window holds: one decision
        # epoch, until a capacity report turns stale.
        self._exact: dict[tuple[object, ...], Answer | None] = {}
        self._answers: dict[tuple[object, ...], Answer] = {}
        self._window = AnswerWindow()
        self._date_key: object = None
        self._date_head = b""

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
                self.ledger.cached_id(answer.id_tail),
                _END if keep_alive else _END_CLOSE,
            )
        )

    def redirect(
        self, method: str, headers: Sequence[tuple[bytes, bytes]], peer: str | None
    ) -> Answer | None:
        """The redirect that answers this request, counted as given; None (nothing counted)
        when a redirect does not answer it: the general path answers and counts those.

        ``headers`` are the request's headers with lower-case names, ``peer`` the socket
        peer's address as the server gives it.
        """
        snapshot = self.store.current
        ledger = self.ledger
        now = ledger.now = ledger.clock()
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
            kind = WANTED.get(header)
            if kind is None:
                continue
            if kind == AUTH:
                auth = value
            elif kind == API_KEY:
                api_key = value
            else:
                parts.append(kind)
                parts.append(value)
        if auth is not None or api_key is not None:
            parts.append(AUTH)
            parts.append(credentials_tenant(self.hosts.tenants(snapshot), auth, api_key))
        key = tuple(parts)
        hit = self._exact.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._resolve(snapshot, now, method, headers, peer)
            if len(self._exact) >= _ANSWERS_LIMIT:
                self._exact.clear()
            self._exact[key] = hit
        if hit is None:
            return None
        answer = cast(Answer, hit)
        if answer.n:
            answer.n += 1
        else:
            answer.n = 1
            answer.first = now
            ledger.tallied.append(answer)
        answer.last = now
        responses = ledger.stats.responses
        responses[answer.status] = responses.get(answer.status, 0) + 1
        ledger.responses += 1
        return answer

    def _resolve(
        self,
        snapshot: Snapshot,
        now: float,
        method: str,
        headers: Sequence[tuple[bytes, bytes]],
        peer: str | None,
    ) -> Answer | None:
        """The answer for request inputs not seen in this snapshot: from the decision-input
        level of the cache, or a new decision. None when a redirect does not answer them."""
        if method not in ALLOWED_METHODS:
            return None
        host_values, forwarded, xff, residency, tenant_header, auth, api_key = scan(headers)
        host, service = self.hosts.host(host_values, snapshot)
        if host is None or service is None:
            return None
        if service.http.mode == "proxy" and self.proxying:
            return None
        try:
            client = client_address(
                parse_peer(peer) if peer else UNSPECIFIED, self.trusted, forwarded, xff
            )
            classes, tenant = signals_of(
                self.hosts.tenants(snapshot), service, residency, tenant_header, auth, api_key
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
            self.ledger.stats.decided += 1
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
            answer = Answer(record, status, self.base(base), *named)
            if len(self._answers) >= _ANSWERS_LIMIT:
                self._answers.clear()
            self._answers[key] = answer
        return answer

    def base(self, url: str) -> bytes:
        """A region's base URL as bytes, encoded once."""
        hit = self._bases.get(url)
        if hit is None:
            hit = self._bases[url] = url.encode()
        return hit

    def close(self) -> None:
        self._exact.clear()
        self._answers.clear()


__all__ = ["ALLOWED_METHODS", "UNSPECIFIED", "Answer", "AnswerCache"]
