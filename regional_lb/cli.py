"""The ``regional-lb`` command: ``serve`` the balancer, run a ``sim-backend``, ``check`` a
configuration.

Exit codes: 0 success, 2 bad configuration or arguments (every problem printed).

Signals for ``serve``: SIGTERM or SIGINT drains the region (no new requests; streams in flight
finish) and exits once nothing is in flight or the grace period ends; SIGUSR1 toggles the
region's drain without exiting, so GTM sees ``draining`` in the capacity report.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from regional_lb import tracing
from regional_lb.balancing.gpus import GPUS, profile
from regional_lb.config import ReportSettings, load_config, split_listen
from regional_lb.errors import ConfigError
from regional_lb.logs import configure as configure_logs

app = typer.Typer(
    help="GTM regional tier: cost-aware balancer and simulated inference server.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when it is installed (it comes with uvicorn[standard]): the proxy's
    per-request overhead is mostly event-loop and socket work."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def _fail(exc: ConfigError) -> typer.Exit:
    for problem in exc.problems:
        typer.echo(f"error: {problem}", err=True)
    return typer.Exit(2)


def _listen(value: str) -> tuple[str, int]:
    try:
        return split_listen(value)
    except ValueError:
        raise ConfigError([f"--listen: expected HOST:PORT, got {value!r}"]) from None


@app.command()
def check(config: Annotated[Path, typer.Option("--config", help="balancer YAML")]) -> None:
    """Validate a balancer configuration and print a summary."""
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise _fail(exc) from None
    typer.echo(
        f"ok: region {cfg.region}, {len(cfg.instances)} instances, "
        f"tiers {', '.join(t.name for t in cfg.tiers)}"
    )


@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", help="balancer YAML")],
    listen: Annotated[
        str | None, typer.Option("--listen", help="HOST:PORT (overrides YAML)")
    ] = None,
    grace: Annotated[float, typer.Option("--grace", help="drain grace period, seconds")] = 60.0,
    log_format: Annotated[str, typer.Option("--log-format")] = "console",
) -> None:
    """Run the balancer (OpenAI-compatible proxy) for one region."""
    configure_logs(log_format)
    try:
        cfg = load_config(config)
        host, port = _listen(listen or cfg.listen)
    except ConfigError as exc:
        raise _fail(exc) from None
    try:
        traced = tracing.configure(cfg.region, tracing.from_environment())
    except ConfigError as exc:
        raise _fail(exc) from None
    except ValueError as exc:  # an OTEL_* value the SDK refuses outright
        raise _fail(ConfigError([f"tracing: {exc}"])) from None
    secret = ReportSettings().report_secret
    if cfg.gtm_urls and secret is None:
        typer.echo(
            "warning: REGIONAL_LB_REPORT_SECRET is unset; capacity reports are unsigned and GTM "
            "refuses them (set this region's key: gtm report-key REGION)",
            err=True,
        )
    try:
        run(_serve(cfg, host, port, secret.get_secret_value().encode() if secret else None, grace))
    finally:
        if traced is not None:
            tracing.shutdown()  # exports the spans still buffered


async def _serve(cfg: object, host: str, port: int, secret: bytes | None, grace: float) -> None:
    from regional_lb.config import BalancerConfig
    from regional_lb.protocol.serving import bind, make_server
    from regional_lb.proxy.app import create_app
    from regional_lb.upstream.pool import Pool

    assert isinstance(cfg, BalancerConfig)
    app_ = create_app(cfg, secret)
    # What start-up built (modules, the app, pydantic models: ~70k objects) lives as long as
    # the process. Frozen, it is left out of full collections, which otherwise walk all of
    # it (~30 ms each, a pause every request in flight would wear).
    gc.collect()
    gc.freeze()
    pool: Pool = app_.state.pool
    server = make_server(app_, graceful_s=int(grace))
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_term() -> None:
        pool.draining = True
        stopping.set()

    def on_usr1() -> None:
        pool.draining = not pool.draining

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_term)
    loop.add_signal_handler(signal.SIGUSR1, on_usr1)
    sock = bind(host, port)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    typer.echo(f"regional-lb {cfg.region} listening on http://{host}:{port}", err=True)
    waiter = asyncio.create_task(stopping.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if stopping.is_set():
        # Drain: new requests get 503 while streams in flight run to their end.
        deadline = loop.time() + grace
        # Polling is fine here: it runs once, at shutdown, at 10 Hz.
        while any(i.in_flight for i in pool.instances) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        server.should_exit = True
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    await task
    sock.close()


@app.command("hash-key")
def hash_key() -> None:
    """Print the SHA-256 of a client API key read from standard input, for a tenant's
    ``key_sha256`` (the key itself never goes into the YAML, nor onto a command line)."""
    from regional_lb.credentials import key_digest

    key = sys.stdin.readline().strip()
    if not key:
        typer.echo("error: no key on standard input", err=True)
        raise typer.Exit(2)
    typer.echo(key_digest(key))


@app.command("sim-backend")
def sim_backend(
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT")] = "127.0.0.1:8701",
    gpu: Annotated[str, typer.Option("--gpu", help=f"one of {', '.join(GPUS)}")] = "A100",
    models: Annotated[
        str, typer.Option("--models", help="comma-separated, loaded at start")
    ] = "llama-3-8b",
    loadable: Annotated[
        str, typer.Option("--loadable", help="more models loadable on demand")
    ] = "",
    max_loaded: Annotated[int, typer.Option("--max-loaded")] = 2,
    load_time: Annotated[float, typer.Option("--load-time", help="seconds to load a model")] = 20.0,
    speedup: Annotated[float, typer.Option("--speedup", help="divide every duration")] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    kind: Annotated[
        str, typer.Option("--kind", help="server to play: vllm, sglang, tgi, triton, openai")
    ] = "vllm",
    api_key_env: Annotated[
        str, typer.Option("--api-key-env", help="require the key in this variable on /v1")
    ] = "",
    block_size: Annotated[
        int, typer.Option("--block-size", help="tokens per KV block (vLLM's default 16)")
    ] = 16,
    kv_events: Annotated[
        str,
        typer.Option(
            "--kv-events", help="publish vLLM KV-cache events on this ZMQ endpoint (tcp://H:P)"
        ),
    ] = "",
    kv_events_topic: Annotated[
        str, typer.Option("--kv-events-topic", help="the events' topic frame (vLLM's topic)")
    ] = "",
) -> None:
    """Run a simulated OpenAI-compatible inference server (no GPU needed)."""
    from regional_lb.sim.engine import EngineConfig
    from regional_lb.sim.metrics import KINDS
    from regional_lb.sim.server import serve as serve_sim

    try:
        host, port = _listen(listen)
        gp = profile(gpu)
    except ConfigError as exc:
        raise _fail(exc) from None
    except KeyError as exc:
        typer.echo(f"error: --gpu: {exc.args[0]}", err=True)
        raise typer.Exit(2) from None
    if block_size < 1:
        typer.echo("error: --block-size: at least 1", err=True)
        raise typer.Exit(2)
    if kv_events and not kv_events.startswith(("tcp://", "ipc://")):
        typer.echo("error: --kv-events: a ZMQ endpoint, tcp://HOST:PORT or ipc://PATH", err=True)
        raise typer.Exit(2)
    if kind not in KINDS:
        typer.echo(f"error: --kind: one of {', '.join(KINDS)}", err=True)
        raise typer.Exit(2)
    if api_key_env and not os.environ.get(api_key_env):
        typer.echo(f"error: --api-key-env: environment variable {api_key_env} is not set", err=True)
        raise typer.Exit(2)
    cfg = EngineConfig(
        gpu=gp,
        models=[m for m in models.split(",") if m],
        loadable=[m for m in loadable.split(",") if m],
        max_loaded=max_loaded,
        load_time_s=load_time,
        speedup=speedup,
        seed=seed,
        kind=kind,
        api_key=os.environ.get(api_key_env) if api_key_env else None,
        block_size=block_size,
        kv_events_endpoint=kv_events or None,
        kv_events_topic=kv_events_topic,
    )
    typer.echo(
        f"sim-backend {gp.name} {models} on http://{host}:{port} (pid {os.getpid()})", err=True
    )
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_sim(cfg, host, port))


def main() -> None:  # pragma: no cover - console entry convenience
    sys.exit(app())
