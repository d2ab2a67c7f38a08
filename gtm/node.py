"""One GTM node: the runtime and every listener configured, started and stopped together.

``gtm serve`` runs :func:`run_node` until SIGINT/SIGTERM; tests run it inside their own loop.
Shutdown is graceful: listeners stop taking queries first, then the audit writer flushes what
they counted (DESIGN.md rule 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import start_http_server
from pydantic import SecretStr
from sqlalchemy.exc import SQLAlchemyError

from gtm import tracing
from gtm.admin.server import bind as bind_admin
from gtm.admin.server import serve_admin
from gtm.anycast import Announcer, Bird, Rules, self_check
from gtm.audit import migrate
from gtm.front.server import serve_front
from gtm.geodns.cookies import new_secret
from gtm.geodns.groups import (
    Handoff,
    WorkerGroup,
    bind_worker_groups,
    close_share,
    handoff,
    received,
)
from gtm.geodns.server import DnsServer, make_server
from gtm.geodns.stats import DnsStats, register, unregister
from gtm.heap import HeapKeeper, settle_malloc
from gtm.listen import parse_listen
from gtm.logs import configure as configure_logs
from gtm.runtime import Runtime
from gtm.settings import Settings

log = structlog.get_logger(__name__)


@dataclass
class Node:
    runtime: Runtime
    dns: DnsServer | None = None
    dns_stats: DnsStats = field(default_factory=DnsStats)
    http_task: asyncio.Task[None] | None = None
    admin_task: asyncio.Task[None] | None = None


def tune_for_latency() -> None:
    """Process settings for answering paths that share the interpreter with background work.

    The objects loaded at start (topology, policy, GeoIP metadata, modules) live as long as the
    process: frozen, full garbage collections no longer walk them, which cut collection pauses
    from tens of milliseconds. The audit writer builds rows in threads; a shorter GIL switch
    interval hands the interpreter back to the event loop sooner (0.5 ms instead of 5 ms).
    """
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(0.0005)


def anycast_for(settings: Settings, runtime: Runtime, node: Node) -> Announcer:
    """The node's announcer: its own first DNS listener is what it checks."""
    assert settings.anycast_bird_socket is not None
    check = None
    if node.dns is not None and node.dns.bound:
        host, port = node.dns.bound[0]
        apex = runtime.store.current.topology.zone.apex

        def check() -> Awaitable[bool]:
            return self_check(host, port, apex)

    return Announcer(
        Bird(settings.anycast_bird_socket, settings.anycast_protocol),
        Rules(settings.anycast_fall, settings.anycast_max_db_loss_s),
        db_lost_s=lambda: runtime.sync.age_s,
        check=check,
        drain_file=settings.anycast_drain_file,
        interval_s=settings.anycast_check_interval_s,
    )


