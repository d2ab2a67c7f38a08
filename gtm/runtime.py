"""One GTM node's moving parts: the snapshot store, GeoIP reloading and the audit writer.

``gtm serve`` starts a :class:`Runtime` and puts its listeners on top; tests and the demo use
it the same way. Loading is all-or-nothing: a bad topology, policy or GeoIP file stops the
start with every reason, before anything listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from gtm import metrics, migrate
from gtm.audit.database import make_async_engine
from gtm.audit.record import AuditRecord
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.capacity import CapacityIntake
from gtm.geoip import GeoDatabase, GeoIPSource, default_database_path
from gtm.health import TargetHealth, Thresholds
from gtm.policy import PolicySet, load_policy
from gtm.probing import Prober
from gtm.settings import Settings
from gtm.snapshot import RegionHealth, Snapshot, SnapshotStore, next_capacity
from gtm.topology import Topology, load_topology
from regional_lb.capacity_report import CapacityReport

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Documents:
    topology: Topology
    policy: PolicySet


def load_documents(config: Path, policies: tuple[Path, ...]) -> Documents:
    """Topology and policy, validated together; :class:`ConfigError` with every problem."""
    topology = load_topology(config)
    return Documents(topology, load_policy(policies, topology))


def geoip_path(settings: Settings) -> Path:
    return settings.geoip_path if settings.geoip_path is not None else default_database_path()


def build_snapshot(settings: Settings, now: float) -> Snapshot:
    docs = load_documents(settings.config, settings.policies)
    return Snapshot(1, docs.topology, docs.policy, GeoDatabase(geoip_path(settings)), built_at=now)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        docs = load_documents(settings.config, settings.policies)
        self.geoip = GeoIPSource(geoip_path(settings))
        self.store = SnapshotStore(
            Snapshot(1, docs.topology, docs.policy, self.geoip.current, built_at=time.time())
        )
        self.engine = make_async_engine(settings.database_url)
        self.writer = AuditWriter(
            self.engine,
            settings.node_id,
            Spool(settings.spool_dir, settings.node_id),
            flush_interval=settings.audit_flush_interval_s,
            max_pending=settings.audit_max_pending,
        )
        self._tasks: list[asyncio.Task[None]] = []
        topology = docs.topology
        secret = (
            settings.report_secret.get_secret_value().encode() if settings.report_secret else None
        )
        self.intake = CapacityIntake(
            secret, {r.id for r in topology.regions}, topology.routing.spillover.stale_after_s
        )
        targets = {r.id: str(r.probe_url) for r in topology.regions if r.probe_url}
        self.prober: Prober | None = None
        if settings.probes and targets:
            self.prober = Prober(
                targets,
                self.intake,
                interval_s=settings.probe_interval_s,
                timeout_s=settings.probe_timeout_s,
                jitter=settings.probe_jitter,
                thresholds=Thresholds(settings.health_rise, settings.health_fall),
                on_health=self._health_changed,
                on_report=self.apply_report,
            )
        metrics.SNAPSHOT_VERSION.set(1)

    async def start(self) -> None:
        if self.settings.migrate_on_start:
            await asyncio.to_thread(migrate.upgrade, self.settings.database_url)
        await self.writer.start()
        self._tasks.append(asyncio.create_task(self._poll_geoip(), name="geoip-poll"))
        if self.prober is not None:
            await self.prober.start()
        log.info(
            "gtm.started",
            node=self.settings.node_id,
            snapshot=self.store.current.versions.snapshot,
            policy=self.store.current.versions.policy,
            geoip=self.geoip.current.build,
        )

    async def stop(self) -> None:
        if self.prober is not None:
            await self.prober.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.writer.stop()
        await self.engine.dispose()
        log.info("gtm.stopped", counted=self.writer.counted)

    def count(self, record: AuditRecord) -> None:
        self.writer.count(record)

    def swap(self, **changes: object) -> Snapshot:
        snapshot = self.store.swap(self.store.current.evolve(time.time(), **changes))
        metrics.SNAPSHOT_VERSION.set(snapshot.version)
        return snapshot

    def apply_report(self, report: CapacityReport) -> Snapshot:
        """Fold an accepted capacity report into a new snapshot."""
        current = self.store.current
        spill = current.topology.routing.spillover
        capacity = dict(current.capacity)
        capacity[report.region] = next_capacity(
            capacity.get(report.region),
            report.utilisation,
            report.ts,
            report.can_take_work and not report.draining,
            spill,
        )
        return self.swap(capacity=capacity)

    def _health_changed(self, region: str, before: TargetHealth, after: TargetHealth) -> None:
        health = dict(self.store.current.health)
        health[region] = RegionHealth(after.state, after.since, after.detail)
        self.swap(health=health)

    async def reload_geoip(self) -> bool:
        """Check the GeoIP file once; swap a new snapshot if it changed and opened cleanly."""
        before = self.geoip.last_error
        fresh = await asyncio.to_thread(self.geoip.poll)
        if fresh is None:
            if self.geoip.last_error and self.geoip.last_error != before:
                metrics.GEOIP_RELOAD_FAILURES.inc()
            return False
        self.swap(geo=fresh)
        return True

    async def _poll_geoip(self) -> None:
        while True:
            await asyncio.sleep(self.settings.geoip_poll_interval_s)
            try:
                await self.reload_geoip()
            except Exception:  # the poller must outlive any single bad read
                log.exception("geoip.poll_failed")
