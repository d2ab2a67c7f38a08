"""regional_lb.tracing: the balancer continues the caller's trace, spans its pick and its call
to the instance, and sends the instance its own ``traceparent``; off, it sends none at all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from regional_lb import tracing
from regional_lb.balancing.gpus import profile
from regional_lb.errors import ConfigError
from regional_lb.protocol.asgi import Receive, Scope, Send
from regional_lb.protocol.serving import running
from regional_lb.sim.engine import EngineConfig
from regional_lb.sim.server import create_app as create_sim
from tests.regional_lb.conftest import SPEEDUP, balancer, balancer_config, chat, eventually
from tests.support.tracing import Spans, in_memory_spans

CHAT = "/v1/chat/completions"
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
def spans() -> Iterator[Spans]:
    with in_memory_spans() as kept:
        yield kept


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "REGIONAL_LB_OTEL_ENDPOINT",
        "REGIONAL_LB_OTEL_SERVICE_NAME",
        "REGIONAL_LB_OTEL_SAMPLE_RATIO",
    ):
        monkeypatch.delenv(name, raising=False)


class Instance:
    """The simulator, remembering the headers of every inference request."""

    def __init__(self) -> None:
        self.app = create_sim(EngineConfig(gpu=profile("A100"), models=["m1"], speedup=SPEEDUP))
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT:
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_balancer_continues_the_callers_trace_to_the_instance(
    spans: Spans, stream: bool
) -> None:
    instance = Instance()
    async with (
        running(instance) as url,
        balancer(balancer_config([url], region="eu-west")) as (lb, _),
        httpx.AsyncClient(base_url=lb, timeout=10) as client,
    ):
        response = await client.post(
            CHAT,
            json=chat(max_tokens=5, stream=stream),
            headers={
                "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
                "x-gtm-decision-id": "gtm-1~18bf3a1c2e4~9a0c11f2~2a",
            },
        )
        assert response.status_code == 200
        await eventually(lambda: bool(spans.named(f"POST {CHAT}")), what="the request's span")

    served, pick, hop = spans.one(f"POST {CHAT}"), spans.one("pick"), spans.one("upstream")
    assert served.kind is SpanKind.SERVER and hop.kind is SpanKind.CLIENT
    assert served.parent is not None and served.parent.is_remote
    assert f"{served.parent.span_id:016x}" == CALLER_SPAN
    assert {f"{s.context.trace_id:032x}" for s in (served, pick, hop)} == {CALLER_TRACE}
    assert pick.parent is not None and pick.parent.span_id == served.context.span_id
    assert hop.parent is not None and hop.parent.span_id == served.context.span_id
    attributes: dict[str, Any] = dict(served.attributes or {})
    assert attributes["gtm.decision_id"] == "gtm-1~18bf3a1c2e4~9a0c11f2~2a"
    assert attributes["gtm.region"] == "eu-west"
    assert attributes["http.response.status_code"] == 200
    assert dict(hop.attributes or {})["gtm.outcome"] == "ok"
    assert hop.status.status_code is not StatusCode.ERROR
    (sent,) = instance.headers
    assert sent["traceparent"].split("-")[1:3] == [CALLER_TRACE, f"{hop.context.span_id:016x}"]


async def test_off_the_instance_gets_no_trace_context_not_even_the_callers() -> None:
    instance = Instance()
    async with (
        running(instance) as url,
        balancer(balancer_config([url])) as (lb, _),
        httpx.AsyncClient(base_url=lb, timeout=10) as client,
    ):
        headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        response = await client.post(CHAT, json=chat(max_tokens=5), headers=headers)
        assert response.status_code == 200
    (sent,) = instance.headers
    assert "traceparent" not in sent


def test_configuration_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing.configure("eu-west") is None  # nothing set: off, nothing installed
    assert tracing.tracer("x") is None
    monkeypatch.setenv("REGIONAL_LB_OTEL_ENDPOINT", "http://127.0.0.1:4318")
    settings = tracing.TracingSettings()
    assert tracing.enabled(settings)
    provider = tracing.build_provider(settings, "eu-west")
    try:
        assert provider.resource.attributes["service.name"] == "regional-lb"
        assert provider.resource.attributes["gtm.region"] == "eu-west"
    finally:
        provider.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.enabled(settings)


def test_a_bad_tracing_variable_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` prints these and exits 2, like every other configuration problem."""
    monkeypatch.setenv("REGIONAL_LB_OTEL_SAMPLE_RATIO", "2")
    monkeypatch.setenv("REGIONAL_LB_OTEL_ENDPOINT", "collector:4318")
    with pytest.raises(ConfigError) as raised:
        tracing.from_environment()
    assert sorted(p.split(":")[0] for p in raised.value.problems) == [
        "REGIONAL_LB_OTEL_ENDPOINT",
        "REGIONAL_LB_OTEL_SAMPLE_RATIO",
    ]
