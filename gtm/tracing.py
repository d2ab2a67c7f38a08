"""OpenTelemetry traces of the HTTP front's proxied requests and the admin API: off by default.

Tracing is on when an OTLP/HTTP collector is named: ``GTM_OTEL_ENDPOINT`` (its base URL, e.g.
``http://collector:4318``; ``/v1/traces`` is appended as the standard variable does), or the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``;
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keep it off whatever is set. Once
on, the SDK reads the other standard variables itself (``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``); ``GTM_OTEL_SERVICE_NAME``
and ``GTM_OTEL_SAMPLE_RATIO`` win over ``OTEL_SERVICE_NAME`` and ``OTEL_TRACES_SAMPLER``.

Off, no tracer provider exists: :func:`tracer` returns None, and the traced paths test that
once, when they are built, so a request pays nothing for the feature. The provider is this
module's, not OpenTelemetry's process-wide one (which can be set only once per process): a
test installs an SDK provider with an in-memory exporter through :func:`use` and removes it
again, and several nodes in one process (the tests, the demo) do not fight over it.

What is traced, and what never is: a proxied request is a span at the front (``proxy
SERVICE``, with the decision id, region and policy version) with a client span per attempt,
whose W3C ``traceparent`` the regional balancer continues. A trace context the client sent
is linked, never adopted: the front is the edge, and a client must not choose our trace ids
or sampling. DNS answers and cached redirects are never traced: a span per query would cost
more than the answer (DESIGN.md rule 3), and the audit store already accounts for each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Tracer, TracerProvider, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gtm.errors import ConfigError, Problem
from gtm.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

DEFAULT_SERVICE_NAME = "gtm"
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
_PROPAGATOR = TraceContextTextMapPropagator()
# An empty context: the parent of a span that starts a trace (the front's requests).
ROOT = Context()
_provider: TracerProvider | None = None


class OtelEnvironment(BaseSettings):
    """The standard variables that decide whether tracing is on (the SDK reads the rest)."""

    model_config = SettingsConfigDict(env_prefix="OTEL_", extra="ignore", frozen=True)

    sdk_disabled: bool = False
    traces_exporter: str = "otlp"
    exporter_otlp_endpoint: str | None = None
    exporter_otlp_traces_endpoint: str | None = None


def enabled(settings: Settings, env: OtelEnvironment | None = None) -> bool:
    env = OtelEnvironment() if env is None else env
    if env.sdk_disabled or env.traces_exporter.strip().lower() == "none":
        return False
    return bool(
        settings.otel_endpoint or env.exporter_otlp_traces_endpoint or env.exporter_otlp_endpoint
    )


def build_provider(settings: Settings) -> SdkTracerProvider:
    """An SDK provider exporting over OTLP/HTTP in batches (a background thread: spans never
    wait on the collector). Imported here, so a node without tracing never loads the SDK."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({SERVICE_INSTANCE_ID: settings.node_id})
    if settings.otel_service_name:
        resource = resource.merge(Resource({SERVICE_NAME: settings.otel_service_name}))
    elif str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    # Parent-based: a request the front did not sample is not sampled further down either, so
    # traces stay whole. Unset, the SDK takes OTEL_TRACES_SAMPLER (default: always on).
    sampler = (
        None
        if settings.otel_sample_ratio is None
        else ParentBased(TraceIdRatioBased(settings.otel_sample_ratio))
    )
    endpoint = settings.otel_endpoint
    exporter = OTLPSpanExporter(
        endpoint=None if endpoint is None else endpoint.rstrip("/") + "/v1/traces"
    )
    provider = SdkProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure(settings: Settings) -> SdkTracerProvider | None:
    """Install a provider when tracing is configured; None (and nothing installed) when not."""
    if not enabled(settings):
        return None
    try:
        provider = build_provider(settings)
    except ValueError as exc:  # an OTEL_* value the SDK refuses outright
        raise ConfigError([Problem("GTM_OTEL_ENDPOINT", "", f"tracing: {exc}")]) from exc
    use(provider)
    return provider


def use(provider: TracerProvider | None) -> None:
    """Make ``provider`` the one traced paths built from now on use (None: tracing off)."""
    global _provider
    _provider = provider


def shutdown() -> None:
    """Export what is buffered and uninstall (a node stopping)."""
    provider = _provider
    use(None)
    # The API's provider has no shutdown; the SDK's flushes its batch processor.
    stop = getattr(provider, "shutdown", None)
    if stop is not None:
        stop()


def installed() -> TracerProvider | None:
    return _provider


def tracer(name: str) -> Tracer | None:
    """The tracer for a component being built, or None while tracing is off."""
    return None if _provider is None else _provider.get_tracer(name)


def traceparent(span: Span) -> list[tuple[bytes, bytes]]:
    """W3C trace context headers (``traceparent``, and ``tracestate`` when there is one) that
    make the next hop's spans children of ``span``."""
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


def client_links(headers: Sequence[tuple[bytes, bytes]]) -> list[Link]:
    """A link to the trace context a client sent, if it sent a valid one (never its parent)."""
    carrier = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in headers
        if name in TRACE_HEADERS
    }
    if "traceparent" not in carrier:
        return []
    context = get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return [Link(context)] if context.is_valid else []


__all__ = [
    "ROOT",
    "TRACE_HEADERS",
    "OtelEnvironment",
    "build_provider",
    "client_links",
    "configure",
    "enabled",
    "installed",
    "shutdown",
    "traceparent",
    "tracer",
    "use",
]
