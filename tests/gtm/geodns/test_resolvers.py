"""Real recursive resolvers in front of the responder, on loopback: PowerDNS Recursor and unbound
(Debian packages pdns-recursor and unbound, installed by ``.ci/run``).

Each resolver is given the client's subnet by the test (ECS in the query, which both pass on to
the authority: ``use-incoming-edns-subnet`` / ``subnetcache``), forwards the zone to a node, and
is watched through a fail-closed period: the EU regions go down, the restricted name fails closed
through the resolver, the regions come back, and the resolver must give the geo answer again
within the failure's negative TTL (the routing's degraded TTL, 2 s here), polled with a generous
bound. With the failure's SOA at the zone's usual negative TTL (60 s), or a REFUSED that PowerDNS
Recursor turns into a throttled SERVFAIL for 60 s and more, neither happens in time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest
import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.fleet.region_state import Force
from tests.conftest import POLICIES
from tests.support import resolvers
from tests.support.control import KeyHolder
from tests.support.dns_peers import socket_dir
from tests.support.ports import free_tcp_udp_port
from tests.support.waiting import eventually

from .conftest import StartNode, port_of, write_topology
from .test_dig import require

DE, US = "198.51.100.0", "203.0.113.0"  # Frankfurt and Washington in the test GeoIP database
FAILURE_TTL = 2  # routing.degraded_ttl of the topology below: the fail-closed negative TTL
# How long a resolver may take past the negative TTL: generous, as the machine is shared.
SLACK_S = 8.0
NAME = "chat.eu.gtm.example."

StartResolver = Callable[[str, int], Awaitable[int]]


def pdns_recursor_argv(work: Path, port: int, auth: int, sockets: Path) -> list[str]:
    (work / "recursor.conf").write_text("")
    return [
        require("pdns_recursor"),
        f"--config-dir={work}",
        f"--socket-dir={sockets}",
        "--local-address=127.0.0.1",
        f"--local-port={port}",
        f"--forward-zones=gtm.example=127.0.0.1:{auth}",
        "--dont-query=",  # its default keeps it from asking loopback addresses
        # Pass the client's own ECS on to the zone's server (the test plays many clients).
        "--use-incoming-edns-subnet=yes",
        "--edns-subnet-allow-list=gtm.example",
        "--dnssec=off",
        "--hint-file=no",  # no root priming: nothing but the forwarded zone exists here
        "--security-poll-suffix=",
        "--daemon=no",
        "--threads=1",
        "--disable-syslog",
        "--write-pid=no",
    ]


def unbound_argv(work: Path, port: int, auth: int, sockets: Path) -> list[str]:
    del sockets  # its remote control is off: no socket
    return resolvers.unbound_argv(require("unbound"), work, port, auth)


ARGV = {"pdns_recursor": pdns_recursor_argv, "unbound": unbound_argv}


@pytest.fixture
async def start_resolver(tmp_path: Path) -> AsyncIterator[StartResolver]:
    """Start a resolver forwarding the zone to ``auth``; its port once it answers."""
    running = resolvers.Resolvers()
    stack = ExitStack()
    sockets = socket_dir(stack)

    async def answers(port: int) -> bool:
        return (await ask(port, "gtm.example.", "SOA")).rcode() == dns.rcode.NOERROR

    async def start(kind: str, auth: int) -> int:
        work = tmp_path / kind
        work.mkdir()
        port = free_tcp_udp_port()
        return await running.start(
            ARGV[kind](work, port, auth, sockets), work, port, answers, f"{kind} answering"
        )

    with stack:
        yield start
        await running.stop()


async def ask(
    port: int, name: str, rdtype: str = "A", ecs: str | None = None
) -> dns.message.Message:
    options = [dns.edns.ECSOption(ecs, 24)] if ecs else []
    query = dns.message.make_query(name, rdtype, use_edns=0, options=options)
    return await dns.asyncquery.udp(query, "127.0.0.1", port=port, timeout=2)


def addresses(r: dns.message.Message) -> set[str]:
    return {item.address for rrset in r.answer for item in rrset}


def fail_closed_with_nodata(tmp_path: Path) -> tuple[Path, tuple[Path, ...]]:
    """The demo topology with a short service TTL and degraded TTL, no re-admission ramp, and
    the policies with the EU rule failing closed as NODATA."""

    def change(data: dict[str, Any]) -> None:
        data["routing"]["degraded_ttl"] = FAILURE_TTL
        data["routing"]["readmit_window_s"] = 0
        for service in data["services"]:
            service["ttl"] = FAILURE_TTL  # the positive answers expire as soon

    topology = write_topology(tmp_path / "topology.yaml", change)
    policies = tmp_path / "policies"
    policies.mkdir()
    for source in sorted(POLICIES.glob("*.yaml")):
        doc = yaml.safe_load(source.read_text())
        for rule in doc.get("rules", ()):
            if "eu-personal" in rule["match"].get("residency_class", ()):
                rule["dns_failure"] = "nodata"
        (policies / source.name).write_text(yaml.safe_dump(doc))
    return topology, (policies,)


EU = ("eu-west", "eu-central")


async def force_eu(engine: AsyncEngine, down: bool, holder: KeyHolder) -> None:
    """The EU regions forced down, or cleared, as an operator does: through the shared
    database, which every node reads on its next state sync (a snapshot swapped in by hand
    would be replaced by the next sync's view)."""
    for region in EU:
        if down:
            await holder.amend(
                engine,
                region,
                actor="test",
                reason="fail-closed period",
                now=time.time(),
                force=Force.DOWN,
                force_for_s=600,
            )
        else:
            await holder.clear(engine, region, actor="test", reason="back", now=time.time())


@pytest.mark.parametrize("kind", sorted(ARGV))
async def test_resolver_recovers_from_fail_closed_within_the_negative_ttl(
    start_node: StartNode, start_resolver: StartResolver, tmp_path: Path, kind: str
) -> None:
    topology, policies = fail_closed_with_nodata(tmp_path)
    holder = KeyHolder(tmp_path / "keys")  # overrides are signed control-log entries
    node = await start_node(topology, policies=policies, document_keys=(holder.public,))
    port = await start_resolver(kind, port_of(node))

    # Geo answers by ECS through the resolver, each subnet its own (scope caching).
    assert addresses(await ask(port, NAME, ecs=DE)) == {"192.0.2.40"}  # Frankfurt
    assert addresses(await ask(port, "chat.gtm.example.", ecs=US)) == {"192.0.2.10"}

    await force_eu(node.runtime.engine, down=True, holder=holder)
    seen: list[dns.message.Message] = []

    async def failed_closed() -> bool:
        reply = await ask(port, NAME, ecs=DE)
        seen.append(reply)
        return reply.rcode() == dns.rcode.NOERROR and not reply.answer

    # The cached answer lives out its TTL first.
    await eventually(failed_closed, within=FAILURE_TTL + SLACK_S, what=f"{kind}: fail-closed")
    negative = seen[-1]
    soa = [rrset for rrset in negative.authority if rrset.rdtype == dns.rdatatype.SOA]
    assert soa and soa[0].ttl <= FAILURE_TTL  # the resolver caches the failure that long only
    # Never an address outside the allowed set, for any client, through the resolver.
    for ecs in (DE, US):
        assert not addresses(await ask(port, NAME, ecs=ecs))

    await force_eu(node.runtime.engine, down=False, holder=holder)  # the EU regions are back

    async def recovered(ecs: str, expected: set[str]) -> bool:
        return addresses(await ask(port, NAME, ecs=ecs)) == expected

    await eventually(
        lambda: recovered(DE, {"192.0.2.40"}),
        within=FAILURE_TTL + SLACK_S,
        what=f"{kind}: the geo answer again after the regions came back",
    )
    # A client subnet the resolver asked about during the failure comes back as soon; the
    # Washington client's nearest EU region is Dublin.
    await eventually(
        lambda: recovered(US, {"192.0.2.30"}),
        within=FAILURE_TTL + SLACK_S,
        what=f"{kind}: a second subnet recovered",
    )


@pytest.mark.parametrize("kind", sorted(ARGV))
async def test_resolver_retries_a_truncated_answer_over_tcp(
    start_node: StartNode, start_resolver: StartResolver, tmp_path: Path, kind: str
) -> None:
    """An answer too big for UDP is sent truncated; the resolver fetches it whole over TCP."""

    def many_addresses(data: dict[str, Any]) -> None:
        for region in data["regions"]:
            region["ipv6"] = [f"{region['ipv6'][0][:-1]}{i:x}" for i in range(1, 61)]

    node = await start_node(write_topology(tmp_path / "big.yaml", many_addresses))
    port = await start_resolver(kind, port_of(node))
    query = dns.message.make_query(
        NAME, "AAAA", use_edns=0, payload=4096, options=[dns.edns.ECSOption(DE, 24)]
    )
    reply = await dns.asyncquery.tcp(query, "127.0.0.1", port=port, timeout=5)
    assert reply.rcode() == dns.rcode.NOERROR and len(addresses(reply)) == 60
    await node.runtime.writer.flush()  # the stats of repeats are folded in at the flush
    assert node.dns_stats.truncated >= 1  # the resolver asked over UDP first
    tcp_answers = sum(n for (t, _, _), n in node.dns_stats.queries.items() if t == "tcp")
    assert tcp_answers >= 1  # the resolver came back over TCP
