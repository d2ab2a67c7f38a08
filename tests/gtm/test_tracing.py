"""gtm.tracing: off by default (nothing installed, the SDK not even loaded), on with an OTLP
endpoint (spans reach a collector on loopback), and never a span per DNS answer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import dns.asyncquery
import dns.message
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import ProxyTracerProvider, get_tracer_provider

from gtm import tracing
from gtm.node import Node, run_node
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES, ROOT
from tests.support.tracing import Spans, in_memory_spans

STANDARD = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_SAMPLER",
    "OTEL_RESOURCE_ATTRIBUTES",
    "GTM_OTEL_ENDPOINT",
    "GTM_OTEL_SERVICE_NAME",
    "GTM_OTEL_SAMPLE_RATIO",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the machine's environment says about OpenTelemetry, these tests say it."""
    for name in STANDARD:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def spans() -> Iterator[Spans]:
    with in_memory_spans() as kept:
        yield kept


def node_settings(tmp_path: Path, geoip_path: Path, **overrides: Any) -> Settings:
    return Settings(
        config=DEMO,
        policies=(POLICIES,),
        geoip_path=geoip_path,
        database_url=f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
        spool_dir=tmp_path / "spool",
        node_id="trace-test",
        dns_listen=("127.0.0.1:0",),
        probes=False,
        audit_flush_interval_s=0.05,
        **overrides,
    )


async def _run(settings: Settings) -> tuple[Node, asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    ready: asyncio.Future[Node] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_node(settings, stop, ready))
    waits: list[asyncio.Future[Any]] = [ready, task]
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    return ready.result(), stop, task


async def test_a_node_with_default_settings_installs_no_tracer_provider(
    tmp_path: Path, geoip_path: Path
) -> None:
    settings = node_settings(tmp_path, geoip_path)
    assert settings.otel_endpoint is None and not tracing.enabled(settings)
    node, stop, task = await _run(settings)
    try:
        assert tracing.installed() is None
        assert tracing.tracer("anything") is None
        # Nor OpenTelemetry's process-wide one: the API's placeholder is all there is.
        assert isinstance(get_tracer_provider(), ProxyTracerProvider)
        assert node.dns is not None
    finally:
        stop.set()
        await task
    assert tracing.installed() is None


def test_off_the_sdk_is_never_loaded() -> None:
    """A fresh interpreter builds every traced component and configures tracing from default
    settings: the OpenTelemetry SDK and exporter are not imported at all."""
    script = (
        "import sys\n"
        "from gtm import tracing\n"
        "import gtm.node, gtm.front.app, gtm.admin.app, regional_lb.proxy.app, regional_lb.cli\n"
        "from regional_lb import tracing as lb\n"
        "from gtm.settings import Settings\n"
        "assert tracing.configure(Settings()) is None and tracing.installed() is None\n"
        "assert lb.configure('eu-west') is None and lb.tracer('x') is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter')))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_standard_variables_turn_it_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    off = Settings()
    assert not tracing.enabled(off)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.enabled(off)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.enabled(off)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.enabled(off)
    assert not tracing.enabled(Settings(otel_endpoint="http://127.0.0.1:4318"))
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("GTM_OTEL_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.enabled(Settings())


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's trace endpoint, keeping what it is sent."""

    received: ClassVar[list[tuple[str, ExportTraceServiceRequest]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append((self.path, request))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _resource(request: ExportTraceServiceRequest) -> dict[str, str]:
    (spans,) = request.resource_spans
    return {a.key: a.value.string_value for a in spans.resource.attributes}


@pytest.mark.parametrize(
    ("env_name", "setting", "expected"),
    [(None, None, "gtm"), ("from-env", None, "from-env"), ("from-env", "gtm-eu", "gtm-eu")],
)
def test_spans_reach_the_collector_named_by_gtm_otel_endpoint(
    collector: str,
    monkeypatch: pytest.MonkeyPatch,
    env_name: str | None,
    setting: str | None,
    expected: str,
) -> None:
    if env_name is not None:
        monkeypatch.setenv("OTEL_SERVICE_NAME", env_name)
    settings = Settings(node_id="n1", otel_endpoint=collector, otel_service_name=setting)
    provider = tracing.configure(settings)
    assert provider is not None
    try:
        assert tracing.installed() is provider
        tracer = tracing.tracer("gtm.test")
        assert tracer is not None
        with tracer.start_as_current_span("proxy chat"):
            pass
    finally:
        tracing.shutdown()  # flushes the batch to the collector
    assert tracing.installed() is None
    ((path, request),) = Collector.received
    assert path == "/v1/traces"
    resource = _resource(request)
    assert resource["service.name"] == expected
    assert resource["service.instance.id"] == "n1"
    (scope,) = request.resource_spans[0].scope_spans
    assert [s.name for s in scope.spans] == ["proxy chat"]


def test_a_sample_ratio_of_zero_records_nothing(collector: str) -> None:
    provider = tracing.configure(Settings(otel_endpoint=collector, otel_sample_ratio=0.0))
    assert provider is not None
    try:
        tracer = tracing.tracer("gtm.test")
        assert tracer is not None
        with tracer.start_as_current_span("proxy chat") as span:
            assert not span.is_recording()
    finally:
        tracing.shutdown()
    assert Collector.received == []


async def test_answering_dns_creates_no_spans(
    tmp_path: Path, geoip_path: Path, spans: Spans
) -> None:
    node, stop, task = await _run(node_settings(tmp_path, geoip_path))
    try:
        assert tracing.installed() is not None  # tracing is on: the test's in-memory provider
        assert node.dns is not None
        host, port = node.dns.bound[0]
        for name in ("chat.gtm.example.", "chat.eu.gtm.example.", "nowhere.gtm.example."):
            query = dns.message.make_query(name, "A")
            udp = await dns.asyncquery.udp(query, host, port=port, timeout=3)
            tcp = await dns.asyncquery.tcp(query, host, port=port, timeout=3)
            assert udp.rcode() == tcp.rcode()
        assert node.dns_stats.queries  # answered
    finally:
        stop.set()
        await task
    assert spans.finished == ()
