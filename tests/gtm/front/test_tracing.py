"""One trace from the HTTP front through a real regional balancer to the instance: the front,
the balancer and a simulated inference server on loopback, spans kept in memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.trace import SpanKind

from gtm.audit import query
from gtm.audit.database import make_async_engine
from regional_lb.balancing.gpus import profile
from regional_lb.protocol.asgi import Receive, Scope, Send
from regional_lb.protocol.serving import running
from regional_lb.sim.engine import EngineConfig
from regional_lb.sim.server import create_app as create_sim
from tests.gtm.front.conftest import FrontFactory
from tests.gtm.front.test_proxy import HEADERS, proxy_topology
from tests.regional_lb.conftest import SPEEDUP, balancer, balancer_config, chat
from tests.support.tracing import Spans, in_memory_spans
from tests.support.waiting import eventually

# What a client might send: its own trace, which the front links but does not continue.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture
def spans() -> Iterator[Spans]:
    with in_memory_spans() as kept:
        yield kept


class RecordingInstance:
    """The simulator, remembering the headers of every inference request it is sent."""

    def __init__(self) -> None:
        self.app = create_sim(EngineConfig(gpu=profile("A100"), models=["m1"], speedup=SPEEDUP))
        self.requests: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/chat"):
            self.requests.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


def _hex(value: int, width: int) -> str:
    return f"{value:0{width}x}"


async def test_a_proxied_request_is_one_trace_from_the_front_to_the_instance(
    start_front: FrontFactory, spans: Spans
) -> None:
    instance = RecordingInstance()
    async with (
        running(instance) as instance_url,
        balancer(balancer_config([instance_url], region="eu-central")) as (balancer_url, _),
    ):
        port = int(balancer_url.rsplit(":", 1)[1])
        async with (
            start_front(proxy_topology({"eu-central": port})) as front,
            httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10) as http,
        ):
            response = await http.post(
                CHAT_PATH,
                json=chat(max_tokens=5),
                headers={**HEADERS, "traceparent": CLIENT_TRACEPARENT},
            )
            assert response.status_code == 200
            assert response.headers["x-gtm-region"] == "eu-central"
            decision_id = response.headers["x-gtm-decision-id"]
            # Spans end after their responses are sent: wait for the last of them.
            names = ("proxy chat-eu", "POST eu-central", f"POST {CHAT_PATH}", "pick", "upstream")
            await eventually(
                lambda: all(spans.named(n) for n in names), what="every span of the request"
            )

    front_span = spans.one("proxy chat-eu")
    attempt = spans.one("POST eu-central")
    served = spans.one(f"POST {CHAT_PATH}")
    pick = spans.one("pick")
    hop = spans.one("upstream")
    trace_id = front_span.context.trace_id

    # One trace, front to instance; the client's own trace is linked, never continued.
    assert {s.context.trace_id for s in (front_span, attempt, served, pick, hop)} == {trace_id}
    assert _hex(trace_id, 32) != CLIENT_TRACE
    assert front_span.parent is None and front_span.kind is SpanKind.SERVER
    assert [_hex(link.context.trace_id, 32) for link in front_span.links] == [CLIENT_TRACE]
    # Parent and child: the front's attempt, the balancer's request, its pick and its call.
    assert attempt.parent is not None and attempt.parent.span_id == front_span.context.span_id
    assert served.parent is not None and served.parent.span_id == attempt.context.span_id
    assert served.parent.is_remote and served.kind is SpanKind.SERVER
    assert pick.parent is not None and pick.parent.span_id == served.context.span_id
    assert hop.parent is not None and hop.parent.span_id == served.context.span_id

    # The decision: the same id in the response, at the front and at the balancer, and it
    # names the audit row that counted the response (region and policy version agree).
    front_attrs: dict[str, Any] = dict(front_span.attributes or {})
    served_attrs: dict[str, Any] = dict(served.attributes or {})
    assert front_attrs["gtm.decision_id"] == decision_id
    assert served_attrs["gtm.decision_id"] == decision_id
    engine = make_async_engine(front.runtime.settings.database_url)
    try:
        rows = await query.find_decision(engine, decision_id)
    finally:
        await engine.dispose()
    (row,) = rows
    assert row["region"] == front_attrs["gtm.region"] == "eu-central"
    assert row["policy_version"] == front_attrs["gtm.policy_version"]
    assert front_attrs["http.response.status_code"] == 200
    assert served_attrs["http.response.status_code"] == 200

    # The pick says where the request went, what it was estimated to cost, how long it queued.
    pick_attrs: dict[str, Any] = dict(pick.attributes or {})
    assert pick_attrs["gtm.instance"] == "i0"
    assert pick_attrs["gtm.estimated_cost"] > 0
    assert pick_attrs["gtm.queue_wait_s"] >= 0

    # The instance was sent the balancer's call's context: same trace, that span the parent.
    (sent,) = instance.requests
    version, sent_trace, sent_parent, flags = sent["traceparent"].split("-")
    assert (version, sent_trace, sent_parent) == (
        "00",
        _hex(trace_id, 32),
        _hex(hop.context.span_id, 16),
    )
    assert int(flags, 16) & 1  # sampled, as the front's span was
    assert CLIENT_TRACE not in sent["traceparent"]


async def test_off_the_front_and_balancer_trace_nothing_and_pass_nothing_on(
    start_front: FrontFactory,
) -> None:
    instance = RecordingInstance()
    async with (
        running(instance) as instance_url,
        balancer(balancer_config([instance_url], region="eu-central")) as (balancer_url, _),
    ):
        port = int(balancer_url.rsplit(":", 1)[1])
        async with (
            start_front(proxy_topology({"eu-central": port})) as front,
            httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10) as http,
        ):
            assert front.app.tracer is None and front.app.forwarder is not None
            assert front.app.forwarder.tracer is None
            response = await http.post(CHAT_PATH, json=chat(max_tokens=5), headers=HEADERS)
            assert response.status_code == 200
    (sent,) = instance.requests
    assert "traceparent" not in sent


async def test_redirects_are_never_traced(start_front: FrontFactory, spans: Spans) -> None:
    """Redirects (cached or decided afresh) are the front's DNS: counted, not traced."""
    async with (
        start_front() as front,
        httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10) as http,
    ):
        assert front.app.tracer is not None  # tracing is on
        for _ in range(3):
            response = await http.post(CHAT_PATH, content=b"{}", headers=HEADERS)
            assert response.status_code == 307
    assert spans.finished == ()
