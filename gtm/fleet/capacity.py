"""Capacity reports from regional balancers: authenticity, order and freshness.

A report is accepted when its HMAC signature verifies with *its own region's* key (derived from
the fleet's report secret: :func:`regional_lb.capacity_report.region_secret`, so one region's
balancer cannot sign for another), its region is in the topology, every number is finite, it is
fresh (not older than the staleness limit, not from the future beyond a small clock skew) and it
is newer than the last report of its region this node accepted: ``(ts, seq)`` must increase,
which rejects replays and reordering yet accepts a restarted balancer whose sequence starts
again at 1. It must also be no older than the newest report of its region any node of the fleet
accepted (``fleet``; the same report pushed to every node is accepted by each). Both marks are
kept in the shared database (:mod:`gtm.fleet.report_marks`), so a report captured and replayed
after a restart, or to another node, is refused.

Unsigned reports are refused unless the explicitly insecure development setting is on.
Pure apart from the marks it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from regional_lb.capacity_report import CapacityReport, region_secret, verify

Mark = tuple[float, int]  # (ts, seq) of a region's newest accepted report

CLOCK_SKEW_S = 2.0


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str


class CapacityIntake:
    def __init__(
        self,
        secret: bytes | None,
        regions: set[str],
        stale_after_s: float,
        *,
        insecure_unsigned: bool = False,
    ) -> None:
        self.secret = secret  # the fleet's: each region's key is derived from it
        self.insecure_unsigned = insecure_unsigned and secret is None
        self.regions = regions
        self.stale_after_s = stale_after_s
        self._last: dict[str, Mark] = {}  # this node's
        self.fleet: dict[str, Mark] = {}  # the fleet's newest, as last read from the database
        self.rejected = 0

    def own_marks(self) -> dict[str, Mark]:
        return dict(self._last)

    def remember(self, own: dict[str, Mark], fleet: dict[str, Mark]) -> None:
        """Marks read back from the database (at start, and as the fleet moves)."""
        for region, mark in own.items():
            self._last[region] = max(mark, self._last.get(region, mark))
        for region, mark in fleet.items():
            self.fleet[region] = max(mark, self.fleet.get(region, mark))

    def accept(self, body: bytes, signature: str | None, now: float) -> CapacityReport | Rejected:
        result = self._check(body, signature, now)
        if isinstance(result, Rejected):
            self.rejected += 1
        return result

    def _check(self, body: bytes, signature: str | None, now: float) -> CapacityReport | Rejected:
        if self.secret is None and not self.insecure_unsigned:
            return Rejected("signature cannot be checked: GTM_REPORT_SECRET is unset")
        try:
            report = CapacityReport.model_validate_json(body)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
            )
            return Rejected(f"not a capacity report: {problems}")
        if report.region not in self.regions:
            return Rejected(f"unknown region {report.region!r}")
        key = None if self.secret is None else region_secret(self.secret, report.region)
        if key is not None and (signature is None or not verify(body, signature, key)):
            # Verified with the key of the region the report names: another region's
            # balancer's valid signature does not verify here.
            return Rejected(f"signature missing or invalid for region {report.region}")
        if report.ts > now + CLOCK_SKEW_S:
            return Rejected("report from the future (clock skew?)")
        if now - report.ts > self.stale_after_s:
            return Rejected("stale report")
        mark = (report.ts, report.seq)
        last = self._last.get(report.region)
        if last is not None and mark <= last:
            return Rejected("replayed or out-of-order report")
        newest = self.fleet.get(report.region)
        if newest is not None and mark < newest:
            return Rejected("replayed or out-of-order report (older than the fleet's newest)")
        self._last[report.region] = mark
        self.fleet[report.region] = max(mark, newest or mark)
        return report