async def run_node(
    settings: Settings,
    stop: asyncio.Event,
    ready: asyncio.Future[Node] | None = None,
    *,
    reuse_port: bool = False,
    groups: dict[str, WorkerGroup] | None = None,
) -> None:
    # Before anything is built: the listeners take their tracers (or None) when they are made.
    traced = tracing.configure(settings)
    runtime = Runtime(settings)
    await runtime.start()
    tune_for_latency()
    node = Node(runtime)
    collector = register(node.dns_stats)
    keeper: asyncio.Task[None] | None = None
    announcer: Announcer | None = None
    if settings.gc_freeze_interval_s > 0:
        heap = HeapKeeper(settings.gc_freeze_interval_s, settings.gc_full_interval_s)
        keeper = asyncio.create_task(heap.run(), name="heap-keeper")
    try:
        if settings.dns_listen:
            node.dns = make_server(runtime, node.dns_stats, reuse_port=reuse_port, groups=groups)
            await node.dns.start()
        front_stop = asyncio.Event()
        if settings.http_listen:
            front_ready = asyncio.Event()
            node.http_task = asyncio.create_task(
                serve_front(
                    runtime,
                    settings.http_listen,
                    front_stop,
                    ready=front_ready,
                    reuse_port=reuse_port,
                ),
                name="http-front",
            )
            ready_wait = asyncio.create_task(front_ready.wait())
            await asyncio.wait([node.http_task, ready_wait], return_when=asyncio.FIRST_COMPLETED)
            ready_wait.cancel()
            if node.http_task.done():
                node.http_task.result()  # raises why the front could not start
        admin_stop = asyncio.Event()
        if settings.admin_listen:
            admin_ready = asyncio.Event()
            node.admin_task = asyncio.create_task(
                serve_admin(runtime, bind_admin(settings.admin_listen), admin_stop, admin_ready),
                name="admin-api",
            )
            ready_wait = asyncio.create_task(admin_ready.wait())
            await asyncio.wait([node.admin_task, ready_wait], return_when=asyncio.FIRST_COMPLETED)
            ready_wait.cancel()
            if node.admin_task.done():
                node.admin_task.result()  # raises why the admin API could not start
        if settings.metrics_listen:
            host, port = parse_listen(settings.metrics_listen)
            start_http_server(port, addr=host)  # a daemon thread; scrapes never touch the loop
        if settings.anycast_bird_socket is not None:
            announcer = anycast_for(settings, runtime, node)
            await announcer.start()
        log.info(
            "gtm.ready",
            dns=[f"{h}:{p}" for h, p in node.dns.bound] if node.dns else [],
            http=settings.http_listen,
            admin=settings.admin_listen,
        )
        if ready is not None:
            ready.set_result(node)
        await stop.wait()
    finally:
        if announcer is not None:
            await announcer.stop()  # the route goes first, while the listeners still answer
        if keeper is not None:
            keeper.cancel()  # and it unfreezes the heap
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        if node.admin_task is not None:
            admin_stop.set()
            with contextlib.suppress(Exception):
                await node.admin_task
        if node.http_task is not None:
            front_stop.set()  # answers in flight finish, and are counted, before the flush
            with contextlib.suppress(Exception):
                await node.http_task
        if node.dns is not None:
            await node.dns.stop()
        unregister(collector)
        await runtime.stop()
        if traced is not None:
            tracing.shutdown()  # exports the spans still buffered


def worker_settings(settings: Settings, index: int) -> Settings:
    """A worker's own identity: its audit chain and spool are separate from its siblings'."""
    return settings.model_copy(
        update={
            "node_id": f"{settings.node_id}/w{index}"[:64],
            "observer_id": settings.observer_id or settings.node_id,
            "spool_dir": settings.spool_dir / f"w{index}",
            # One vote, one observation key for the node's workers (not a key per spool).
            "health_signing_key": settings.health_key_path,
            # One sink for the node: each worker's chain files and key beside its siblings'.
            "audit_checkpoint_dir": settings.checkpoint_dir,
            # Only the first worker serves metrics on the shared port; each exports its own
            # counters through the default registry of its process.
            "metrics_listen": settings.metrics_listen if index == 0 else None,
            "admin_listen": settings.admin_listen if index == 0 else None,
            "migrate_on_start": settings.migrate_on_start and index == 0,
        }
    )


def run_loop(coro: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when it is installed (it is, with uvicorn[standard]): the DNS path is
    mostly event-loop overhead, which uvloop roughly halves."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def serve_forever(
    settings: Settings,
    *,
    reuse_port: bool = False,
    groups: dict[str, WorkerGroup] | None = None,
) -> None:
    """Run one node (or worker) until SIGINT/SIGTERM; ``groups``: its share of the UDP groups
    bound for every worker (gtm.geodns.groups)."""
    settle_malloc()  # before the loop and the threads it starts allocate

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_node(settings, stop, reuse_port=reuse_port, groups=groups)

    run_loop(main())


def _worker(settings: Settings, index: int, handed: Handoff | None = None) -> None:
    configure_logs(settings.log_format, settings.log_level)
    groups = received(handed) if handed is not None else None
    serve_forever(worker_settings(settings, index), reuse_port=True, groups=groups)


