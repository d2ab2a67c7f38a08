"""One GTM node's moving parts: the snapshot store, GeoIP reloading, the audit writer, region
probing and capacity intake, and the sync of region state and documents with the fleet.

``gtm serve`` starts a :class:`Runtime` and puts its listeners on top; tests and the demo use
it the same way. Loading is all-or-nothing: a bad topology, policy or GeoIP file stops the
start with every reason, before anything listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gtm import metrics
from gtm.answer_labels import AnswersByJurisdiction
from gtm.audit import migrate
from gtm.audit.anchor import Anchor, read_store_id
from gtm.audit.checkpoints import open_sink
from gtm.audit.database import is_sqlite, make_async_engine
from gtm.audit.keys import KEY_NAME, load_or_create
from gtm.audit.record import AuditRecord
from gtm.audit.spool import Spool
from gtm.audit.writer import AuditWriter, queued_rows
from gtm.control.log import ControlLog
from gtm.decision import memos
from gtm.decision.bundle import Documents, load_documents, parse_documents
from gtm.decision.geoip import GeoDatabase, GeoIPSource, default_database_path, memo_entries
from gtm.decision.memos import MemoLimits
from gtm.decision.routing import spill_share
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot, SnapshotStore, next_capacity
from gtm.decision.topology import Topology
from gtm.errors import ConfigError
from gtm.failures import Failures
from gtm.fleet import roster, shared_state
from gtm.fleet.capacity import CapacityIntake
from gtm.fleet.health import TargetHealth, Thresholds
from gtm.fleet.local_documents import Accepted, read_accepted, review, write_accepted
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
from gtm.fleet.signed_documents import Untrusted, load_public_keys
from gtm.fleet.state_sync import StateSync
from gtm.settings import Settings
from regional_lb.capacity_report import CapacityReport

log = structlog.get_logger(__name__)


def documents_from_published(published: Published) -> Documents:
    """Documents published through the shared database, validated like files."""
    return parse_documents(
        published.topology, published.policies, f"published documents #{published.id}"
    )


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
        docs = load_documents(settings.config, settings.policies)
        # Signed versions (gtm.fleet.signed_documents): the keys trusted, and the version this
        # node accepted before it restarted, from its own disk and verified again: it answers
        # from that, not from its files, until the database offers something newer.
        self.document_keys = load_public_keys(settings.document_keys)
        self.accepted: Accepted | None = None
        docs = self._accepted_from_disk(docs)
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
            db_timeout_s=settings.database_silence_s or 3600.0,
        )
        # The sink outside the database: a directory, or a write-once bucket (ConfigError here
        # for loose credentials, and at start for a bucket without Object Lock).
        self.checkpoint_sink = open_sink(settings)
        self.anchor = Anchor(
            self.engine,
            self.writer,
            self.spool,
            self.checkpoint_sink,
            interval_s=settings.audit_checkpoint_interval_s,
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
        self.marks = MarkSync(self.engine, settings.observer_id or settings.node_id, self.intake)
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
            self.engine,
            self.book,
            interval_s=settings.state_sync_interval_s,
            own_observations=self._own_observations,
            on_compose=self._apply_composed,
            on_documents=self._apply_documents,
            own_status=self._own_status,
            # The node's own view of the control log (overrides), its mark on its own disk.
            control=ControlLog(
                self.document_keys,
                mark=settings.spool_dir.parent
                / "state"
                / f"{settings.spool_dir.name}-control-log.node.json",
            ),
        )
        # The sequence of the signed version in force (None while the node answers from its
        # own files: no signed version exists, here or in the database).
        self.document_sequence: int | None = (
            None if self.accepted is None else self.accepted.sequence
        )
        # The sequence alone, also kept on disk (and all a node upgraded from before the copy
        # has): when the copy cannot be used, no older version comes into force.
        self._sequence_file = settings.spool_dir / "documents-in-force"
        self._sequence_floor = _read_sequence(self._sequence_file)
        # The newest valid sequence the database has offered, and whether it is refused for
        # being behind this node's ("behind") or forking from it ("fork").
        self._database_head: int | None = None
        self._diverged: str | None = None
        self._documents_reviewed = False  # the first review sees every row: history is no alarm
        metrics.DOCUMENT_SEQUENCE.set(self.document_sequence or 0)
        metrics.DOCUMENTS_DIVERGED.set(0)
        metrics.STATE_SYNC_AGE.set_function(lambda: self.sync.age_s)
        metrics.SNAPSHOT_VERSION.set(1)

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
        self._check_database_head()  # a database emptied of documents offers no row at all
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

    async def _sync_marks(self) -> None:
        while True:
            await asyncio.sleep(self.settings.state_sync_interval_s)
            try:
                await self.marks.sync()
            except (SQLAlchemyError, OSError) as exc:
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
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.writer.stop()
        await self.anchor.stop()
        await self.engine.dispose()
        if self.writer_engine is not self.engine:
            await self.writer_engine.dispose()
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
            self.document_sequence,
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

    def _must_exceed(self) -> int | None:
        """The sequence a published version must be above: the one in force, or, until one is,
        one below what this node had before it restarted (that version may come back)."""
        if self.document_sequence is not None:
            return self.document_sequence
        return None if self._sequence_floor is None else self._sequence_floor - 1

    def _accepted_from_disk(self, files: Documents) -> Documents:
        """The documents to start with: the signed version this node accepted before, when its
        copy verifies again; else its files."""
        path = self.settings.document_state_path
        try:
            accepted = read_accepted(path, self.document_keys, self.settings.policy_approvals)
        except Untrusted as exc:
            metrics.DOCUMENTS_REFUSED.labels(exc.reason).inc()
            log.error(
                "documents.local_copy_refused",
                path=str(path),
                reason=exc.reason,
                detail=exc.detail,
            )
            return files
        if accepted is None:
            return files
        try:
            docs = parse_documents(accepted.topology, accepted.policies, f"{path}")
        except ConfigError as exc:
            metrics.DOCUMENTS_REFUSED.labels("invalid").inc()
            log.error(
                "documents.local_copy_rejected",
                path=str(path),
                problems=[str(p) for p in exc.problems],
            )
            return files
        self.accepted = accepted
        log.info(
            "documents.local_copy",
            path=str(path),
            sequence=accepted.sequence,
            version=accepted.manifest.version,
            policy=docs.policy.version,
        )
        return docs

    def _refuse(self, published: Published, reason: str, detail: str) -> None:
        # Whatever the database says, an unapproved, unsigned, replayed or forked version never
        # moves traffic here (DESIGN.md rule 6): the version in force stays.
        metrics.DOCUMENTS_REFUSED.labels(reason).inc()
        log.error("documents.refused", id=published.id, reason=reason, detail=detail)

    def _apply_documents(self, rows: list[Published]) -> None:
        """Put in force the signed version with the highest sequence among ``rows``, if it is
        above the one in force; refuse, and say why, every row that does not verify (whatever it
        holds: this never raises for a row), and say loudly when the database is behind this
        node's version or forks from it."""
        first = not self._documents_reviewed
        self._documents_reviewed = True
        result = review(rows, self.document_keys, self.settings.policy_approvals)
        for published, exc in result.refused:
            self._refuse(published, exc.reason, exc.detail)
        held = self.accepted
        threshold = self._must_exceed()
        newer: list[tuple[Accepted, Published]] = []
        for accepted, published in result.valid:
            sequence = accepted.sequence
            self._database_head = max(sequence, self._database_head or sequence)
            if held is not None and sequence == held.sequence:
                if accepted.manifest_hash != held.manifest_hash:
                    detail = (
                        f"sequence {sequence} signed again as {accepted.manifest_hash[:16]}, "
                        f"not the {held.manifest_hash[:16]} in force"
                    )
                    self._refuse(published, "fork", detail)
                    self._diverge("fork", detail)
            elif threshold is None or sequence > threshold:
                newer.append((accepted, published))
            elif not first:
                # A new row with an old, validly signed version: a copy, or rows renumbered by a
                # restore or a failover. It never comes into force (it is not after the one in
                # force), and it is no alarm: its signature proves it is an activation the
                # fleet made, so it can only be old. Rows that do not verify are the alarm.
                # (At the first look every row is offered; the older ones are history.)
                metrics.DOCUMENTS_SUPERSEDED.inc()
                log.info(
                    "documents.superseded",
                    id=published.id,
                    sequence=sequence,
                    in_force=threshold,
                )
        for accepted, published in newer:  # highest sequence first
            if self._put_in_force(accepted, published):
                break
        self._check_database_head()

    def _put_in_force(self, accepted: Accepted, published: Published) -> bool:
        try:
            docs = documents_from_published(published)
        except ConfigError as exc:
            # The admin service validated them; a node that still cannot (an older version)
            # keeps what it has and says why, rather than answering from half a configuration.
            metrics.DOCUMENTS_REFUSED.labels("invalid").inc()
            log.error(
                "documents.rejected",
                id=published.id,
                problems=[str(p) for p in exc.problems],
            )
            return False
        manifest = accepted.manifest
        self.accepted = accepted
        self.document_sequence = manifest.sequence
        try:
            write_accepted(self.settings.document_state_path, accepted)
            _write_sequence(self._sequence_file, manifest.sequence)
        except OSError as exc:
            # In force all the same: the database offered it and it verified. A restart before
            # the disk is back starts from the database (or the previous copy) again.
            log.error(
                "documents.local_copy_not_written",
                path=str(self.settings.document_state_path),
                error=str(exc),
            )
        metrics.DOCUMENT_SEQUENCE.set(manifest.sequence)
        if self._diverged is not None:
            self._undiverge(f"sequence {manifest.sequence} put in force")
        current = self.store.current
        if (
            docs.topology.fingerprint() == current.topology.fingerprint()
            and docs.policy.version == current.policy.version
        ):
            return True
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
        return True

    def _check_database_head(self) -> None:
        """Once the database has been read: refuse it loudly when its newest valid signed
        version is below the one this node holds (rows deleted or edited: a rollback)."""
        held = self.document_sequence if self.accepted is not None else self._sequence_floor
        if held is None or self.sync.last_ok is None:
            return
        head = self._database_head
        if head is not None and head >= held:
            if self._diverged == "behind":
                self._undiverge(f"the database offers sequence {head} again")
            return
        self._diverge(
            "behind",
            f"the database's newest valid signed version is {head if head is not None else 'none'}"
            f", below the {held} this node accepted",
        )

    def _diverge(self, kind: str, detail: str) -> None:
        if self._diverged == kind:
            return  # one error per episode, not one per sync
        self._diverged = kind
        metrics.DOCUMENTS_DIVERGED.set(1)
        metrics.DOCUMENTS_ROLLBACK_REFUSED.labels(kind).inc()
        log.error(
            "documents.database_refused",
            kind=kind,
            detail=detail,
            serving=self.document_sequence,
            policy=self.store.current.versions.policy,
        )

    def _undiverge(self, detail: str) -> None:
        log.warning("documents.database_agrees", was=self._diverged, detail=detail)
        self._diverged = None
        metrics.DOCUMENTS_DIVERGED.set(0)

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


def _read_sequence(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _write_sequence(path: Path, sequence: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{sequence}\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _routing_view(health: Mapping[str, RegionHealth]) -> dict[str, tuple[HealthState, float]]:
    """What routing reads of region health; details alone do not warrant a new snapshot."""
    return {r: (h.state, h.admitted) for r, h in health.items()}
