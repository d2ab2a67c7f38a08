"""The discrete-event simulator drives the real pick() and accounting, deterministically."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.regional.policies import POLICIES, Ours
from bench.regional.run import Task, percentile, run_task
from bench.regional.scenarios import scenarios
from bench.regional.sim import AdmissionSpec, make_jobs, simulate
from tests.conftest import ROOT


def test_same_seed_same_result_and_policies_see_the_same_requests() -> None:
    a = run_task(Task("mixed_fleet", 0.3, 0.7, "ours", 3, 600))[1]
    b = run_task(Task("mixed_fleet", 0.3, 0.7, "ours", 3, 600))[1]
    assert a.latencies == b.latencies and a.utilisation == b.utilisation
    sc = scenarios()["mixed_fleet"]
    jobs1 = make_jobs(sc, 0.7, 3, 100, 0.3, 1.0)
    jobs2 = make_jobs(sc, 0.7, 3, 100, 1.0, 1.0)
    # A different estimate error changes estimates only, never arrivals or true costs.
    assert [(j.arrival, j.true_cost) for j in jobs1] == [(j.arrival, j.true_cost) for j in jobs2]
    assert [j.est_cost for j in jobs1] != [j.est_cost for j in jobs2]


def test_every_policy_completes_every_request_and_accounting_ends_at_zero() -> None:
    sc = scenarios()["mixed_fleet"]
    jobs = make_jobs(sc, 0.9, 1, 400, 0.3, sc.mean_cost())
    for name, cls in POLICIES.items():
        res = simulate(sc, cls(), jobs, 1)
        assert len(res.latencies) == res.offered, name
        assert all(x > 0 for x in res.latencies)


def test_ours_beats_round_robin_on_documents_and_least_connections_on_mixed_fleet() -> None:
    def p99(scenario: str, policy: str) -> float:
        lat: list[float] = []
        for seed in (1, 2):
            lat += run_task(Task(scenario, 0.3, 0.8, policy, seed, 1500))[1].latencies
        return percentile(sorted(lat), 0.99)

    assert p99("documents", "ours") < 0.6 * p99("documents", "round_robin")
    assert p99("mixed_fleet", "ours") < 0.7 * p99("mixed_fleet", "least_connections")


def test_admission_rejects_under_overload_with_a_drain_prediction() -> None:
    sc = scenarios()["documents"]
    jobs = make_jobs(sc, 1.3, 2, 1500, 0.3, sc.mean_cost())
    res = simulate(sc, Ours(), jobs, 2, AdmissionSpec(running_limit=16, queue_timeout_s=10.0))
    assert 0 < res.rejected < res.offered
    assert res.drain and all(p > 0 for p, _ in res.drain)


@pytest.mark.slow
def test_run_quick_writes_the_json_rows(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "regional" / "run.py"),
            "--quick",
            "--json",
            str(out),
            "--plots",
            str(tmp_path / "plots"),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    rows = json.loads(out.read_text())
    keys = {"scenario", "load", "policy", "p50", "p99", "cv", "throughput_at_slo"}
    assert rows and all(keys <= row.keys() for row in rows)
    assert {"round_robin", "least_connections", "oracle", "ours"} <= {r["policy"] for r in rows}
    assert (tmp_path / "plots" / "documents_latency_cdf.png").exists()
