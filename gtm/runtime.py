"""One GTM node's moving parts: the snapshot store, GeoIP reloading, the audit writer, region
probing and capacity intake, and the sync of region state and documents with the fleet.

``gtm serve`` starts a :class:`Runtime` and puts its listeners on top; tests and the demo use
it the same way. Loading is all-or-nothing: a bad topology, policy or GeoIP file stops the
start with every reason, before anything listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.exc import SQLAlchemyError

from gtm import metrics
from gtm.answer_labels import AnswersByJurisdiction
from gtm.audit import migrate
from gtm.audit.anchor import Anchor, read_store_id
from gtm.audit.checkpoints import open_sink
from gtm.audit.database import is_sqlite, make_async_engine
from gtm.audit.deadline import EngineSockets
from gtm.audit.keys import KEY_NAME, load_or_create
from gtm.audit.record import AuditRecord
from gtm.audit.rows import queued_rows
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter
from gtm.cancelling import cancel_within, run_bounded
from gtm.control.log import ControlLog
from gtm.decision import memos
from gtm.decision.bundle import Documents, load_documents
from gtm.decision.geoip import GeoDatabase, GeoIPSource, default_database_path, memo_entries
from gtm.decision.memos import MemoLimits
from gtm.decision.routing import spill_share
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot, SnapshotStore, next_capacity
from gtm.decision.topology import Topology
from gtm.errors import ConfigError
from gtm.failures import Failures
from gtm.fleet import roster, shared_state
from gtm.fleet.capacity import CapacityIntake
from gtm.fleet.documents_in_force import DocumentsInForce
from gtm.fleet.health import TargetHealth, Thresholds
from gtm.fleet.local_documents import Accepted
from gtm.fleet.observation_seal import (
    ObservationGate,
    gate_for,
    load_or_create_node_key,
    unlisted_fleet,
)
from gtm.fleet.probing import Prober
from gtm.fleet.region_state import Composed, Observation, RegionBook, RegionEvent
from gtm.fleet.report_marks import MarkSync
from gtm.fleet.shared_state import NodeStatus, Published
from gtm.fleet.state_sync import StateSync, round_bound_s
from gtm.settings import Settings
from regional_lb.capacity_report import CapacityReport

log = structlog.get_logger(__name__)


def geoip_path(settings: Settings) -> Path:
    return settings.geoip_path if settings.geoip_path is not None else default_database_path()


def build_snapshot(settings: Settings, now: float) -> Snapshot:
    docs = load_documents(settings.config, settings.policies)
    geo = GeoDatabase(geoip_path(settings), memo_entries(settings.dns_cache_budget_mb))
    return Snapshot(1, docs.topology, docs.policy, geo, built_at=now)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # The decision core's memos are bounded by shares of the same budget (rule 8).
        memos.bound(MemoLimits.from_mb(settings.dns_cache_budget_mb))
        # Signed versions (gtm.fleet.documents_in_force): the keys trusted, and the version
        # this node accepted before it restarted, from its own disk and verified again: it
        # answers from that, not from its files, until the database offers something newer.
        self.documents = DocumentsInForce(
            settings,
            put=self._documents_put,
            database_read=lambda: self.sync.last_ok is not None,
            serving_policy=lambda: self.store.current.versions.policy,
        )
        docs = self.documents.start_from(load_documents(settings.config, settings.policies))
        self.geoip = GeoIPSource(geoip_path(settings), memo_entries(settings.dns_cache_budget_mb))
        self.store = SnapshotStore(
            Snapshot(1, docs.topology, docs.policy, self.geoip.current, built_at=time.time())
        )
        # Exceptions on the answering paths: counted, logged once per interval (gtm.failures).
        self.failures = Failures(settings.answer_failure_log_interval_s)
        self.engine = make_async_engine(
            settings.database_url,
            silence_s=settings.database_silence_s,
            statement_s=settings.database_statement_timeout_s,
        )
        key_path = settings.audit_signing_key or settings.spool_dir / KEY_NAME
        self.spool = Spool(settings.spool_dir, settings.node_id, load_or_create(key_path))
        # The writer's own connections on PostgreSQL, unpooled: each drain's connection is
        # watched from its first byte (gtm.audit.deadline), never one a pool kept idle
        # through a cut, whose check before use would wait on a silent peer unwatched.
        self.writer_engine = (
            self.engine
            if is_sqlite(settings.database_url)
            else make_async_engine(
                settings.database_url,
                silence_s=settings.database_silence_s,
                statement_s=settings.database_statement_timeout_s,
                pooled=False,
            )
        )
        # The fleet exchanges' own pool on PostgreSQL (state sync, report marks), whose sockets
        # may be shut all at once: a round stuck in a cleanup waiting on a silent peer ends
        # that way (gtm.cancelling.run_bounded), and no other user of the database (the admin
        # API, the anchor) loses a connection by it.
        self.sync_engine = self.engine
        self.sync_sockets: EngineSockets | None = None  # SQLite: a local file, never silent
        if not is_sqlite(settings.database_url):
            self.sync_engine = make_async_engine(
                settings.database_url,
                silence_s=settings.database_silence_s,
                statement_s=settings.database_statement_timeout_s,
            )
            self.sync_sockets = EngineSockets(self.sync_engine)
        # The audit's calls on the database (drains, checkpoints) give up after this long
        # without progress; 0 in the settings: none of the network deadlines, an hour here.
        db_deadline_s = settings.database_silence_s or 3600.0
        self.writer = AuditWriter(
            self.writer_engine,
            settings.node_id,
            self.spool,
            flush_interval=settings.audit_flush_interval_s,
            max_pending=settings.audit_max_pending,
            journal_interval=settings.audit_journal_interval_s,
            spool_max_bytes=settings.audit_spool_max_bytes,
            on_sealed=AnswersByJurisdiction(lambda: self.store.current.policy),
            max_queued_rows=queued_rows(settings.dns_cache_budget_mb),
            db_timeout_s=db_deadline_s,
        )
        # The sink outside the database: a directory, or a write-once bucket (ConfigError here
        # for loose credentials, and at start for a bucket without Object Lock).
        self.checkpoint_sink = open_sink(settings)
        # On the writer's connections: unpooled, so each checkpoint's is watched from its
        # first byte (a pooled one's check before use would wait on a silent peer unwatched).
        self.anchor = Anchor(
            self.writer_engine,
            self.writer,
            self.spool,
            self.checkpoint_sink,
            interval_s=settings.audit_checkpoint_interval_s,
            db_deadline_s=db_deadline_s,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.migrated = True  # False while the schema could not be brought up to date
        topology = docs.topology
        secret = (
            settings.report_secret.get_secret_value().encode() if settings.report_secret else None
        )
        self.intake = CapacityIntake(
            secret,
            {r.id for r in topology.regions},
            topology.routing.spillover.stale_after_s,
            insecure_unsigned=settings.insecure_unsigned_reports,
        )
        self.marks = MarkSync(
            self.sync_engine, settings.observer_id or settings.node_id, self.intake
        )
        self.prober: Prober | None = self._make_prober(topology)
        self.book = RegionBook(
            settings.observer_id or settings.node_id,
            tuple(r.id for r in topology.regions),
            quorum=settings.health_quorum,
            max_age_s=settings.health_observation_max_age_s,
            readmit_window_s=topology.routing.readmit_window_s,
            members=frozenset(settings.health_members),
        )
        # Health from known nodes only (gtm.fleet.observation_seal): this node's own key, and
        # the membership (node -> key) of the topology in force, else of its settings.
        self.node_key = load_or_create_node_key(settings.health_key_path)
        self.book.set_gate(self._health_gate(topology))
        self.sync = StateSync(
            self.sync_engine,
            self.book,
            interval_s=settings.state_sync_interval_s,
            own_observations=self._own_observations,
            on_compose=self._apply_composed,
            on_documents=self.documents.apply,
            own_status=self._own_status,
            cut=self._cut_sync(),
            # The node's own view of the control log (overrides), its mark on its own disk.
            control=ControlLog(
                self.documents.keys,
                mark=settings.spool_dir.parent
                / "state"
                / f"{settings.spool_dir.name}-control-log.node.json",
            ),
        )
        metrics.STATE_SYNC_AGE.set_function(lambda: self.sync.age_s)
        metrics.SNAPSHOT_VERSION.set(1)

    @property
    def document_sequence(self) -> int | None:
        """The sequence of the signed version in force (None: the node's own files)."""
        return self.documents.sequence

    @property
    def document_keys(self) -> dict[str, Ed25519PublicKey]:
        """The trusted document keys by id: a signed version or control-log entry verifies
        under one of them."""
        return self.documents.keys

    async def start(self) -> None:
        if self.settings.migrate_on_start and not await self._migrate():
            # A node must come up and answer while the database is away (it answers from its
            # own files and spools the audit); the schema is brought up to date once it is
            # back, before anything the spool holds can land in it.
            self._tasks.append(asyncio.create_task(self._migrate_when_back(), name="migrate"))
        store = await read_store_id(self.engine) if self.migrated else None
        if store is not None:
            self.spool.bind(store)  # ConfigError: this spool belongs to another store
        else:
            log.warning("audit.store_unchecked", spool_store=self.spool.bound_store())
        await self.writer.start()
        await self.anchor.start()
        self._warn_about_reports()
        try:
            await self.marks.start()
        except (SQLAlchemyError, OSError) as exc:
            log.warning("capacity.marks_unavailable", error=str(exc).splitlines()[0])
        self._tasks.append(asyncio.create_task(self._sync_marks(), name="report-marks"))
        await self._refuse_a_fleet_without_membership()
        await self.sync.start()  # adopts the fleet's published documents before probing starts
        self.documents.check_database_head()  # a database emptied of documents offers no row at all
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

    async def _refuse_a_fleet_without_membership(self) -> None:
        """Several nodes on one database without a membership: refused, before this node
        reports or probes anything (gtm.fleet.observation_seal.unlisted_fleet)."""
        gate, settings = self.book.gate, self.settings
        if gate is None or gate.membership.voters or settings.fleet_standalone_health:
            return
        bound = roster.live_bound_s(settings.node_live_within_s, settings.state_sync_interval_s)
        try:
            reports = await shared_state.read_node_status(self.engine, time.time() - bound)
        except (SQLAlchemyError, OSError) as exc:
            log.warning("fleet.membership_unchecked", error=str(exc).splitlines()[0])
            return
        problem = unlisted_fleet(self.book.node, {r.observer for r in reports})
        if problem is not None:
            await self.stop()
            raise ConfigError([problem])

    def _warn_about_reports(self) -> None:
        if self.settings.report_secret is not None:
            return
        if self.settings.insecure_unsigned_reports:
            log.warning(
                "capacity.INSECURE_UNSIGNED_REPORTS",
                message="GTM_INSECURE_UNSIGNED_REPORTS is on: any host that reaches this node "
                "can move traffic with a made-up capacity report. Development networks only.",
            )
        else:
            log.warning(
                "capacity.reports_refused",
                message="GTM_REPORT_SECRET is unset: every capacity report is refused",
            )

    def _cut_sync(self) -> Callable[[], int] | None:
        return None if self.sync_sockets is None else self.sync_sockets.shut_all

    async def _sync_marks(self) -> None:
        interval = self.settings.state_sync_interval_s
        stuck: asyncio.Task[None] | None = None
        while True:
            await asyncio.sleep(interval)
            if stuck is not None and not stuck.done():
                continue  # a sync that outlived its cut: one at a time
            # Bounded as a state sync round is, and cut past it: a sync stuck on a silent peer
            # would otherwise stay so for good, and the fleet's replay marks with it.
            work = await run_bounded(
                self.marks.sync(),
                within_s=round_bound_s(interval),
                cut=self._cut_sync(),
                name="report-marks-sync",
            )
            if not work.done():
                stuck = work
            elif not work.cancelled() and (exc := work.exception()) is not None:
                if not isinstance(exc, (SQLAlchemyError, OSError)):
                    log.error("capacity.marks_sync_failed", exc_info=exc)
                else:
                    log.debug("capacity.marks_sync_failed", error=str(exc).splitlines()[0])

    async def _migrate(self) -> bool:
        try:
            await asyncio.to_thread(migrate.upgrade, self.settings.database_url)
        except (SQLAlchemyError, OSError) as exc:
            self.migrated = False
            log.error("gtm.database_unavailable", phase="migrate", error=str(exc).split("\n")[0])
            return False
        self.migrated = True
        return True

    async def _migrate_when_back(self, every_s: float = 2.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            if await self._migrate():
                log.info("gtm.database_back", phase="migrate")
                return

    async def stop(self) -> None:
        if self.prober is not None:
            await self.prober.stop()
        await self.sync.stop()
        for task in self._tasks:
            await cancel_within(task)  # bounded: a database call may hang (gtm.cancelling)
        self._tasks.clear()
        await self.writer.stop()
        await self.anchor.stop()
        await self.engine.dispose()
        for own in (self.writer_engine, self.sync_engine):
            if own is not self.engine:
                await own.dispose()
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
            (report.prefix_cache_hit_rate, report.kv_free_fraction, report.kv_free_blocks),
        )
        state = capacity[report.region]
        metrics.REGION_UTILISATION.labels(report.region).set(report.utilisation)
        metrics.REGION_REPORT_TS.labels(report.region).set(report.ts)
        for gauge, value in (
            (metrics.REGION_PREFIX_CACHE_HIT_RATE, report.prefix_cache_hit_rate),
            (metrics.REGION_KV_FREE_FRACTION, report.kv_free_fraction),
        ):
            if value is None:  # the region stopped saying: no stale figure left behind
                with contextlib.suppress(KeyError):
                    gauge.remove(report.region)
            else:
                gauge.labels(report.region).set(value)
        metrics.REGION_SPILL_SHARE.labels(report.region).set(
            spill_share(report.utilisation, spill.low_watermark, spill.max_share)
            if state.spilling
            else 0.0
        )
        return self.swap(capacity=capacity)

    def _make_prober(self, topology: Topology) -> Prober | None:
        settings = self.settings
        targets = {r.id: str(r.probe_url) for r in topology.regions if r.probe_url}
        if not settings.probes or not targets:
            return None
        return Prober(
            targets,
            self.intake,
            interval_s=settings.probe_interval_s,
            timeout_s=settings.probe_timeout_s,
            jitter=settings.probe_jitter,
            thresholds=Thresholds(settings.health_rise, settings.health_fall),
            on_health=self._health_changed,
            on_report=self.apply_report,
        )

    def _own_observations(self, now: float) -> list[Observation]:
        # The prober's tasks keep every target's health current (a probe ends within its
        # timeout), so while it runs its view is fresh as of now.
        if self.prober is None:
            return []
        node = self.book.node
        return [
            self.node_key.seal(Observation(node, region, h.state, h.since, now, h.detail))
            for region, h in self.prober.health.items()
        ]

    def _health_gate(self, topology: Topology) -> ObservationGate:
        settings = self.settings
        return gate_for(
            topology.fleet.members,
            settings.health_members,
            self.book.node,
            self.node_key,
            quorum=settings.health_quorum,
            max_future_s=settings.health_max_future_s,
        )

    def _health_changed(self, region: str, before: TargetHealth, after: TargetHealth) -> None:
        """This node's probes changed their mind: take it into account at once, not at the
        next sync, and record it."""
        now = time.time()
        node = self.book.node
        self.book.observe(Observation(node, region, after.state, after.since, now, after.detail))
        self.sync.queue(
            [RegionEvent(now, node, region, "observed", after.state, before.state, after.detail)]
        )
        self.sync.recompose(now)

    def _apply_composed(self, composed: Composed) -> None:
        current = self.store.current
        changes: dict[str, object] = {}
        fence = self._fence()
        if fence != current.fence:
            changes["fence"] = fence
            metrics.FENCED.set(0 if fence is None else 1)
            if fence is None:
                log.warning("fleet.unfenced", after_s=round(self.sync.age_s, 1))
            else:
                log.error(
                    "fleet.fenced",
                    action=fence,
                    cut_off_s=round(self.sync.age_s, 1),
                    detail="restricted traffic is not answered from a policy the fleet may have "
                    "changed",
                )
        if _routing_view(composed.health) != _routing_view(current.health):
            changes["health"] = composed.health
        if dict(composed.weights) != dict(current.weights):
            changes["weights"] = composed.weights
        if changes:
            self.swap(**changes)
        for region, health in composed.health.items():
            for state in HealthState:
                metrics.REGION_STATE.labels(region, state.value).set(
                    1.0 if health.state is state else 0.0
                )
            metrics.REGION_ADMITTED.labels(region).set(health.admitted)

    def _fence(self) -> str | None:
        """The fence in force: cut off from the fleet longer than the bound, or not."""
        bound = self.settings.fence_after_s
        if bound > 0 and self.sync.age_s > bound:
            return self.settings.fence_action
        return None

    def _own_status(self, now: float) -> NodeStatus:
        current = self.store.current
        versions = current.versions
        spool = self.writer.spool_range()
        return NodeStatus(
            self.settings.node_id,
            self.settings.observer_id or self.settings.node_id,
            now,
            self.documents.sequence,
            versions.snapshot,
            versions.topology,
            versions.policy,
            {
                region: current.health[region].state.value
                if region in current.health
                else "unknown"
                for region in current.regions
            },
            audit_sealed=None if spool is None else spool[1],
            audit_drained=None if spool is None else spool[0],
        )

    def _documents_put(self, docs: Documents, accepted: Accepted, published: Published) -> None:
        """A new signed version in force (gtm.fleet.documents_in_force): the node follows it."""
        manifest = accepted.manifest
        current = self.store.current
        if (
            docs.topology.fingerprint() == current.topology.fingerprint()
            and docs.policy.version == current.policy.version
        ):
            return
        topology = docs.topology
        self.swap(topology=topology, policy=docs.policy)
        self.book.retarget(tuple(r.id for r in topology.regions))
        if topology.fleet != current.topology.fleet:
            self.book.set_gate(self._health_gate(topology))
        self.book.readmit_window_s = topology.routing.readmit_window_s
        self.intake.regions = {r.id for r in topology.regions}
        self.intake.stale_after_s = topology.routing.spillover.stale_after_s
        before = {r.id: r.probe_url for r in current.topology.regions}
        if before != {r.id: r.probe_url for r in topology.regions}:
            self._tasks.append(
                asyncio.get_running_loop().create_task(self._reprobe(topology), name="reprobe")
            )
        log.info(
            "documents.applied",
            id=published.id,
            version=manifest.version,
            sequence=manifest.sequence,
            author=manifest.author,
            approvers=list(manifest.approvers),
            actor=manifest.actor,
            reason=manifest.reason,
            topology=topology.fingerprint(),
            policy=docs.policy.version,
        )

    async def _reprobe(self, topology: Topology) -> None:
        if self.prober is not None:
            await self.prober.stop()
        self.prober = self._make_prober(topology)
        if self.prober is not None:
            await self.prober.start()

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


def _routing_view(health: Mapping[str, RegionHealth]) -> dict[str, tuple[HealthState, float]]:
    """What routing reads of region health; details alone do not warrant a new snapshot."""
    return {r: (h.state, h.admitted) for r, h in health.items()}
