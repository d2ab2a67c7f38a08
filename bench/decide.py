"""Decisions per second and per-decision latency of ``decide()`` on the demo topology.

Every variant runs in the same process on the same client mix, one after another, so their
ratios are meaningful on a shared, noisy machine; quote ratios, not the absolute times.

    python bench/decide.py [--clients 50000] [--queries 200000] [--json FILE]

Variants:
  full           demo policies, one region down, one region spilling with fresh reports
  +reports       the same with a new snapshot for each capacity report, one every 2,000
                 decisions (six regions reporting each second at ~12k decisions/s)
  +flaps         reports as above and a health state change every 50,000 decisions (about one
                 a second at this rate; issue-5 hysteresis allows ~2 a minute): each change
                 empties the plan memo, so this shows the cost of rebuilding plans
  no-policy      the same loop with the policy filter off (a policy set without rules)
  geoip-only     just the GeoIP lookup (the floor under any decision)
  cold           the first decision for each client on a fresh snapshot and GeoIP database:
                 every GeoIP lookup, ranking and plan is computed, nothing is memoised yet

Steady-state variants are warmed with one pass over the mix first, as a running server is; the
cold variant shows what the long tail of first-seen locations and snapshot swaps costs.

The client mix is a seeded sample of public IPv4 (90%) and IPv6 (10%) addresses, repeated with a
Zipf-like skew, as resolvers and busy client networks repeat; one query in three carries an ECS
subnet. The GeoIP database is the bundled GeoLite2-City unless GTM_GEOIP_PATH is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gtm.decision.policy import PolicyDocument, compile_policy  # noqa: E402
from gtm.decision.routing import Channel, DecisionRequest, decide  # noqa: E402
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot, next_capacity  # noqa: E402
from gtm.runtime import build_snapshot  # noqa: E402
from gtm.settings import Settings  # noqa: E402

NOW = 1_000_000.0


def client_mix(n_clients: int, n_queries: int, seed: int) -> list[DecisionRequest]:
    rng = random.Random(seed)
    clients: list[DecisionRequest] = []
    services = ["chat", "chat-eu"]
    for _ in range(n_clients):
        if rng.random() < 0.9:
            first = rng.choice([o for o in range(1, 224) if o not in (10, 127)])
            addr: IPv4Address | IPv6Address = IPv4Address((first << 24) | rng.getrandbits(24))
            ecs: IPv4Network | IPv6Network | None = (
                IPv4Network((int(addr) >> 8 << 8, 24)) if rng.random() < 0.33 else None
            )
        else:
            addr = IPv6Address((0x2000 + rng.getrandbits(9) << 112) | rng.getrandbits(112))
            ecs = IPv6Network((int(addr) >> 72 << 72, 56)) if rng.random() < 0.33 else None
        service = rng.choice(services)
        clients.append(DecisionRequest(Channel.DNS, addr, service, service, ecs=ecs))
    # Zipf-like reuse: a few clients ask very often, most rarely.
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(n_clients)]
    return rng.choices(clients, weights=weights, k=n_queries)


def degraded(snapshot: Snapshot) -> Snapshot:
    spill = snapshot.topology.routing.spillover
    return snapshot.evolve(
        NOW,
        health={
            "us-west": RegionHealth(HealthState.DOWN, NOW),
            **{
                r.id: RegionHealth(HealthState.UP, NOW)
                for r in snapshot.topology.regions
                if r.id != "us-west"
            },
        },
        capacity={
            "eu-central": next_capacity(None, 0.93, NOW, True, spill),
            "eu-west": next_capacity(None, 0.40, NOW, True, spill),
            "us-east": next_capacity(None, 0.50, NOW, True, spill),
        },
    )


def without_policy(snapshot: Snapshot) -> Snapshot:
    # No rules: every request is unconstrained; classes on the services are simply unknown to
    # nobody because the filter is not consulted. Drop the classes so nothing is denied.
    topo = snapshot.topology.model_copy(
        update={
            "services": tuple(
                s.model_copy(update={"residency_class": None}) for s in snapshot.topology.services
            )
        }
    )
    topo.model_post_init(None)
    empty = compile_policy([("none", PolicyDocument(version="none"))])
    return snapshot.evolve(NOW, topology=topo, policy=empty)


def churning(
    snapshot: Snapshot, report_every: int, health_every: int
) -> Callable[[DecisionRequest], object]:
    """decide() against a snapshot replaced as capacity reports and health changes arrive."""
    snap, n = snapshot, 0
    spill = snapshot.topology.routing.spillover

    def run(req: DecisionRequest) -> object:
        nonlocal snap, n
        n += 1
        if n % health_every == 0:
            flip = HealthState.DRAINING if (n // health_every) % 2 else HealthState.UP
            snap = snap.evolve(NOW, health={**snap.health, "ap-south": RegionHealth(flip, NOW)})
        elif n % report_every == 0:
            u = 0.90 + (n // report_every % 10) / 100  # eu-central hovers over its watermark
            snap = snap.evolve(
                NOW,
                capacity={
                    **snap.capacity,
                    "eu-central": next_capacity(
                        snap.capacity.get("eu-central"), u, NOW, True, spill
                    ),
                },
            )
        return decide(req, snap, NOW)

    return run


def cold(snapshot: Snapshot, distinct: list[DecisionRequest]) -> dict[str, float]:
    return measure(lambda r: decide(r, snapshot, NOW), distinct, warm=False)


def measure(
    fn: Callable[[DecisionRequest], object], requests: list[DecisionRequest], warm: bool = True
) -> dict[str, float]:
    if warm:
        for req in requests:  # warm the memos, as a running server has them
            fn(req)
    gc.collect()
    gc.disable()  # collections would land on arbitrary decisions; measured separately below
    clock = time.perf_counter_ns
    samples = []
    start = clock()
    for req in requests:
        t0 = clock()
        fn(req)
        samples.append(clock() - t0)
    elapsed = clock() - start
    gc.enable()
    samples.sort()
    n = len(samples)

    def pct(p: float) -> float:
        return samples[min(n - 1, int(p * n))] / 1000

    return {
        "per_s": n / (elapsed / 1e9),
        "p50_us": pct(0.50),
        "p90_us": pct(0.90),
        "p99_us": pct(0.99),
        "p999_us": pct(0.999),
        "mean_us": statistics.fmean(samples) / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    def fresh_snapshot() -> Snapshot:
        return degraded(
            build_snapshot(
                Settings(config=ROOT / "examples/demo.yaml", policies=(ROOT / "policies",)), NOW
            )
        )

    full = fresh_snapshot()
    bare = degraded(without_policy(full))
    requests = client_mix(args.clients, args.queries, args.seed)
    distinct = list({(r.client, r.ecs, r.service): r for r in requests}.values())
    reports = churning(full, 2000, 10**12)
    flaps = churning(fresh_snapshot(), 2000, 50_000)
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "full": lambda: measure(lambda r: decide(r, full, NOW), requests),
        "+reports": lambda: measure(reports, requests),
        "+flaps": lambda: measure(flaps, requests),
        "no-policy": lambda: measure(lambda r: decide(r, bare, NOW), requests),
        "geoip-only": lambda: measure(
            lambda r: full.geo.locate(r.ecs.network_address if r.ecs else r.client), requests
        ),
        "cold": lambda: cold(fresh_snapshot(), distinct),
    }
    # Variants interleaved over rounds, the median of each statistic reported: a burst of load
    # from another process hits one round of every variant rather than all of one.
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            rounds[name].append(run())
    results = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in rounds.items()
    }
    baseline = results["no-policy"]
    print(
        f"decide() on the demo topology: {args.queries} queries over {args.clients} clients, "
        f"GeoIP {full.geo.build}; median of {args.rounds} interleaved rounds"
    )
    print(
        f"{'variant':<12} {'decisions/s':>12} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} "
        f"{'p99.9 us':>9} {'rate vs no-policy':>18}"
    )
    for name, r in results.items():
        print(
            f"{name:<12} {r['per_s']:>12,.0f} {r['p50_us']:>8.1f} {r['p90_us']:>8.1f} "
            f"{r['p99_us']:>8.1f} {r['p999_us']:>9.1f} {r['per_s'] / baseline['per_s']:>17.2f}x"
        )
    for name in ("full", "+reports", "+flaps"):
        p99 = results[name]["p99_us"]
        print(
            f"target p99 <= 50 us per decision ({name}): "
            f"{'met' if p99 <= 50 else 'MISSED'} ({p99:.1f} us)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
