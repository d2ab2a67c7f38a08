"""Regional balancer benchmark: policies compared on the same seeded arrivals.

    python bench/regional/run.py [--quick] [--json FILE] [--plots DIR] [--seeds N] [--jobs N]

Prints one table per scenario (load, policy: utilisation CV, P50/P99/P99.9, P99/P50,
throughput at the P99 SLO, goodput, 429 share), checks the targets, and writes PNG plots
(latency CDFs, utilisation per instance) and, with ``--json``, one object per
(scenario, load, policy).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.regional.policies import POLICIES
from bench.regional.scenarios import CONTRACT_SHARES, Scenario, contract_share_sweep, scenarios
from bench.regional.sim import AdmissionSpec, RunResult, make_jobs, simulate

REPORT_LOADS = (0.5, 0.7, 0.9)
SWEEP_POLICIES = ("round_robin", "least_connections", "ours", "oracle")
SIGMAS = (0.0, 0.3, 0.6, 1.0)
OVERLOAD = 1.2


@dataclass(frozen=True)
class Task:
    scenario: str
    sigma: float
    load: float
    policy: str
    seed: int
    n: int
    admission: AdmissionSpec | None = None


_MEAN_COST: dict[str, float] = {}


def _all_scenarios() -> dict[str, Scenario]:
    return {**scenarios(), **contract_share_sweep()}


def _scenario(name: str, sigma: float) -> Scenario:
    return replace(_all_scenarios()[name], sigma=sigma)


def run_task(task: Task) -> tuple[Task, RunResult]:
    sc = _scenario(task.scenario, task.sigma)
    if task.scenario not in _MEAN_COST:
        _MEAN_COST[task.scenario] = sc.mean_cost()
    jobs = make_jobs(sc, task.load, task.seed, task.n, sc.sigma, _MEAN_COST[task.scenario])
    policy = POLICIES[task.policy]()
    return task, simulate(sc, policy, jobs, task.seed, task.admission)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


@dataclass
class Cell:
    """Every seed of one (scenario, sigma, load, policy)."""

    results: list[RunResult]
    rate: float  # offered requests per second

    @property
    def latencies(self) -> list[float]:
        return sorted(x for r in self.results for x in r.latencies)

    def summary(self, slo: float) -> dict[str, float]:
        lat = self.latencies
        p50, p99, p999 = (percentile(lat, q) for q in (0.5, 0.99, 0.999))
        offered = sum(r.offered for r in self.results)
        rejected = sum(r.rejected for r in self.results)
        duration = sum(r.duration for r in self.results)
        ra = [(p, a) for r in self.results for p, a in r.drain]
        return {
            "p50": p50,
            "p99": p99,
            "p999": p999,
            "p99_over_p50": p99 / p50 if p50 > 0 else math.nan,
            "cv": statistics.fmean(cv(r.utilisation) for r in self.results),
            "work_cv": statistics.fmean(cv(r.work_share) for r in self.results),
            "util_min": statistics.fmean(min(r.utilisation) for r in self.results),
            "util_max": statistics.fmean(max(r.utilisation) for r in self.results),
            "goodput": sum(1 for x in lat if x <= slo) / duration,
            "share_429": rejected / offered if offered else 0.0,
            "retry_after_ok": (
                sum(r.retry_ok for r in self.results) / rejected if rejected else math.nan
            ),
            "drain_actual_over_predicted": (
                statistics.median(a / p for p, a in ra if p > 0) if ra else math.nan
            ),
            "drain_within_25pct": (
                sum(1 for p, a in ra if p > 0 and 0.75 <= a / p <= 1.25) / len(ra)
                if ra
                else math.nan
            ),
            "rate": self.rate,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="fewer requests and sweep points")
    ap.add_argument("--json", type=Path, help="write one object per (scenario, load, policy)")
    ap.add_argument("--plots", type=Path, default=Path(__file__).parent / "out")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    args = ap.parse_args(argv)

    started = time.monotonic()
    n = 2000 if args.quick else 8000
    sweep = (
        (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
        if args.quick
        else tuple(round(0.1 + 0.05 * k, 2) for k in range(18))
    )
    seeds = list(range(1, args.seeds + 1))
    base = {name: sc.sigma for name, sc in scenarios().items()}
    tasks: list[Task] = []
    for name, sigma in base.items():
        for load in sweep:
            for pol in POLICIES:
                tasks += [Task(name, sigma, load, pol, s, n) for s in seeds]
    for sigma in SIGMAS:
        if sigma != base["mixed_fleet"]:
            for load in sweep:
                tasks += [Task("mixed_fleet", sigma, load, "ours", s, n) for s in seeds]
    for name, sc in contract_share_sweep().items():
        for load in REPORT_LOADS:
            for pol in SWEEP_POLICIES:
                tasks += [Task(name, sc.sigma, load, pol, s, n) for s in seeds]
    limit = 4 * len(scenarios()["documents"].servers)
    for pol in POLICIES:
        tasks += [
            Task("documents", base["documents"], OVERLOAD, pol, s, n, AdmissionSpec(limit))
            for s in seeds
        ]

    cells: dict[tuple[str, float, float, str], list[RunResult]] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for task, res in pool.map(run_task, tasks, chunksize=4):
            cells.setdefault((task.scenario, task.sigma, task.load, task.policy), []).append(res)

    rows = report(cells, base, sweep, args.plots)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, allow_nan=False, default=_finite))
    print(
        f"\n{len(tasks)} runs, {n} requests each, {len(seeds)} seeds, "
        f"{time.monotonic() - started:.0f} s"
    )
    return 0


def _finite(x: Any) -> Any:
    return None


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def report(
    cells: dict[tuple[str, float, float, str], list[RunResult]],
    base: dict[str, float],
    sweep: tuple[float, ...],
    plots: Path,
) -> list[dict[str, Any]]:
    from bench.regional.plots import plot_cdfs, plot_utilisation
    from bench.regional.targets import check_targets

    all_sc = _all_scenarios()
    means = {name: sc.mean_cost() for name, sc in all_sc.items()}
    rows: list[dict[str, Any]] = []
    table: dict[tuple[str, float, str], dict[str, float]] = {}

    def cell(name: str, sigma: float, load: float, pol: str) -> Cell:
        rate = load * all_sc[name].capacity / means[name]
        return Cell(cells[(name, sigma, load, pol)], rate)

    def thr_at_slo(name: str, sigma: float, pol: str, slo: float) -> float:
        best = 0.0
        for load in sweep:
            c = cell(name, sigma, load, pol)
            if percentile(c.latencies, 0.99) > slo:
                break
            best = c.rate
        return best

    groups: list[tuple[str, str, float, list[str]]] = [
        (name, name, base[name], list(POLICIES)) for name in base
    ]
    for sigma in SIGMAS:
        groups.append(
            (
                f"sigma_{sigma}",
                "mixed_fleet",
                sigma,
                ["ours", "speed_weighted_lc", "least_connections", "oracle"],
            )
        )
    slos = {
        name: 2.0 * percentile(cell(name, base[name], 0.5, "oracle").latencies, 0.99)
        for name in base
    }
    plots.mkdir(parents=True, exist_ok=True)
    for label, name, sigma, pols in groups:
        slo = slos[name]
        title = (
            all_sc[name].title
            if label == name
            else (f"4. Estimate error sigma={sigma} on the mixed fleet")
        )
        print(f"\n## {title}   (P99 SLO {slo:.1f} s = 2 x oracle P99 at 50% load)")
        print(
            f"{'load':>5} {'policy':<22} {'util CV':>7} {'P50':>7} {'P99':>7} {'P99.9':>7} "
            f"{'P99/50':>7} {'thr@SLO':>8} {'goodput':>8} {'429':>5}"
        )
        for load in REPORT_LOADS:
            for pol in pols:
                sig = base[name] if pol != "ours" else sigma
                c = cell(name, sig, load, pol)
                s = c.summary(slo)
                thr = thr_at_slo(name, sig, pol, slo)
                table[(label, load, pol)] = {**s, "throughput_at_slo": thr}
                print(
                    f"{load:>5.0%} {pol:<22} {s['cv']:>7.3f} {s['p50']:>7.2f} {s['p99']:>7.2f}"
                    f" {s['p999']:>7.2f} {s['p99_over_p50']:>7.1f} {thr:>8.2f}"
                    f" {s['goodput']:>8.2f} {s['share_429']:>5.1%}"
                )
                rows.append(
                    _clean(
                        {
                            "scenario": label,
                            "load": load,
                            "policy": pol,
                            "sigma": sig,
                            "slo_s": slo,
                            **s,
                            "throughput_at_slo": thr,
                        }
                    )
                )
        if label == name:
            plot_cdfs(
                plots / f"{name}_latency_cdf.png",
                title,
                {p: cell(name, sigma, 0.9, p).latencies for p in pols},
            )
            plot_utilisation(
                plots / f"{name}_utilisation.png",
                title,
                {p: cell(name, sigma, 0.9, p).results[0].utilisation for p in pols},
            )

    slo = slos["documents"]
    print(
        f"\n## Overload: documents at {OVERLOAD:.0%} with an admission queue "
        f"(16 running, 30 s timeout)"
    )
    print(
        f"{'policy':<22} {'P99':>7} {'goodput':>8} {'429':>6} {'retry ok':>8} "
        f"{'drain actual/pred':>17} {'within 25%':>10}"
    )
    for pol in POLICIES:
        c = cell("documents", base["documents"], OVERLOAD, pol)
        s = c.summary(slo)
        print(
            f"{pol:<22} {s['p99']:>7.2f} {s['goodput']:>8.2f} {s['share_429']:>6.1%} "
            f"{s['retry_after_ok']:>8.1%} {s['drain_actual_over_predicted']:>17.2f} "
            f"{s['drain_within_25pct']:>10.1%}"
        )
        rows.append(
            _clean(
                {
                    "scenario": "documents_overload",
                    "load": OVERLOAD,
                    "policy": pol,
                    "sigma": base["documents"],
                    "slo_s": slo,
                    **s,
                    "throughput_at_slo": math.nan,
                }
            )
        )
    print(
        "\n## Where the P99 cut comes from: documents by contract share, P99 (s) and its cut "
        "versus round-robin"
    )
    print(f"{'contracts':>9} {'load':>5} " + " ".join(f"{p:>24}" for p in SWEEP_POLICIES))
    for share in CONTRACT_SHARES:
        name = f"documents_share_{share}"
        sigma = all_sc[name].sigma
        slo = 2.0 * percentile(cell(name, sigma, 0.5, "oracle").latencies, 0.99)
        for load in REPORT_LOADS:
            sums = {pol: cell(name, sigma, load, pol).summary(slo) for pol in SWEEP_POLICIES}
            rr = sums["round_robin"]["p99"]
            for pol, summary in sums.items():
                table[(name, load, pol)] = summary
                # Loads here are only the report loads: no sweep for a throughput at the SLO.
                row = {"scenario": name, "load": load, "policy": pol, "sigma": sigma}
                row |= {"slo_s": slo, **summary, "throughput_at_slo": math.nan}
                row["p99_cut_vs_round_robin"] = 1 - summary["p99"] / rr
                rows.append(_clean(row))
            print(
                f"{share:>9.2%} {load:>5.0%} "
                + " ".join(
                    f"{sums[p]['p99']:>15.1f} ({1 - sums[p]['p99'] / rr:>5.0%})"
                    for p in SWEEP_POLICIES
                )
            )
    check_targets(table)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
