"""The Grafana dashboard and the Prometheus alerts use only metrics the code defines (with the
suffixes Prometheus exposes them under), and only tables and columns the audit store has; the
rules pass `promtool check rules` and their unit tests (`promtool test rules`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gtm import metrics as gtm_metrics
from gtm.audit.schema import metadata
from gtm.front import metrics as front_metrics
from gtm.geodns.stats import DnsCollector, DnsStats
from regional_lb.metrics import BalancerMetrics
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "gtm-fleet.json"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
NAME = re.compile(r"\b((?:gtm|regional_lb)_[a-z0-9_]+)\b")


def _exposed(kind: str, name: str) -> set[str]:
    """The series names Prometheus scrapes for a family of this type and name."""
    if kind == "counter":
        return {name + "_total"}
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count"}
    return {name}


def _families(collector: Collector) -> Iterator[tuple[str, str]]:
    for family in collector.collect():
        yield family.type, family.name


def defined_series() -> set[str]:
    out: set[str] = set()
    for value in vars(gtm_metrics).values():
        if isinstance(value, MetricWrapperBase):
            for kind, name in _families(value):
                out |= _exposed(kind, name)
    collectors: list[Collector] = [front_metrics._FrontCollector(), DnsCollector(DnsStats())]
    balancer = BalancerMetrics(lambda: [], lambda: {"standard": 0}, region_utilisation=lambda: 0.0)
    for collector in [*collectors, balancer.registry]:
        for kind, name in _families(collector):
            out |= _exposed(kind, name)
    return out


def dashboard_queries() -> tuple[list[str], list[str]]:
    """(PromQL expressions, SQL queries) of every panel."""
    board = json.loads(DASHBOARD.read_text())
    promql, sql = [], []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            if "expr" in target:
                promql.append(target["expr"])
            if "rawSql" in target:
                sql.append(target["rawSql"])
    return promql, sql


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_the_code_defines_the_metrics_this_test_reads() -> None:
    series = defined_series()
    assert "gtm_region_state" in series and "gtm_audit_decisions_counted_total" in series
    assert "regional_lb_queue_depth" in series and "regional_lb_rejected_total" in series
    assert "gtm_dns_responses_total" in series and "gtm_front_responses_total" in series


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_used_is_defined_in_the_code(source: str) -> None:
    expressions = dashboard_queries()[0] if source == "dashboard" else rule_expressions()
    assert expressions
    defined = defined_series()
    for expression in expressions:
        used = set(NAME.findall(expression))
        assert used, f"{source}: {expression!r} names no metric"
        unknown = sorted(used - defined)
        assert not unknown, f"{source}: {unknown} are not metrics the code exposes"


def test_the_dashboard_covers_the_fleet() -> None:
    board = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in board["panels"]).lower()
    for topic in ("region state", "answers", "spill", "failover", "audit spool", "verification",
                  "queue depth", "utilisation", "429", "jurisdiction"):  # fmt: skip
        assert topic in titles, topic
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v["query"] for v in board["templating"]["list"]}
    assert variables == {"prometheus": "prometheus", "audit": "grafana-postgresql-datasource"}


def test_the_dashboards_sql_reads_tables_and_columns_that_exist() -> None:
    sql = dashboard_queries()[1]
    assert sql
    for query in sql:
        (table,) = re.findall(r"\bFROM (\w+)", query)
        assert table in metadata.tables, table
        columns = set(metadata.tables[table].columns.keys())
        code = re.sub(r"'[^']*'", "''", query)  # string literals are values, not names
        words = set(re.findall(r"\b[a-z][a-z_]*[a-z]\b", code)) - {table}
        snake = {w for w in words if "_" in w}
        assert snake, query
        assert snake <= columns, f"{sorted(snake - columns)} are not columns of {table}"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    return found


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        cwd=RULES.parent,
    )


def test_promtool_checks_the_rules() -> None:
    result = _run("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    count = len(rule_expressions())
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_promtool_unit_tests_every_alert() -> None:
    tests: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    tested = {
        case["alertname"]
        for group in tests["tests"]
        for case in group["alert_rule_test"]
        if case["exp_alerts"]
    }
    quiet = {
        case["alertname"]
        for group in tests["tests"]
        for case in group["alert_rule_test"]
        if not case["exp_alerts"]
    }
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    # Each alert is shown firing, and shown quiet where it should be.
    assert tested == alerts and quiet == alerts
    result = _run("test", "rules", RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    result = _run("check", "config", SCRAPE)
    assert result.returncode == 0, result.stdout + result.stderr
