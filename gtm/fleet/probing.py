"""Probing regions: each region's readiness/capacity endpoint, on an interval, with jitter.

One asyncio task per region, each probing sequentially: at most one probe in flight per target
by construction, and the task's sleep is the schedule (a due-time heap or APScheduler would add
a second source of truth for what a loop of awaits already expresses). The timeout is shorter
than the interval, jitter keeps many GTM nodes from probing in lockstep. A probe succeeds when
the endpoint answers 200 within the timeout with a report that verifies and says the region can
take work; the report also updates the region's capacity (DESIGN.md "Interfaces").
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import structlog

from gtm import metrics
from gtm.fleet.capacity import CapacityIntake, Rejected
from gtm.fleet.health import TargetHealth, Thresholds, observe
from regional_lb.capacity_report import SIGNATURE_HEADER, CapacityReport

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    ok: bool
    draining: bool
    detail: str
    report: CapacityReport | None
    latency_s: float


class Prober:
    def __init__(
        self,
        targets: dict[str, str],
        intake: CapacityIntake,
        *,
        interval_s: float,
        timeout_s: float,
        jitter: float,
        thresholds: Thresholds,
        on_health: Callable[[str, TargetHealth, TargetHealth], None],
        on_report: Callable[[CapacityReport], object],
        clock: Callable[[], float] = time.time,
    ) -> None:
        if timeout_s >= interval_s:
            raise ValueError("the probe timeout must be shorter than the interval")
        self.targets = targets
        self.intake = intake
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.jitter = jitter
        self.thresholds = thresholds
        self.on_health = on_health
        self.on_report = on_report
        self._clock = clock
        self.health: dict[str, TargetHealth] = {r: TargetHealth() for r in targets}
        self.probes = 0
        self.failures = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        for region in self.targets:
            self._tasks.append(asyncio.create_task(self._loop(region), name=f"probe-{region}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self, region: str) -> None:
        # Start at a random point of the interval: nodes started together do not probe together.
        await asyncio.sleep(random.uniform(0, self.interval_s * self.jitter))
        while True:
            started = time.monotonic()
            outcome = await self.probe(region)
            self._record(region, outcome)
            spread = self.interval_s * self.jitter
            pause = self.interval_s + random.uniform(-spread, spread) - (time.monotonic() - started)
            await asyncio.sleep(max(0.0, pause))

    async def probe(self, region: str) -> ProbeOutcome:
        assert self._client is not None
        started = time.monotonic()
        try:
            response = await self._client.get(self.targets[region])
        except httpx.HTTPError as exc:
            return ProbeOutcome(
                False, False, f"{type(exc).__name__}", None, time.monotonic() - started
            )
        latency = time.monotonic() - started
        result = self.intake.accept(
            response.content, response.headers.get(SIGNATURE_HEADER), self._clock()
        )
        if isinstance(result, Rejected):
            # Not newer than what a push already delivered: the region answered, judge it by
            # its status alone. Anything else (forged, malformed, stale) is a failed probe.
            if result.reason == "replayed or out-of-order report":
                return ProbeOutcome(
                    response.status_code == 200, False, "report not newer", None, latency
                )
            return ProbeOutcome(False, False, result.reason, None, latency)
        if result.draining:
            # It answered, and says it is draining: that is its state, not a failure.
            return ProbeOutcome(True, True, "draining", result, latency)
        ok = response.status_code == 200 and result.can_take_work
        detail = (
            "ok" if ok else f"HTTP {response.status_code}, can_take_work={result.can_take_work}"
        )
        return ProbeOutcome(ok, result.draining, detail, result, latency)

    def _record(self, region: str, outcome: ProbeOutcome) -> None:
        self.probes += 1
        if not outcome.ok:
            self.failures += 1
            metrics.PROBE_FAILURES.labels(region).inc()
        if outcome.report is not None or outcome.ok:
            metrics.PROBE_LATENCY.labels(region).observe(outcome.latency_s)
        if outcome.report is not None:
            self.on_report(outcome.report)
        before = self.health[region]
        after = observe(
            before, outcome.ok, outcome.draining, self._clock(), self.thresholds, outcome.detail
        )
        self.health[region] = after
        if after.state is not before.state:
            log.info(
                "region.state_changed",
                region=region,
                state=after.state.value,
                previous=before.state.value,
                detail=outcome.detail,
            )
            self.on_health(region, before, after)
