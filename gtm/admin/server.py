"""The admin listener: uvicorn serving :func:`gtm.admin.app.create_app` in the node's loop.

Its own socket and its own server, apart from the answering listeners: a slow admin request
never holds up a DNS answer or a redirect, and the admin API can be bound to an internal address
while the answering listeners face the internet.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping

import structlog
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.exc import SQLAlchemyError

from gtm.admin import fleet_watch, oidc, scheduler
from gtm.admin.app import create_app
from gtm.admin.auth import AdminContext
from gtm.admin.console.oidc_signin import ConsoleOidc
from gtm.admin.oidc import OidcVerifier
from gtm.admin.signer import Signer, load_signer
from gtm.audit.watch import VerificationWatch
from gtm.control.anchor import ControlAnchor
from gtm.control.log import ControlLog, LogRefused
from gtm.decision.policy import policy_files
from gtm.errors import ConfigError, Problem
from gtm.fleet import roster
from gtm.fleet.state_sync import fence_slack_s
from gtm.listen import EmbeddedServer, parse_listen
from gtm.runtime import Runtime
from gtm.settings import Settings

log = structlog.get_logger(__name__)


def context_for(runtime: Runtime) -> AdminContext:
    settings = runtime.settings
    signer = (
        None
        if settings.document_signing_key is None
        else load_signer(settings.document_signing_key)
    )
    oidc_config = oidc.config_from(
        settings.admin_oidc_issuer, settings.admin_oidc_audience, settings.admin_oidc_jwks_url
    )
    files = (
        settings.config.read_text(encoding="utf-8"),
        {p.name: p.read_text(encoding="utf-8") for p in policy_files(settings.policies)},
    )
    return AdminContext(
        runtime.engine,
        settings.node_id,
        settings.policy_approvals,
        control_log_for(settings, signer, runtime.document_keys),
        signer,
        files=files,
        snapshot=lambda: runtime.store.current,
        live_within_s=roster.live_bound_s(
            settings.node_live_within_s, settings.state_sync_interval_s
        ),
        membership=lambda: _membership(runtime),
        fence_after_s=settings.fence_after_s,
        fence_slack_s=fence_slack_s(settings.state_sync_interval_s),
        oidc=None if oidc_config is None else OidcVerifier(oidc_config),
        checkpoints=settings.checkpoint_dir,
        checkpoint_sink=runtime.checkpoint_sink,
        console_key_file=settings.console_session_key_file,
        console_idle_s=settings.console_idle_timeout_s,
        console_oidc=console_oidc(settings),
    )


def _membership(runtime: Runtime) -> tuple[str, frozenset[str]]:
    gate = runtime.book.gate
    if gate is None or not gate.membership.voters:
        return ("none configured", frozenset())
    return (gate.membership.source, gate.membership.voters)


def control_log_for(
    settings: Settings, signer: Signer | None, keys: Mapping[str, Ed25519PublicKey]
) -> ControlLog:
    """The admin service's view of the control log: it writes with ``signer`` and keeps the
    highest entry it accepted beside its spool (gtm.control.watermark)."""
    return ControlLog(
        keys,
        signer,
        mark=settings.spool_dir.parent
        / "state"
        / f"{settings.spool_dir.name}-control-log.admin.json",
        public=None if signer is None else signer.public_key(),
    )


def console_oidc(settings: Settings) -> ConsoleOidc | None:
    """The console's identity-provider sign-in, when configured (all of it, and the admin API
    must accept the provider's access tokens, else no one could sign in that way)."""
    if settings.console_oidc_client_id is None:
        return None
    problems = [
        Problem(f"GTM_{name.upper()}", "", "required with GTM_CONSOLE_OIDC_CLIENT_ID")
        for name in ("console_oidc_authorize_url", "console_oidc_token_url", "admin_oidc_issuer")
        if getattr(settings, name) is None
    ]
    authorize, token = settings.console_oidc_authorize_url, settings.console_oidc_token_url
    if problems or authorize is None or token is None:
        raise ConfigError(problems)
    secret = settings.console_oidc_client_secret
    return ConsoleOidc(
        settings.console_oidc_client_id,
        authorize,
        token,
        None if secret is None else secret.get_secret_value(),
        settings.console_oidc_scope,
    )


async def _anchor_control_log(
    ctx: AdminContext, anchor: ControlAnchor, stop: asyncio.Event, interval_s: float = 1.0
) -> None:
    """Read the control log and checkpoint its verified head outside the database whenever it
    moved: a log cut back or wiped behind it is then a break `gtm audit verify` names."""
    while not stop.is_set():
        try:
            await ctx.control.refresh(ctx.engine)
            await anchor.checkpoint_if_moved()
        except Exception:  # a database or a sink away: the next round tries again
            log.warning("admin.control_anchor_failed", exc_info=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


def bind(listen: str) -> socket.socket:
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            [Problem("GTM_ADMIN_LISTEN", "", f"cannot listen on {host}:{port}: {exc}")]
        ) from exc
    return sock


async def serve_admin(
    runtime: Runtime,
    sock: socket.socket,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
) -> None:
    """Serve the admin API on ``sock`` until ``stop`` is set."""
    ctx = context_for(runtime)
    # Read and verify the whole log before serving (each request reads what follows); with the
    # database away the admin API still starts, and answers 503 until the log is read.
    try:
        await ctx.control.refresh(runtime.engine)
    except (SQLAlchemyError, OSError, LogRefused) as exc:
        log.warning("admin.control_log_unread", error=str(exc).splitlines()[0])
    app = create_app(ctx)
    host, port = sock.getsockname()[:2]

    def started() -> None:
        log.info("admin.listening", url=f"http://{host}:{port}")
        if ready is not None:
            ready.set()

    config = uvicorn.Config(
        app,
        loop="none",
        lifespan="off",
        ws="none",
        proxy_headers=False,
        server_header=False,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=5,
    )
    server = EmbeddedServer(config, started)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    stopping = asyncio.ensure_future(stop.wait())
    scheduled = asyncio.ensure_future(scheduler.run(app.state.admin, stop))
    anchor = ControlAnchor(
        ctx.control, runtime.checkpoint_sink, runtime.spool.key, runtime.spool.bound_store
    )
    anchored = asyncio.ensure_future(_anchor_control_log(ctx, anchor, stop))
    # The fleet's liveness and newest rollout as gauges (the alerts on a silent member and on
    # a rollout left pending read them).
    watched = asyncio.ensure_future(fleet_watch.run(app.state.admin, stop))
    background = [scheduled, anchored, watched]
    settings = runtime.settings
    if settings.audit_verify_interval_s > 0:
        watch = VerificationWatch(
            settings.database_url,
            runtime.checkpoint_sink,
            full_every_s=settings.audit_verify_full_every_s,
            live_within_s=ctx.live_within_s,
        )
        # GET /v1/audit/chains shows this node's latest pass (kept in memory, not in a table).
        app.state.audit_watch = watch
        background.append(asyncio.ensure_future(watch.run(stop, settings.audit_verify_interval_s)))
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving
    finally:
        stopping.cancel()
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not serving.done():
            server.should_exit = server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        sock.close()


__all__ = ["bind", "context_for", "serve_admin"]
