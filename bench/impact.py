"""Impact analysis: replaying recorded answers under a draft policy (target: 1,000,000 recorded
answers in 30 s or less).

    python bench/impact.py [--answers 1000000] [--inputs 100000] [--database-url URL]

Recorded traffic is made the way the answering paths record it: a seeded client mix on the demo
topology (bundled GeoLite2-City, both services, a third with ECS), each distinct input decided
and counted into a fresh audit store with its share of the answers (Zipf-like: a few client
networks have most of them, as resolvers do). Then, in the same run:

- ``read``      the distinct inputs of the window read back (``decision_inputs``);
- ``decide x1`` every input decided once under the snapshot in force (the floor under any
                replay: a replay decides each input at least once);
- ``impact``    the whole analysis as ``POST /v1/proposals/{id}/impact`` runs it: read, build the
                draft's snapshot, decide each input under both, weigh and classify the changes.

The draft is the change a compliance team must never make alone: EU personal data allowed in
the US. Quote the ratio of ``impact`` to ``decide x1`` and whether ``impact`` meets the target.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gtm.admin.impact import analyse  # noqa: E402
from gtm.audit import migrate, query  # noqa: E402
from gtm.audit.database import make_async_engine  # noqa: E402
from gtm.audit.record import record_of  # noqa: E402
from gtm.audit.spool import Spool  # noqa: E402
from gtm.audit.writer import AuditWriter  # noqa: E402
from gtm.decision.bundle import parse_documents  # noqa: E402
from gtm.decision.routing import Channel, DecisionRequest, decide  # noqa: E402
from gtm.runtime import build_snapshot  # noqa: E402
from gtm.settings import Settings  # noqa: E402

NAMES = {"chat": "chat.gtm.example.", "chat-eu": "chat.eu.gtm.example."}


def inputs(n: int, seed: int) -> list[DecisionRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first = rng.choice([o for o in range(1, 224) if o not in (10, 127)])
        addr = IPv4Address((first << 24) | rng.getrandbits(24))
        ecs = IPv4Network((int(addr) >> 8 << 8, 24)) if rng.random() < 0.33 else None
        service = rng.choice(list(NAMES))
        out.append(DecisionRequest(Channel.DNS, addr, service, NAMES[service], ecs))
    return out


def weights(n: int, total: int, seed: int) -> list[int]:
    """``n`` positive counts summing to ``total``, Zipf-like."""
    rng = random.Random(seed)
    raw = [1.0 / (i + 1) ** 0.8 for i in range(n)]
    rng.shuffle(raw)
    scale = (total - n) / sum(raw)
    counts = [1 + int(r * scale) for r in raw]
    counts[0] += total - sum(counts)
    return counts


def loosened(settings: Settings) -> tuple[str, dict[str, str]]:
    policies = {}
    for path in sorted(Path(settings.policies[0]).glob("*.yaml")):
        text = path.read_text()
        if path.name == "eu-personal.yaml":
            text = text.replace("jurisdictions: [EU]", "jurisdictions: [EU, US]")
        policies[path.name] = text
    return settings.config.read_text(), policies


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=1_000_000)
    parser.add_argument("--inputs", type=int, default=100_000, help="distinct decision inputs")
    parser.add_argument("--database-url", help="default: a fresh SQLite file")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gtm-impact-bench-") as tmp:
        url = args.database_url or f"sqlite:///{Path(tmp) / 'audit.sqlite3'}"
        settings = Settings(config=ROOT / "examples" / "demo.yaml", policies=(ROOT / "policies",))
        migrate.upgrade(url)
        engine = make_async_engine(url)
        snapshot = build_snapshot(settings, time.time())
        now = time.time()
        started = time.perf_counter()
        writer = AuditWriter(engine, "bench", Spool(Path(tmp) / "spool", "bench"))
        requests = inputs(args.inputs, args.seed)
        counts = weights(len(requests), args.answers, args.seed)
        for i, (request, n) in enumerate(zip(requests, counts, strict=True)):
            decision = decide(request, snapshot, now)
            writer.count(record_of(decision, channel="dns", name=request.name), n)
            if i % 20_000 == 19_999:
                await writer.flush()
        await writer.flush()
        made = time.perf_counter() - started
        since_us = round((now - 3600) * 1e6)

        t0 = time.perf_counter()
        recorded = await query.decision_inputs(engine, since_us)
        t_read = time.perf_counter() - t0

        fresh = build_snapshot(settings, now)
        t0 = time.perf_counter()
        for inp in recorded:
            decide(
                DecisionRequest(
                    Channel.DNS,
                    IPv4Network(inp.client_network).network_address,
                    inp.service,
                    inp.name,
                    IPv4Network(inp.ecs_prefix) if inp.ecs_prefix else None,
                    frozenset(inp.residency_classes),
                    inp.tenant,
                ),
                fresh,
                now,
            )
        t_once = time.perf_counter() - t0

        before = build_snapshot(settings, now)
        t0 = time.perf_counter()
        recorded = await query.decision_inputs(engine, since_us)
        topology, policies = loosened(settings)
        docs = parse_documents(topology, policies, "draft")
        after = before.evolve(now, topology=docs.topology, policy=docs.policy)
        report = analyse(recorded, before, after, now)
        t_impact = time.perf_counter() - t0
        await engine.dispose()

    answers = sum(r.answers for r in recorded)
    print(
        f"{answers:,} recorded answers in {len(recorded):,} distinct inputs "
        f"(made in {made:.1f} s); database {url.split(':')[0]}"
    )
    print()
    print("| step | seconds | vs decide x1 |")
    print("| --- | --- | --- |")
    print(f"| read the inputs | {t_read:.2f} | {t_read / t_once:.2f}x |")
    print(f"| decide x1 (baseline) | {t_once:.2f} | 1.00x |")
    print(
        f"| impact (read + draft + 2 decisions each + report) | {t_impact:.2f} "
        f"| {t_impact / t_once:.2f}x |"
    )
    print()
    print(
        f"impact: {report.moved:,} answers would move region, {report.left_jurisdiction:,} "
        f"would leave their jurisdiction, {report.newly_refused:,} newly fail closed"
    )
    verdict = "meets" if t_impact <= 30 else "MISSES"
    print(f"target: 1,000,000 answers in <= 30 s: {t_impact:.1f} s for {answers:,}: {verdict}")


if __name__ == "__main__":
    asyncio.run(main())
