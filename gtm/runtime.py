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
from gtm.errors import ConfigError, GeoIPError
from gtm.geoip import GeoDatabase, GeoIPSource, default_database_path
from gtm.policy import PolicySet, load_policy
from gtm.settings import Settings
from gtm.snapshot import Snapshot, SnapshotStore
from gtm.topology import Topology, load_topology

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
        metrics.SNAPSHOT_VERSION.set(1)

    async def start(self) -> None:
        if self.settings.migrate_on_start:
            await asyncio.to_thread(migrate.upgrade, self.settings.database_url)
        await self.writer.start()
        self._tasks.append(asyncio.create_task(self._poll_geoip(), name="geoip-poll"))
        log.info(
            "gtm.started",
            node=self.settings.node_id,
            snapshot=self.store.current.versions.snapshot,
            policy=self.store.current.versions.policy,
            geoip=self.geoip.current.build,
        )

    async def stop(self) -> None:
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


__all__ = ["ConfigError", "Documents", "GeoIPError", "Runtime", "build_snapshot", "load_documents"]
