"""Prometheus metrics of the HTTP front.

The request path keeps plain integer counters (a dictionary increment) and a collector turns
them into metric families at scrape time: a labelled prometheus_client counter costs a lock and
a label lookup per increment, several times what the rest of a redirect's bookkeeping does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

if TYPE_CHECKING:
    from gtm.front.affinity import Affinity
    from gtm.front.connections import ConnectionBudget
    from gtm.front.tls import TlsContexts


class FrontStats:
    """Responses by status code, and redirect decisions made afresh, for one front app."""

    def __init__(self) -> None:
        self.responses: dict[int, int] = {}
        self.ops = 0
        # Redirects decided afresh rather than given from the answer cache (its misses).
        self.decided = 0
        # Set by the server that serves the app (gtm.front.server).
        self.connections: ConnectionBudget | None = None
        self.tls: TlsContexts | None = None
        self.affinity: Affinity | None = None  # set by the app when proxied sessions are kept
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
        yield from _connection_metrics(list(_LIVE))
        yield _affinity_metric(list(_LIVE))


def _affinity_metric(live: list[FrontStats]) -> Metric:
    family = CounterMetricFamily(
        "gtm_front_affinity",
        "Proxied requests by what became of their session (label outcome): new (no cookie), "
        "same (its region was the fresh choice), kept (kept in its region over the fresh "
        "choice), moved for no_headroom, unhealthy or disallowed, or its cookie ignored as "
        "forged, expired or mismatch (issued for another service, class, tenant or country)",
        labels=["outcome"],
    )
    totals: dict[str, int] = {}
    for stats in live:
        if stats.affinity is not None:
            for verdict, n in stats.affinity.counts.items():
                totals[verdict.value] = totals.get(verdict.value, 0) + n
    for label, n in sorted(totals.items()):
        family.add_metric([label], n)
    return family


def _connection_metrics(live: list[FrontStats]) -> Iterator[Metric]:
    open_ = GaugeMetricFamily("gtm_front_connections_open", "Open HTTP front connections")
    refused = CounterMetricFamily(
        "gtm_front_connections_refused",
        "Connections closed on arrival: over the front's cap, or over the client's",
        labels=["reason"],
    )
    timeouts = CounterMetricFamily(
        "gtm_front_head_timeouts",
        "Connections closed because a request head did not arrive whole in time",
    )
    body_timeouts = CounterMetricFamily(
        "gtm_front_body_timeouts",
        "Requests cut because their body stalled or arrived below the minimum rate",
    )
    reloads = CounterMetricFamily("gtm_front_tls_reloads", "TLS certificate reloads")
    failures = CounterMetricFamily(
        "gtm_front_tls_reload_failures", "Changed TLS files that did not load (the last good stay)"
    )
    n_open = n_timeouts = n_body_timeouts = n_reloads = n_failures = 0
    by_reason: dict[str, int] = {}
    for stats in live:
        budget, tls = stats.connections, stats.tls
        if budget is not None:
            n_open += budget.open
            n_timeouts += budget.head_timeouts
            n_body_timeouts += budget.body_timeouts
            for reason, n in budget.refused.items():
                by_reason[reason.value] = by_reason.get(reason.value, 0) + n
        if tls is not None:
            n_reloads += tls.reloads
            n_failures += tls.failures
    open_.add_metric([], n_open)
    for label, n in sorted(by_reason.items()):
        refused.add_metric([label], n)
    timeouts.add_metric([], n_timeouts)
    body_timeouts.add_metric([], n_body_timeouts)
    reloads.add_metric([], n_reloads)
    failures.add_metric([], n_failures)
    yield from (open_, refused, timeouts, body_timeouts, reloads, failures)


REGISTRY.register(_FrontCollector())
