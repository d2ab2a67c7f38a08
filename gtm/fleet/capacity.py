"""Capacity reports from regional balancers: authenticity, order and freshness.

A report is accepted when its HMAC signature verifies with the shared secret, its region is in
the topology, it is fresh (not older than the staleness limit, not from the future beyond a small
clock skew) and it is newer than the last accepted report of its region: ``(ts, seq)`` must
increase, which rejects replays and reordering yet accepts a restarted balancer whose sequence
starts again at 1. Pure apart from the state it keeps: the last (ts, seq) per region.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from regional_lb.capacity_report import CapacityReport, verify

CLOCK_SKEW_S = 2.0


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str


class CapacityIntake:
    def __init__(self, secret: bytes | None, regions: set[str], stale_after_s: float) -> None:
        self.secret = secret
        self.regions = regions
        self.stale_after_s = stale_after_s
        self._last: dict[str, tuple[float, int]] = {}
        self.rejected = 0

    def accept(self, body: bytes, signature: str | None, now: float) -> CapacityReport | Rejected:
        result = self._check(body, signature, now)
        if isinstance(result, Rejected):
            self.rejected += 1
        return result

    def _check(self, body: bytes, signature: str | None, now: float) -> CapacityReport | Rejected:
        if self.secret is not None and (
            signature is None or not verify(body, signature, self.secret)
        ):
            return Rejected("signature missing or invalid")
        try:
            report = CapacityReport.model_validate_json(body)
        except ValidationError as exc:
            return Rejected(f"not a capacity report: {exc.error_count()} error(s)")
        if report.region not in self.regions:
            return Rejected(f"unknown region {report.region!r}")
        if report.ts > now + CLOCK_SKEW_S:
            return Rejected("report from the future (clock skew?)")
        if now - report.ts > self.stale_after_s:
            return Rejected("stale report")
        last = self._last.get(report.region)
        if last is not None and (report.ts, report.seq) <= last:
            return Rejected("replayed or out-of-order report")
        self._last[report.region] = (report.ts, report.seq)
        return report
