"""One GTM node: the runtime and every listener configured, started and stopped together.

``gtm serve`` runs :func:`run_node` until SIGINT/SIGTERM; tests run it inside their own loop.
Shutdown is graceful: listeners stop taking queries first, then the audit writer flushes what
they counted (DESIGN.md rule 2).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog
from prometheus_client import start_http_server

from gtm.geodns.server import DnsServer, make_server, parse_listen
from gtm.geodns.stats import DnsStats, register, unregister
from gtm.runtime import Runtime
from gtm.settings import Settings

log = structlog.get_logger(__name__)


@dataclass
class Node:
    runtime: Runtime
    dns: DnsServer | None = None
    dns_stats: DnsStats = field(default_factory=DnsStats)


async def run_node(
    settings: Settings, stop: asyncio.Event, ready: asyncio.Future[Node] | None = None
) -> None:
    runtime = Runtime(settings)
    await runtime.start()
    node = Node(runtime)
    collector = register(node.dns_stats)
    try:
        if settings.dns_listen:
            node.dns = make_server(runtime, node.dns_stats)
            await node.dns.start()
        if settings.metrics_listen:
            host, port = parse_listen(settings.metrics_listen)
            start_http_server(port, addr=host)  # a daemon thread; scrapes never touch the loop
        log.info("gtm.ready", dns=[f"{h}:{p}" for h, p in node.dns.bound] if node.dns else [])
        if ready is not None:
            ready.set_result(node)
        await stop.wait()
    finally:
        if node.dns is not None:
            await node.dns.stop()
        unregister(collector)
        await runtime.stop()
