"""``make demo``: the demo topology on the embedded defaults (SQLite, bundled GeoLite2).

First a walk through the decision core: well-known client addresses, failover, fail-closed
residency and capacity spillover, every decision counted into the audit store and its hash
chain verified. Then a live node: the authoritative DNS responder on an unprivileged port,
asked a few questions as resolvers would ask them, and left serving until Ctrl-C (``--once``
stops after the examples).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.edns
import dns.message
import dns.rcode
import dns.rdatatype
import httpx
from prometheus_client import REGISTRY
from pydantic import SecretStr

from gtm.audit import query
from gtm.audit.checkpoints import DirectorySink
from gtm.audit.record import record_of
from gtm.audit.verify import verify
from gtm.cli.audit import explain_row
from gtm.cli.main import render_decision
from gtm.control.entry import BOOTSTRAP
from gtm.control.log import ControlLog
from gtm.decision.routing import Channel, Decision, DecisionRequest, decide
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot, next_capacity
from gtm.decision.topology import load_topology
from gtm.demo import scenario
from gtm.demo.local_fleet import Fleet
from gtm.demo.ports import free_port, on_free_ports
from gtm.fleet import operator, shared_state
from gtm.logs import configure
from gtm.node import Node, run_node
from gtm.runtime import Runtime
from gtm.settings import Settings

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
    # The demo's admin key pair: every node of the demo trusts what it signed (the control log
    # of an earlier run included), as every node of a fleet does.
    _, public_key = scenario.signing_keys(var / "demo-keys")
    settings = Settings(
        # The CLI's default database when run from the checkout (GTM_DEMO_VAR unset): every
        # `gtm ...` command the demo suggests reads what the demo wrote, without options.
        database_url=f"sqlite:///{var / 'gtm.sqlite3'}",
        spool_dir=var / "demo-spool",
        node_id="demo-node",
        audit_flush_interval_s=0.2,
        probes=False,  # the walkthrough sets health and capacity itself
        document_keys=(public_key,),
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
        sink = DirectorySink(settings.checkpoint_dir)
        verified = await verify(engine, sink)
        total_counted = await query.total_count(engine)
    finally:
        await engine.dispose()
    print(
        f"  {runtime.writer.counted} decisions counted this run; {total_counted} in the store "
        f"over all runs; {verified.rows} rows verified against {verified.checkpoints} signed "
        f"checkpoints in {sink.directory} (outside the database): "
        f"{'intact' if not verified.breaks else f'{len(verified.breaks)} BREAK(S)'}"
    )
    await live(settings, once)


SECRET = "demo-report-secret"  # shared by the demo's balancers and GTM; never a real secret


async def live(settings: Settings, once: bool) -> None:
    heading("Live: a regional balancer and a simulated A100 per region, on loopback")
    var = Path(os.environ.get("GTM_DEMO_VAR", "var"))
    config, moved = on_free_ports(settings.config, var / "demo-topology.yaml")
    for region, (old, new) in moved.items():
        print(f"port {old} ({region}'s balancer) is taken: using {new}")
    settings = settings.model_copy(update={"config": config})
    topology = load_topology(config)
    fleet = Fleet(var / "demo-fleet", SECRET)
    dns_port, http_port = free_port(5353), free_port(8080)
    print(f"GTM listens on 127.0.0.1:{dns_port} (DNS, UDP and TCP), 127.0.0.1:{http_port} (HTTP)")
    try:
        # Balancers push their reports to the front (/v1/capacity) and GTM probes them too.
        fleet.start(topology, gtm_urls=(f"http://127.0.0.1:{http_port}",))
        await asyncio.to_thread(fleet.wait_ready)
        print(
            f"{len(fleet.balancers)} balancers up: "
            + ", ".join(f"{r} {u}" for r, u in fleet.balancers.items())
        )
        await serve_live(settings, once, fleet, dns_port, http_port)
    finally:
        fleet.stop()


async def serve_live(
    settings: Settings, once: bool, fleet: Fleet, dns_port: int, http_port: int
) -> None:
    var = Path(os.environ.get("GTM_DEMO_VAR", "var"))
    private_key, public_key = scenario.signing_keys(var / "demo-keys")
    holder = scenario.key_holder(private_key)
    admin_port = free_port(8081)
    live_settings = settings.model_copy(
        update={
            "dns_listen": (f"127.0.0.1:{dns_port}",),
            "http_listen": f"127.0.0.1:{http_port}",
            "admin_listen": f"127.0.0.1:{admin_port}",
            "document_signing_key": private_key,
            "document_keys": (public_key,),
            "probes": True,
            "probe_interval_s": 0.5,
            "probe_timeout_s": 0.4,
            "report_secret": SecretStr(SECRET),
            "trusted_proxies": (ip_network("127.0.0.0/8"),),
        }
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Node] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_node(live_settings, stop, ready))
    started: list[asyncio.Future[Any]] = [ready, task]
    await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # the node could not start: say why
    node = ready.result()
    engine = node.runtime.engine
    regions = list(fleet.balancers)
    try:
        # The store outlives a run, and so could an override an earlier run left: undo it, on
        # the record, so a run starts from a whole fleet.
        await scenario.restore(fleet, engine, regions, holder)
        await until_up(node, len(fleet.balancers))
        await asyncio.sleep(1.5)  # a round of pushed reports
        accepted = REGISTRY.get_sample_value(
            "gtm_capacity_reports_pushed_total", {"result": "accepted"}
        )
        print(f"capacity reports pushed by the balancers and accepted: {accepted or 0:.0f}")
        await show_dns(dns_port)
        await show_http(http_port, settings.database_url)
        await show_failover(node, fleet, dns_port, holder)
        heading("Back to a whole fleet: eu-central's balancer restarted, eu-west undrained")
        await scenario.restore(fleet, engine, regions, holder)
        await until_up(node, len(fleet.balancers), within=30)
        await show_console(node, (dns_port, http_port, admin_port), private_key, var)
        database = (
            "" if "GTM_DEMO_VAR" not in os.environ else (f" --database-url {settings.database_url}")
        )
        print(
            f"\nTry: dig @127.0.0.1 -p {dns_port} chat.eu.gtm.example A "
            "+subnet=203.0.113.0/24\n"
            f"     curl -sS -L -H 'Host: chat.eu.gtm.example' -H 'X-Forwarded-For: 8.8.8.8'"
            f' -d \'{{"model":"llama-3-8b","messages":[{{"role":"user",'
            f'"content":"hi"}}]}}\' http://127.0.0.1:{http_port}/v1/chat/completions\n'
            f"     .venv/bin/gtm audit tail{database}\n"
            f"     .venv/bin/gtm region status{database}\n"
            f"The admin CLI (proposals, drains) reads its server and token from the environment:\n"
            f"     export GTM_ADMIN_URL=http://127.0.0.1:{admin_port}\n"
            f"     export GTM_ADMIN_TOKEN=$(awk '$1 == \"demo-operator\" {{print $2}}' "
            f"{var / 'demo-tokens'})\n"
            f'     .venv/bin/gtm region drain eu-west --why "trying a drain" --for 10m'
        )
        if not once:
            print(
                "\nServing until Ctrl-C. Client traffic flows on the map and completions stream "
                "through every balancer;\nevery 20 s the scenario moves on (ap-south fails and "
                "returns, us-east fills and spills)."
            )
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            watched = [
                asyncio.create_task(scenario.client_traffic(dns_port, stop)),
                asyncio.create_task(scenario.steady_load(fleet.balancers, stop)),
                asyncio.create_task(
                    scenario.scenario(
                        fleet,
                        engine,
                        lambda r: node.runtime.store.current.health[r].state.value,
                        stop,
                        print,
                    )
                ),
            ]
            await stop.wait()
            await asyncio.gather(*watched, return_exceptions=True)
            await scenario.restore(fleet, engine, regions, holder)
            print("Stopped with the fleet whole: no balancer left down, no override left set.")
    finally:
        stop.set()
        await task


async def show_console(
    node: Node, ports: tuple[int, int, int], private_key: Path, var: Path
) -> None:
    dns_port, http_port, admin_port = ports
    heading("The console: sign in as one of the demo's people")
    engine = node.runtime.engine
    tokens = await scenario.issue_tokens(engine, private_key, time.time())
    scenario.write_tokens(var / "demo-tokens", tokens)
    url = f"http://127.0.0.1:{admin_port}/console/"
    print(f"console: {url}")
    print(
        f"  (admin API docs: http://127.0.0.1:{admin_port}/docs; Prometheus metrics: "
        f"http://127.0.0.1:{http_port}/metrics)"
    )
    for name, (roles, token) in tokens.items():
        print(f"  {name:<14} {', '.join(roles):<38} {token}")
    print(f"  (the same tokens are in {var / 'demo-tokens'}, mode 0600; valid for 24 h)")
    admin_url = f"http://127.0.0.1:{admin_port}"
    proposal = await scenario.propose(admin_url, tokens["demo-author"][1])
    if proposal is not None:
        print(
            f"demo-author proposed letting EU personal data into the US (proposal #{proposal}); "
            f"it waits for demo-approver, whose impact view shows what would leave the EU: "
            f"{url}policies/{proposal}"
        )
        own = await scenario.approve_own(admin_url, tokens["demo-author"][1], proposal)
        print(
            f"four-eyes: demo-author holds policy-approver too and tried to approve #{proposal}: "
            f"{own}"
        )
        print(
            "  (activating it, demo-approver is first shown the answers that would leave their "
            "jurisdiction, and must acknowledge them)"
        )
    # A moment of traffic, so the first look at the map has flows on it.
    burst = asyncio.Event()
    sending = asyncio.create_task(scenario.client_traffic(dns_port, burst, per_s=100))
    await asyncio.sleep(2.0)
    burst.set()
    sent = await sending
    auditor = tokens["demo-auditor"][1]
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{admin_port}",
        headers={"authorization": f"Bearer {auditor}"},
    ) as api:
        for _ in range(50):  # the writer flushes about every second
            flows = (await api.get("/v1/traffic", params={"window_s": 30})).json()
            if flows["answers"] >= sent:
                break
            await asyncio.sleep(0.2)
    countries = {f["country"] for f in flows["flows"] if f["country"]}
    print(
        f"live traffic on the map: {flows['answers']} answers in the last 30 s from "
        f"{len(countries)} countries ({', '.join(sorted(countries))})"
    )


async def until_up(node: Node, count: int, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        health = node.runtime.store.current.health
        if sum(h.state is HealthState.UP for h in health.values()) >= count:
            print(f"GTM probes: all {count} regions up")
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("regions did not come up; see the balancer logs")


async def ask_dns(port: int, name: str, rdtype: str, subnet: str) -> dns.message.Message:
    address, prefix = subnet.split("/")
    query = dns.message.make_query(
        name, rdtype, use_edns=0, options=[dns.edns.ECSOption(address, int(prefix))]
    )
    return await dns.asyncquery.udp(query, "127.0.0.1", port=port, timeout=3)


def shown(reply: dns.message.Message) -> str:
    # Addresses and CNAME targets as they are, other data (MX, SRV, CAA) whole; an SOA by name.
    items = [
        item.to_text().split()[0] if rrset.rdtype == dns.rdatatype.SOA else item.to_text()
        for rrset in reply.answer
        for item in rrset
    ]
    if items:
        return ",".join(items)
    # An empty NOERROR is how a residency rule fails closed over DNS (dns_failure: nodata).
    return "NODATA" if reply.rcode() == dns.rcode.NOERROR else dns.rcode.to_text(reply.rcode())


async def show_dns(port: int) -> None:
    heading(f"Authoritative DNS on 127.0.0.1:{port} (UDP and TCP)")
    print(f"{'question':<36} {'client subnet (ECS)':<22} {'answer':<18} ECS scope")
    for name, rdtype, subnet in (
        ("chat.gtm.example.", "A", "85.214.0.0/24"),
        ("chat.gtm.example.", "A", "49.36.0.0/24"),
        ("chat.gtm.example.", "AAAA", "8.8.8.0/24"),
        ("chat.eu.gtm.example.", "A", "8.8.8.0/24"),
        ("chat.eu.gtm.example.", "A", "133.11.0.0/24"),
        ("gtm.example.", "SOA", "85.214.0.0/24"),
        # Static records (zone.records): the same for everyone; a CNAME into a service name
        # ends with that service's decision for the client.
        ("gtm.example.", "MX", "85.214.0.0/24"),
        ("_submission._tcp.gtm.example.", "SRV", "85.214.0.0/24"),
        ("api.gtm.example.", "A", "49.36.0.0/24"),
        ("nope.gtm.example.", "A", "85.214.0.0/24"),
    ):
        reply = await ask_dns(port, name, rdtype, subnet)
        scope = next((o.scopelen for o in reply.options if isinstance(o, dns.edns.ECSOption)), "-")
        print(f"{name + ' ' + rdtype:<36} {subnet:<22} {shown(reply):<18} /{scope}")


async def show_http(port: int, database_url: str) -> None:
    heading(f"HTTP front on 127.0.0.1:{port}: redirect, then the region's balancer answers")
    body = {
        "model": "llama-3-8b",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "Where is my data processed?"}],
    }
    decision_ids: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for host, client_ip, extra in (
            ("chat.eu.gtm.example", "8.8.8.8", {}),
            ("chat.gtm.example", "49.36.0.1", {}),
            ("chat.gtm.example", "85.214.0.1", {"X-Data-Residency": "kr-personal"}),
        ):
            headers = {"Host": host, "X-Forwarded-For": client_ip, **extra}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            first = await client.post(url, json=body, headers=headers)
            if "x-gtm-decision-id" in first.headers:
                decision_ids.append(first.headers["x-gtm-decision-id"])
            line = (
                f"POST {host} from {client_ip}{' + ' + str(extra) if extra else ''}: "
                f"{first.status_code}"
            )
            if first.status_code in (307, 308):
                final = await client.post(first.headers["location"], json=body)
                text = final.json()["choices"][0]["message"]["content"].strip()
                line += (
                    f" -> {first.headers['x-gtm-region']} {first.headers['location']}"
                    f" -> {final.status_code} {text!r}"
                )
            else:
                line += f" {first.text[:120]}"
            print(line)
    await show_curl(port, body)
    if decision_ids:
        await show_decision_id(decision_ids[0], database_url)


async def show_decision_id(decision_id: str, database_url: str) -> None:
    """What a compliance reader does with the id a response named: its audit row."""
    from gtm.audit.database import make_async_engine

    print(f"\nWhy the first answer? gtm audit show {decision_id}")
    engine = make_async_engine(database_url)
    try:
        for _ in range(30):  # the node writes its rows within a flush interval
            rows = await query.find_decision(engine, decision_id)
            if rows:
                break
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()
    for row in rows:
        print(explain_row(row))
    if not rows:
        print("  (not in the audit store yet)")


async def show_curl(port: int, body: dict[str, object]) -> None:
    """The same call as a user makes it: curl follows the 307 (method and body kept) through
    the front to the region's balancer and its simulated instance."""
    curl = shutil.which("curl")
    if curl is None:
        print("(curl is not installed: the end-to-end call above was made with httpx)")
        return
    argv = [
        curl, "-sS", "-L", "--max-time", "30",
        "-H", "Host: chat.eu.gtm.example", "-H", "X-Forwarded-For: 8.8.8.8",
        "-H", "Content-Type: application/json", "--data-binary", json.dumps(body),
        "-w", "\n%{num_redirects} redirect(s), answered by %{url_effective} (%{http_code})",
        f"http://127.0.0.1:{port}/v1/chat/completions",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        print(f"curl failed ({proc.returncode}): {err.decode().strip()}")
        return
    answer, _, summary = out.decode().rpartition("\n")
    content = json.loads(answer)["choices"][0]["message"]["content"].strip()
    print(f"curl -L POST chat.eu.gtm.example from 8.8.8.8: {summary}: {content!r}")


async def show_failover(node: Node, fleet: Fleet, dns_port: int, holder: ControlLog) -> None:
    heading("Failover: the eu-central balancer is killed")
    before = shown(await ask_dns(dns_port, "chat.gtm.example.", "A", "85.214.0.0/24"))
    fleet.kill("eu-central-lb")
    started = time.monotonic()
    while time.monotonic() - started < 15:
        after = shown(await ask_dns(dns_port, "chat.gtm.example.", "A", "85.214.0.0/24"))
        if after != before:
            print(
                f"a Berlin client's answer moved {before} -> {after} "
                f"{time.monotonic() - started:.1f} s after the kill (probe interval 0.5 s, "
                f"down after 3 failed probes)"
            )
            break
        await asyncio.sleep(0.1)
    else:
        print("the answer did not move within 15 s")
        return

    heading("Operator control: eu-west is drained too (who and why are recorded)")
    runtime = node.runtime
    await holder.refresh(runtime.engine)
    await operator.amend(
        runtime.engine,
        "eu-west",
        control=holder,
        by=BOOTSTRAP,
        actor="demo-operator",
        reason="GPU driver upgrade",
        now=time.time(),
        drain=True,
        expires_for_s=3600,
    )
    started = time.monotonic()
    for _ in range(100):  # within 5 s; a state sync is every 0.5 s
        if runtime.store.current.health["eu-west"].state is HealthState.DRAINING:
            break
        await asyncio.sleep(0.05)
    print(f"in force {time.monotonic() - started:.1f} s later (next state sync)")
    for name in ("chat.gtm.example.", "chat.eu.gtm.example."):
        reply = await ask_dns(dns_port, name, "A", "85.214.0.0/24")
        print(f"  Berlin asks {name:<22} -> {shown(reply)}")
    print("  (EU personal data has no EU region left: it fails closed, never leaves the EU)")
    await runtime.sync.sync_once()  # write the queued events now rather than in 0.5 s
    print("region events, newest first:")
    for event in await shared_state.read_events(runtime.engine, limit=6):
        change = f"{event.previous} -> {event.state}" if event.state else event.detail
        who = f" by {event.actor}: {event.reason}" if event.actor else ""
        print(f"  {event.node:<10} {event.region:<11} {event.kind:<9} {change}{who}")
