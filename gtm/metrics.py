"""Prometheus metrics of the global tier, defined once per process (prometheus_client keeps
a global registry; defining them per instance would register twice)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

DECISIONS_COUNTED = Counter(
    "gtm_audit_decisions_counted", "Answers counted towards audit rows", ["channel"]
)
AUDIT_ROWS_WRITTEN = Counter("gtm_audit_rows_written", "Audit rows committed to the database")
AUDIT_FLUSH_FAILURES = Counter(
    "gtm_audit_flush_failures", "Flushes that could not reach the database (rows stay spooled)"
)
AUDIT_SPOOLED_ROWS = Gauge("gtm_audit_spooled_rows", "Audit rows waiting in the local spool")
SNAPSHOT_VERSION = Gauge("gtm_snapshot_version", "Version of the snapshot in force")
GEOIP_RELOAD_FAILURES = Counter(
    "gtm_geoip_reload_failures", "GeoIP files that changed but could not be opened"
)
CAPACITY_REPORTS = Counter(
    "gtm_capacity_reports_pushed", "Capacity reports pushed by regional balancers", ["result"]
)
