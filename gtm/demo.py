"""``make demo``: the demo topology on the embedded defaults (SQLite, bundled GeoLite2).

First a walk through the decision core: well-known client addresses, failover, fail-closed
residency and capacity spillover, every decision counted into the audit store and its hash
chain verified. Then a live node: the authoritative DNS responder on an unprivileged port,
asked a few questions as resolvers would ask them, and left serving until Ctrl-C (``--once``
stops after the examples).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from ipaddress import ip_address, ip_network
from pathlib import Path

import dns.asyncquery
import dns.edns
import dns.message
import dns.rcode

from gtm.audit import query
from gtm.audit.record import record_of
from gtm.cli import render_decision
from gtm.logs import configure
from gtm.node import Node, run_node
from gtm.routing import Channel, Decision, DecisionRequest, decide
from gtm.runtime import Runtime
from gtm.settings import Settings
from gtm.snapshot import HealthState, RegionHealth, Snapshot, next_capacity

# Well-known addresses and where the 2018 GeoLite2-City data puts them.
CLIENTS = [
    ("8.8.8.8", "a public resolver in the US"),
    ("81.2.69.160", "a London address (MaxMind's own test range)"),
    ("85.214.0.1", "a Berlin hosting provider"),
    ("49.36.0.1", "an Indian mobile network"),
    ("133.11.0.1", "a Tokyo university"),
    ("1.1.1.1", "an anycast resolver registered in Australia"),
    ("200.160.0.1", "a Sao Paulo network"),
    ("2a00:1450:4001::1", "an IPv6 network in Europe"),
]
SERVICES = ["chat.gtm.example", "chat.eu.gtm.example"]


def heading(text: str) -> None:
    print(f"\n== {text} " + "=" * max(0, 86 - len(text)))


def table(rows: list[tuple[str, str, str, Decision]]) -> None:
    print(f"{'client':<20} {'located':<8} {'name':<22} {'outcome':<12} {'region':<13} answer")
    for client, _, name, d in rows:
        where = f"{d.location.country or '??'}/{d.location.continent or '??'}"
        answer = ",".join(d.ipv4) or (d.dns_failure.value if d.dns_failure else "-")
        print(
            f"{client:<20} {where:<8} {name:<22} {d.outcome.value:<12} "
            f"{d.region or '-':<13} {answer}"
        )


def ask(snapshot: Snapshot, client: str, name: str, now: float, ecs: str | None = None) -> Decision:
    service = snapshot.topology.service_by_host(name)
    assert service is not None
    req = DecisionRequest(
        Channel.API, ip_address(client), service.id, name, ecs=ip_network(ecs) if ecs else None
    )
    return decide(req, snapshot, now)


async def main(once: bool) -> None:
    configure("console", "warning")
    var = Path(os.environ.get("GTM_DEMO_VAR", "var"))  # where the demo keeps its state
    settings = Settings(
        database_url=f"sqlite:///{var / 'demo.sqlite3'}",
        spool_dir=var / "demo-spool",
        node_id="demo-node",
        audit_flush_interval_s=0.2,
        probes=False,  # the walkthrough sets health and capacity itself
    )
    runtime = Runtime(settings)
    await runtime.start()
    now = time.time()
    snap = runtime.store.current
    decided: list[tuple[str, str, str, Decision]] = []

    def run(snapshot: Snapshot, client: str, name: str, note: str = "") -> Decision:
        d = ask(snapshot, client, name, now)
        decided.append((client, note, name, d))
        runtime.count(record_of(d, channel="api", name=name))
        return d

    heading(f"Decisions, all regions up (GeoIP {snap.geo.build})")
    rows = [(c, note, n, run(snap, c, n, note)) for c, note in CLIENTS for n in SERVICES]
    table(rows)

    heading("Why: one decision explained (gtm explain --client 8.8.8.8 --name chat.eu...)")
    print(render_decision(ask(snap, "8.8.8.8", "chat.eu.gtm.example", now), "chat.eu.gtm.example"))

    heading("Failover: eu-central down")
    down = snap.evolve(now, health={"eu-central": RegionHealth(HealthState.DOWN, now)})
    table([(c, "", n, run(down, c, n)) for c in ("85.214.0.1",) for n in SERVICES])

    heading("Residency: every EU region down -> EU personal data fails closed, never leaves")
    eu_down = snap.evolve(
        now, health={r: RegionHealth(HealthState.DOWN, now) for r in ("eu-west", "eu-central")}
    )
    table([(c, "", n, run(eu_down, c, n)) for c in ("85.214.0.1", "8.8.8.8") for n in SERVICES])

    heading("Spillover: eu-central at 95% utilisation, eu-west at 40% (fresh reports)")
    spill = snap.topology.routing.spillover
    hot = snap.evolve(
        now,
        capacity={
            "eu-central": next_capacity(None, 0.95, now, True, spill),
            "eu-west": next_capacity(None, 0.40, now, True, spill),
        },
    )
    moved = total = 0
    for third in range(0, 256):
        d = ask(hot, "85.214.0.1", "chat.gtm.example", now, ecs=f"85.214.{third}.0/24")
        runtime.count(record_of(d, channel="api", name="chat.gtm.example"))
        total += 1
        moved += d.region == "eu-west"
    print(
        f"{moved} of {total} client /24s in 85.214.0.0/16 moved to eu-west "
        f"({moved / total:.0%}; the share that brings eu-central back to its low watermark "
        f"is {(0.95 - spill.low_watermark) / 0.95:.0%}); the same /24s move on every query"
    )

    await runtime.stop()
    heading(f"Audit store ({settings.database_url})")
    from gtm.audit.database import make_async_engine

    engine = make_async_engine(settings.database_url)
    try:
        recent = await query.tail(engine, 5)
        for row in recent:
            print(
                f"  {row['node']}#{row['node_seq']} x{row['count']} {row['name']} "
                f"{row['client_network']} -> {row['outcome']} {row['region'] or '-'}"
            )
        checked, breaks = await query.verify(engine)
        total_counted = await query.total_count(engine)
    finally:
        await engine.dispose()
    print(
        f"  {runtime.writer.counted} decisions counted this run; {total_counted} in the store "
        f"over all runs; {checked} rows, hash chain {'intact' if not breaks else 'BROKEN'}"
    )
    await live(settings, once)


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
            try:
                udp.bind(("127.0.0.1", port))
                tcp.bind(("127.0.0.1", udp.getsockname()[1]))
            except OSError:
                continue
            return int(udp.getsockname()[1])
    raise OSError("no free port for the demo DNS listener")


async def live(settings: Settings, once: bool) -> None:
    port = free_port(5353)
    live_settings = settings.model_copy(update={"dns_listen": (f"127.0.0.1:{port}",)})
    stop = asyncio.Event()
    ready: asyncio.Future[Node] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_node(live_settings, stop, ready))
    await ready
    heading(f"Live: authoritative DNS on 127.0.0.1:{port} (UDP and TCP)")
    print(f"{'question':<32} {'client subnet (ECS)':<22} {'answer':<18} ECS scope")
    for name, rdtype, subnet in (
        ("chat.gtm.example.", "A", "85.214.0.0/24"),
        ("chat.gtm.example.", "A", "49.36.0.0/24"),
        ("chat.gtm.example.", "AAAA", "8.8.8.0/24"),
        ("chat.eu.gtm.example.", "A", "8.8.8.0/24"),
        ("chat.eu.gtm.example.", "A", "133.11.0.0/24"),
        ("gtm.example.", "SOA", "85.214.0.0/24"),
        ("nope.gtm.example.", "A", "85.214.0.0/24"),
    ):
        address, prefix = subnet.split("/")
        query = dns.message.make_query(
            name, rdtype, use_edns=0, options=[dns.edns.ECSOption(address, int(prefix))]
        )
        reply = await dns.asyncquery.udp(query, "127.0.0.1", port=port, timeout=3)
        shown = [item.to_text().split()[0] for rrset in reply.answer for item in rrset]
        scope = next((o.scopelen for o in reply.options if isinstance(o, dns.edns.ECSOption)), "-")
        answer = ",".join(shown) or dns.rcode.to_text(reply.rcode())
        print(f"{name + ' ' + rdtype:<32} {subnet:<22} {answer:<18} /{scope}")
    print(
        f"\nTry: dig @127.0.0.1 -p {port} chat.eu.gtm.example A +subnet=203.0.113.0/24\n"
        f"     .venv/bin/gtm explain --client 8.8.8.8 --name chat.eu.gtm.example\n"
        f"     .venv/bin/gtm audit tail --database-url {settings.database_url}"
    )
    if not once:
        print("Serving until Ctrl-C.")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    else:
        stop.set()
    await task


if __name__ == "__main__":
    asyncio.run(main(once="--once" in sys.argv[1:]))
