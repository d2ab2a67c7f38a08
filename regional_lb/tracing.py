"""OpenTelemetry traces of the balancer's requests: off by default.

On when an OTLP/HTTP collector is named: ``REGIONAL_LB_OTEL_ENDPOINT`` (its base URL, e.g.
``http://collector:4318``; ``/v1/traces`` is appended as the standard variable does), or the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``;
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keep it off. The SDK reads the
other standard variables itself; ``REGIONAL_LB_OTEL_SERVICE_NAME`` and
``REGIONAL_LB_OTEL_SAMPLE_RATIO`` win over ``OTEL_SERVICE_NAME`` and ``OTEL_TRACES_SAMPLER``.

A request is a server span that continues the W3C trace context it came with (the global
front's, in proxy mode; the decision id the front sends in ``X-GTM-Decision-Id`` is an
attribute), with a child span for the pick (tier, estimated cost, queue wait, instance) and
one for the call to the instance, whose ``traceparent`` the instance receives. Off, the
balancer holds no tracer and its request path takes the untraced branch, nothing more.

The provider is this module's, not OpenTelemetry's process-wide one (settable once per
process): tests install an SDK provider with an in-memory exporter through :func:`use`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from regional_lb.errors import ConfigError
from regional_lb.protocol.asgi import Scope

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

DEFAULT_SERVICE_NAME = "regional-lb"
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None


class TracingSettings(BaseSettings):
    """``REGIONAL_LB_OTEL_*``, and the standard variables that decide whether tracing is on."""

    model_config = SettingsConfigDict(env_prefix="REGIONAL_LB_OTEL_", extra="ignore", frozen=True)

    endpoint: str | None = Field(default=None, pattern=r"^https?://")
    service_name: str | None = Field(default=None, min_length=1)
    sample_ratio: float | None = Field(default=None, ge=0, le=1)


class OtelEnvironment(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OTEL_", extra="ignore", frozen=True)

    sdk_disabled: bool = False
    traces_exporter: str = "otlp"
    exporter_otlp_endpoint: str | None = None
    exporter_otlp_traces_endpoint: str | None = None


def from_environment() -> TracingSettings:
    """``REGIONAL_LB_OTEL_*``; :class:`ConfigError` naming each bad variable."""
    try:
        return TracingSettings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = "REGIONAL_LB_OTEL_" + "_".join(str(part) for part in error["loc"]).upper()
            problems.append(f"{name}: {error['msg']}")
        raise ConfigError(problems) from None


def enabled(settings: TracingSettings, env: OtelEnvironment | None = None) -> bool:
    env = OtelEnvironment() if env is None else env
    if env.sdk_disabled or env.traces_exporter.strip().lower() == "none":
        return False
    return bool(
        settings.endpoint or env.exporter_otlp_traces_endpoint or env.exporter_otlp_endpoint
    )


def build_provider(settings: TracingSettings, region: str) -> SdkTracerProvider:
    """An SDK provider exporting over OTLP/HTTP in batches, from a background thread."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"gtm.region": region})
    if settings.service_name:
        resource = resource.merge(Resource({SERVICE_NAME: settings.service_name}))
    elif str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    # Parent-based: what the front sampled is sampled here, what it did not is not.
    sampler = (
        None
        if settings.sample_ratio is None
        else ParentBased(TraceIdRatioBased(settings.sample_ratio))
    )
    endpoint = settings.endpoint
    exporter = OTLPSpanExporter(
        endpoint=None if endpoint is None else endpoint.rstrip("/") + "/v1/traces"
    )
    provider = SdkProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure(region: str, settings: TracingSettings | None = None) -> SdkTracerProvider | None:
    """Install a provider when tracing is configured; None (nothing installed) when not."""
    settings = TracingSettings() if settings is None else settings
    if not enabled(settings):
        return None
    provider = build_provider(settings, region)
    use(provider)
    return provider


def use(provider: TracerProvider | None) -> None:
    """Make ``provider`` the one balancers built from now on use (None: tracing off)."""
    global _provider
    _provider = provider


def shutdown() -> None:
    """Export what is buffered and uninstall."""
    provider = _provider
    use(None)
    stop = getattr(provider, "shutdown", None)  # the API's provider has none
    if stop is not None:
        stop()


def tracer(name: str) -> Tracer | None:
    """The tracer for a component being built, or None while tracing is off."""
    return None if _provider is None else _provider.get_tracer(name)


def incoming(scope: Scope) -> Context:
    """The W3C trace context a request came with (an empty context without one)."""
    carrier = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope["headers"]
        if name in _TRACE_HEADERS
    }
    return _PROPAGATOR.extract(carrier)


def traceparent(span: Span) -> list[tuple[bytes, bytes]]:
    """W3C trace context headers that make the instance's spans children of ``span``."""
    context = span.get_span_context()
    headers = [
        (
            b"traceparent",
            b"00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags),
        )
    ]
    if context.trace_state:
        headers.append((b"tracestate", context.trace_state.to_header().encode("latin-1")))
    return headers


__all__ = [
    "OtelEnvironment",
    "TracingSettings",
    "build_provider",
    "configure",
    "enabled",
    "from_environment",
    "incoming",
    "shutdown",
    "traceparent",
    "tracer",
    "use",
]