def worker_groups(settings: Settings) -> list[dict[str, WorkerGroup]] | None:
    """The UDP groups of every DNS listen address, bound here for every worker, where the
    workers protect established networks (gtm.geodns.groups); None where they do not, or
    where the kernel refused (logged): each worker then binds its own sockets."""
    if not (
        settings.dns_listen
        and settings.dns_fair_admission
        and settings.dns_established_networks > 0
        and settings.dns_udp_sockets >= 2
    ):
        return None
    return bind_worker_groups(
        settings.dns_listen,
        settings.workers,
        settings.dns_udp_sockets,
        settings.dns_established_networks,
    )


def shared_cookie_secret(settings: Settings) -> Settings:
    """``settings`` with one random DNS cookie secret for every worker when none is
    configured: the kernel spreads a resolver's queries over the workers by source port, and
    each must accept the cookies the others hand out. Passed to them with their settings
    (pickled to the spawned process, never in its environment or a log)."""
    if (
        not settings.dns_cookies
        or settings.dns_cookie_secret_file is not None
        or settings.dns_cookie_secret is not None
    ):
        return settings
    return settings.model_copy(update={"dns_cookie_secret": SecretStr(new_secret().strip())})


def _watch_workers(children: list[Any], lost: list[str], stopping: threading.Event) -> None:
    """Wait for the first worker to end; one that failed (not a clean stop) stops this
    process, so that the node ends and its supervisor starts it again whole. A worker gone
    leaves the port's socket group, and the kernel moves others' sockets into its places: the
    split group's layout (gtm.geodns.groups) no longer holds, nor do its clients' caches."""
    by_sentinel = {child.sentinel: child for child in children}
    for ended in multiprocessing.connection.wait(list(by_sentinel)):
        child = by_sentinel[ended]
        if stopping.is_set():
            return  # the node is stopping: it ended its workers (and reaps them)
        if child.exitcode != 0:  # it has ended: reaped here, its status kept for the stop
            lost.append(f"{child.name} exited with {child.exitcode}")
            log.error("gtm.worker_exited", worker=child.name, exitcode=child.exitcode)
            os.kill(os.getpid(), signal.SIGTERM)
        return


def serve_workers(settings: Settings) -> int:
    """``settings.workers`` processes on the same DNS and HTTP ports (SO_REUSEPORT): the kernel
    spreads clients over them by address and port. This process is worker 0; the schema is
    migrated once, here, before any worker starts. The exit status: 0 after a clean stop, 1
    when a worker failed (the others are stopped with it: :func:`_watch_workers`)."""
    migrated = False
    if settings.migrate_on_start:
        try:
            migrate.upgrade(settings.database_url)
            migrated = True
        except (SQLAlchemyError, OSError) as exc:
            # Worker 0 keeps trying once it runs (see Runtime.start); the others never do.
            log.error("gtm.database_unavailable", phase="migrate", error=str(exc).split("\n")[0])
    settings = settings.model_copy(
        update={"migrate_on_start": settings.migrate_on_start and not migrated}
    )
    settings = shared_cookie_secret(settings)
    shares = worker_groups(settings)
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(
            target=_worker,
            args=(settings, i, handoff(shares[i]) if shares is not None else None),
            name=f"gtm-dns-w{i}",
        )
        for i in range(1, settings.workers)
    ]
    lost: list[str] = []
    stopping = threading.Event()
    # Every worker started is stopped below, whatever fails after it started: a child left
    # running would hold this process at its exit (multiprocessing joins its children).
    try:
        for child in children:
            child.start()  # its sockets and the map are duplicated into it as it is spawned
        if shares is not None:
            for share in shares[1:]:
                close_share(share)
        threading.Thread(
            target=_watch_workers,
            args=(children, lost, stopping),
            name="gtm-worker-watch",
            daemon=True,
        ).start()
        serve_forever(
            worker_settings(settings, 0),
            reuse_port=True,
            groups=shares[0] if shares is not None else None,
        )
    finally:
        stopping.set()  # the workers' ends from here on are this stop's
        started = [child for child in children if child.pid is not None]
        for child in started:
            if child.is_alive():
                os.kill(child.pid or 0, signal.SIGTERM)
        for child in started:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    return 1 if lost else 0
