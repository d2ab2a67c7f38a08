"""Prometheus metrics of the HTTP front.

The request path keeps plain integer counters (a dictionary increment) and a collector turns
them into metric families at scrape time: a labelled prometheus_client counter costs a lock and
a label lookup per increment, several times what the rest of a redirect's bookkeeping does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector


class FrontStats:
    """Responses by status code, and redirect decisions made afresh, for one front app."""

    def __init__(self) -> None:
        self.responses: dict[int, int] = {}
        self.ops = 0
        # Redirects decided afresh rather than given from the answer cache (its misses).
        self.decided = 0
        _LIVE.add(self)

    def count(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1


_LIVE: weakref.WeakSet[FrontStats] = weakref.WeakSet()


class _FrontCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        responses = CounterMetricFamily(
            "gtm_front_responses", "HTTP front responses to traffic, by status", labels=["status"]
        )
        ops = CounterMetricFamily("gtm_front_ops_requests", "Requests to /livez, /readyz, /metrics")
        decided = CounterMetricFamily(
            "gtm_front_redirect_decisions",
            "Redirect decisions made afresh (answer cache misses); the rest were cached answers",
        )
        totals: dict[int, int] = {}
        ops_total = decided_total = 0
        for stats in list(_LIVE):
            for status, n in stats.responses.items():
                totals[status] = totals.get(status, 0) + n
            ops_total += stats.ops
            decided_total += stats.decided
        for status, n in sorted(totals.items()):
            responses.add_metric([str(status)], n)
        ops.add_metric([], ops_total)
        decided.add_metric([], decided_total)
        yield responses
        yield ops
        yield decided


REGISTRY.register(_FrontCollector())
