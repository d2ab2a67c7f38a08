"""Spans kept in memory: an SDK provider that both tiers' traced paths use while a test runs.

Installed through the tiers' own ``use()`` (never OpenTelemetry's process-wide provider, which
can be set once per process), before the front, admin app or balancer under test is built:
each takes its tracer when it is made."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gtm import tracing as gtm_tracing
from regional_lb import tracing as lb_tracing


@dataclass
class Spans:
    exporter: InMemorySpanExporter

    @property
    def finished(self) -> Sequence[ReadableSpan]:
        return self.exporter.get_finished_spans()

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.finished if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        (span,) = self.named(name)
        return span


@contextlib.contextmanager
def in_memory_spans() -> Iterator[Spans]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exported as each span ends
    gtm_tracing.use(provider)
    lb_tracing.use(provider)
    try:
        yield Spans(exporter)
    finally:
        gtm_tracing.use(None)
        lb_tracing.use(None)
        provider.shutdown()
