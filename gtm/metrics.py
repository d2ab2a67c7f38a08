"""Prometheus metrics of the global tier, defined once per process (prometheus_client keeps
a global registry; defining them per instance would register twice)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS_COUNTED = Counter(
    "gtm_audit_decisions_counted", "Answers counted towards audit rows", ["channel"]
)
ANSWERS_BY_JURISDICTION = Counter(
    "gtm_answers_by_jurisdiction",
    "Answers counted towards audit rows, by the jurisdiction of the region answered (the "
    "policy's groups; none: no region answered) and residency class (gtm.answer_labels)",
    ["channel", "jurisdiction", "residency_class"],
)
AUDIT_ROWS_WRITTEN = Counter("gtm_audit_rows_written", "Audit rows committed to the database")
AUDIT_FLUSH_FAILURES = Counter(
    "gtm_audit_flush_failures", "Flushes that could not reach the database (rows stay spooled)"
)
AUDIT_SPOOLED_ROWS = Gauge("gtm_audit_spooled_rows", "Audit rows waiting in the local spool")
AUDIT_SPOOL_REJECTED = Counter(
    "gtm_audit_spool_rejected",
    "Spool lines refused at replay: MAC did not verify (altered on disk) or torn by a crash",
)
AUDIT_SPOOL_BYTES = Gauge(
    "gtm_audit_spool_bytes", "Size of the local audit spool (rows waiting for the database)"
)
AUDIT_SPOOL_OVER_CAP = Gauge(
    "gtm_audit_spool_over_cap",
    "1 while the spool is larger than GTM_AUDIT_SPOOL_MAX_BYTES: the database has been away "
    "long enough to need a person (nothing is dropped; the disk is what runs out)",
)
AUDIT_CHECKPOINTS = Counter(
    "gtm_audit_checkpoints", "Signed chain checkpoints written", ["kind", "where"]
)
AUDIT_CHECKPOINT_FAILURES = Counter(
    "gtm_audit_checkpoint_failures",
    "Checkpoints that could not be written (where: sink, outside the database; or database)",
    ["where"],
)
AUDIT_LAST_CHECKPOINT = Gauge(
    "gtm_audit_last_checkpoint_timestamp_seconds",
    "Unix time of this node's last checkpoint written to its sink outside the database",
)
AUDIT_UNCLEAN_STOPS = Counter(
    "gtm_audit_unclean_stops",
    "Starts after an unclean stop (kill -9, power loss): a signed gap checkpoint was written",
)
AUDIT_VERIFIED_THROUGH = Gauge(
    "gtm_audit_verified_through_seconds",
    "Unix time of the newest signed checkpoint through which every chain verified (scheduled "
    "verification, on nodes serving the admin API)",
)
AUDIT_FULL_VERIFIED_AT = Gauge(
    "gtm_audit_full_verified_at_seconds",
    "Unix time the last scheduled verification that read every chain from its start began, "
    "of those that found no break (GTM_AUDIT_VERIFY_FULL_EVERY_S)",
)
AUDIT_VERIFY_FAILURES = Counter(
    "gtm_audit_verify_failures",
    "Scheduled verification passes that found a break, or could not run",
)
AUDIT_VERIFY_BREAKS = Gauge(
    "gtm_audit_verify_breaks", "Breaks the last scheduled verification pass found"
)
AUDIT_VERIFY_PASSES = Counter("gtm_audit_verify_passes", "Scheduled verification passes run")
SNAPSHOT_VERSION = Gauge("gtm_snapshot_version", "Version of the snapshot in force")
GEOIP_RELOAD_FAILURES = Counter(
    "gtm_geoip_reload_failures", "GeoIP files that changed but could not be opened"
)
CAPACITY_REPORTS = Counter(
    "gtm_capacity_reports_pushed", "Capacity reports pushed by regional balancers", ["result"]
)
STATE_SYNC_AGE = Gauge(
    "gtm_state_sync_age_seconds",
    "Seconds since this node last synced region state and documents with the shared database",
)
REGION_STATE = Gauge(
    "gtm_region_state", "Region state in force (1 for the current state)", ["region", "state"]
)
REGION_ADMITTED = Gauge(
    "gtm_region_admitted_share",
    "Share of its clients a region has back while re-admitted",
    ["region"],
)
REGION_UTILISATION = Gauge(
    "gtm_region_utilisation", "Utilisation in the last capacity report", ["region"]
)
REGION_PREFIX_CACHE_HIT_RATE = Gauge(
    "gtm_region_prefix_cache_hit_rate",
    "Prompt tokens found in the region's prefix caches over those looked up (last report)",
    ["region"],
)
REGION_KV_FREE_FRACTION = Gauge(
    "gtm_region_kv_free_fraction",
    "Share of the region's KV cache no running request holds (last report)",
    ["region"],
)
REGION_REPORT_TS = Gauge(
    "gtm_region_report_timestamp_seconds",
    "Unix time of the last accepted capacity report (report age = time() - this)",
    ["region"],
)
REGION_SPILL_SHARE = Gauge(
    "gtm_region_spill_share", "Share of a spilling region's clients sent elsewhere", ["region"]
)
PROBE_LATENCY = Histogram(
    "gtm_probe_latency_seconds",
    "Latency of region probes that got an answer",
    ["region"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
PROBE_FAILURES = Counter("gtm_probe_failures", "Region probes that failed", ["region"])
DOCUMENTS_REFUSED = Counter(
    "gtm_documents_refused",
    "Published documents this node refused because they do not verify or would fork the "
    "version in force (unsigned, bad signature, content mismatch, four-eyes not met, fork, "
    "malformed, invalid): someone wrote them, and GTMDocumentsRefused says so",
    ["reason"],
)
DOCUMENTS_SUPERSEDED = Counter(
    "gtm_documents_superseded",
    "Valid signed versions seen again that are not after the one in force (a copy of an older "
    "row, rows renumbered by a restore or a failover): never put in force, and no alarm, since "
    "a signed version that is not newer changes nothing (the first look at start is history "
    "and not counted)",
)
DOCUMENT_SEQUENCE = Gauge(
    "gtm_document_sequence",
    "Activation sequence of the signed documents in force (0: the node's own files)",
)
ADMIN_AUTH_FAILURES = Counter(
    "gtm_admin_auth_failures",
    "Admin API requests refused for a missing, malformed, unknown, expired or revoked token",
)
FENCED = Gauge(
    "gtm_fenced",
    "1 while this node is cut off from the shared database for longer than GTM_FENCE_AFTER_S "
    "and fences restricted traffic (alert on it)",
)

# The control log (gtm.control): refusals of a log cut back, forked, edited or missing entries,
# entries the fold refused, and the sequence this process has accepted.
CONTROL_LOG_REFUSED = Counter(
    "gtm_control_log_refused",
    "Times this process refused the control log in the database (cut back, forked, an entry "
    "edited, missing or unsigned); it keeps its last good state meanwhile",
    ["reason"],
)
CONTROL_LOG_BROKEN = Gauge(
    "gtm_control_log_broken",
    "1 while the control log in the database is refused by this process, else 0",
)
CONTROL_LOG_SEQUENCE = Gauge(
    "gtm_control_log_sequence", "The highest control-log entry this process has accepted"
)

# Signed documents (gtm.fleet.local_documents): the database offering less than this node
# accepted (rolled back: newest rows deleted or edited) or another record at the same sequence
# (a fork). The node keeps serving the version it holds, verified from its own disk.
DOCUMENTS_DIVERGED = Gauge(
    "gtm_documents_database_diverged",
    "1 while the shared database's newest valid signed document is below the one this node "
    "accepted, or forks from it; the node keeps serving its own copy (alert on it)",
)
DOCUMENTS_ROLLBACK_REFUSED = Counter(
    "gtm_documents_rollback_refused",
    "Times this node found the shared database's signed documents behind (rolled back) or "
    "forked from the version it accepted, and refused them",
    ["kind"],
)

# Health observations (gtm.fleet.observation_seal): peers' rows that did not count.
HEALTH_OBSERVATIONS_REFUSED = Counter(
    "gtm_health_observations_refused",
    "Peers' health observations this node refused to count (not a member, member without a "
    "key, unsigned, bad signature, dated in the future, older than one accepted, malformed)",
    ["reason"],
)
ANSWER_FAILURES = Counter(
    "gtm_answer_failures",
    "Exceptions raised while answering a query or request (dropped, or answered with an "
    "error), by answering path and exception type (gtm.failures)",
    ["path", "error"],
)

# The fleet as an admin service sees it (gtm.admin.fleet_watch): the alerts on a silent member
# and on a rollout left pending read these.
FLEET_MEMBER_SILENCE = Gauge(
    "gtm_fleet_member_silence_seconds",
    "Seconds since each fleet member's last status report (a member that never reported: since "
    "this admin service began watching)",
    ["member"],
)
FLEET_LIVE_BOUND = Gauge(
    "gtm_fleet_live_bound_seconds",
    "The liveness bound: a member silent longer than this is not live (GTM_NODE_LIVE_WITHIN_S)",
)
FLEET_ROLLOUT_PENDING = Gauge(
    "gtm_fleet_rollout_pending_members",
    "Members that have not acknowledged the newest activation (pending or fenced)",
)
FLEET_ROLLOUT_AGE = Gauge(
    "gtm_fleet_rollout_age_seconds",
    "Seconds since the newest activation (0: none yet)",
)
