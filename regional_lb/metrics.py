"""Prometheus metrics of one balancer (their own registry, so several can share a process)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regional_lb.balancing.cost import ModelCoefficients
from regional_lb.balancing.instance import InstanceState

# The pick runs in microseconds; the buckets must resolve that range.
PICK_BUCKETS = (5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3)
# What the hop adds is budgeted at 1 ms (p99); resolve the range around it.
OVERHEAD_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


def utilisation(inst: InstanceState) -> float:
    return inst.in_flight / inst.max_concurrency if inst.max_concurrency else 0.0


def utilisation_cv(pool: Sequence[InstanceState]) -> float:
    values = [utilisation(i) for i in pool if i.healthy and not i.draining]
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


class _PoolCollector(Collector):
    def __init__(
        self,
        pool: Callable[[], Sequence[InstanceState]],
        depth: Callable[[], dict[str, int]],
        coefficients: Callable[[], Mapping[str, ModelCoefficients]],
        region_utilisation: Callable[[], float] | None,
    ) -> None:
        self.pool, self.depth = pool, depth
        self.coefficients, self.region_utilisation = coefficients, region_utilisation

    def collect(self) -> Iterable[Metric]:
        insts = self.pool()
        work = GaugeMetricFamily(
            "regional_lb_outstanding_work", "Cost units in flight", labels=["instance"]
        )
        flights = GaugeMetricFamily(
            "regional_lb_in_flight", "Requests in flight", labels=["instance"]
        )
        util = GaugeMetricFamily(
            "regional_lb_utilisation", "In flight / concurrency limit", labels=["instance"]
        )
        speed = GaugeMetricFamily(
            "regional_lb_speed", "Learned speed (cost units/s)", labels=["instance"]
        )
        for i in insts:
            work.add_metric([i.id], i.outstanding)
            flights.add_metric([i.id], i.in_flight)
            util.add_metric([i.id], utilisation(i))
            speed.add_metric([i.id], i.speed.speed)
        yield from (work, flights, util, speed)
        yield GaugeMetricFamily(
            "regional_lb_utilisation_cv",
            "Coefficient of variation of utilisation across instances",
            value=utilisation_cv(insts),
        )
        depth = GaugeMetricFamily(
            "regional_lb_queue_depth", "Requests waiting per tier", labels=["tier"]
        )
        for tier, n in self.depth().items():
            depth.add_metric([tier], n)
        yield depth
        coef = GaugeMetricFamily(
            "regional_lb_cost_coefficient",
            "Cost coefficients in use, learned from completed streams (reference-GPU seconds)",
            labels=["model", "term"],
        )
        for model, c in sorted(self.coefficients().items()):
            coef.add_metric([model, "overhead"], c.overhead)
            coef.add_metric([model, "prefill_per_token"], c.prefill_per_token)
            coef.add_metric([model, "decode_per_token"], c.decode_per_token)
        yield coef
        if self.region_utilisation is not None:
            yield GaugeMetricFamily(
                "regional_lb_region_utilisation",
                "Utilisation as in the capacity report (above 1: work is queued)",
                value=self.region_utilisation(),
            )


class BalancerMetrics:
    def __init__(
        self,
        pool: Callable[[], Sequence[InstanceState]],
        depth: Callable[[], dict[str, int]],
        coefficients: Callable[[], Mapping[str, ModelCoefficients]] = dict,
        region_utilisation: Callable[[], float] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pick_seconds = Histogram(
            "regional_lb_pick_seconds", "Routing decision latency", buckets=PICK_BUCKETS, registry=r
        )
        self.overhead_seconds = Histogram(
            "regional_lb_proxy_overhead_seconds",
            "Time a unary request answered by its instance (not 5xx) spends in the balancer "
            "outside the instance's own exchange: reading and checking it, any wait in the "
            "admission queue, the pick, writing the answer back",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "regional_lb_requests", "Requests by outcome", ["outcome"], registry=r
        )
        self.rejected = Counter(
            "regional_lb_rejected", "429s and 503s", ["status", "reason"], registry=r
        )
        self.ejections = Counter(
            "regional_lb_ejections", "Outlier ejections", ["instance"], registry=r
        )
        self.upstream_failures = Counter(
            "regional_lb_upstream_failures",
            "5xx, timeouts, stalls and broken streams",
            ["instance", "kind"],
            registry=r,
        )
        # Reasons are a bounded set: ok, timeout, timeout_busy, connect, transport,
        # invalid_body and http_<status>.
        self.health_changes = Counter(
            "regional_lb_health_changes",
            "Instance health changes by the state entered and the probe's reason",
            ["instance", "healthy", "reason"],
            registry=r,
        )
        self.probe_failures = Counter(
            "regional_lb_probe_failures",
            "Failed readiness probes (readiness), model listings (models) and metrics scrapes "
            "(metrics), by reason",
            ["instance", "probe", "reason"],
            registry=r,
        )
        self.report_push = Counter(
            "regional_lb_report_push", "Capacity report pushes", ["result"], registry=r
        )
        r.register(_PoolCollector(pool, depth, coefficients, region_utilisation))
