"""The HTTP front alone: ``python -m gtm.front --listen HOST:PORT [--workers N]``.

Settings come from ``GTM_*`` variables like every other command. With several workers each is a
process of its own on the same port (``SO_REUSEPORT``: the kernel spreads connections), with its
own runtime and an audit node id of its own (``NODE-wK``), since every node keeps its own hash
chain in the audit log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import subprocess
import sys

import uvloop

from gtm.errors import GTMError
from gtm.front.server import FrontServer
from gtm.logs import configure as configure_logging
from gtm.runtime import Runtime
from gtm.settings import load_settings


async def _serve(listen: str, reuse_port: bool, node_suffix: str) -> None:
    settings = load_settings()
    if node_suffix:
        settings = settings.model_copy(update={"node_id": settings.node_id + node_suffix})
    runtime = Runtime(settings)
    await runtime.start()
    # Everything loaded so far (topology, policy, libraries) lives as long as the process: keep
    # it out of the collector's generations, so collections triggered by the request path's
    # short-lived objects do not walk it again and again.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await FrontServer(runtime, listen, reuse_port=reuse_port).run(stop)
    finally:
        await runtime.stop()  # flushes every counted response to the audit store


def _workers(listen: str, workers: int) -> int:
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "gtm.front", "--listen", listen, "--worker", str(i)]
        )
        for i in range(workers)
    ]

    def forward(sig: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return max(child.wait() for child in children)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtm.front", description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT ([ADDR]:PORT for IPv6)")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        configure_logging(settings.log_format, settings.log_level)
        if args.workers > 1 and args.worker is None:
            return _workers(args.listen, args.workers)
        suffix = f"-w{args.worker}" if args.worker is not None else ""
        uvloop.run(_serve(args.listen, args.worker is not None, suffix))
    except GTMError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
