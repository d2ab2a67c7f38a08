"""Diagnostic only: the front with the audit writer's work taken out.

Not a mode of the product (every response is counted there, rule 2). The benchmark runs it
beside the real front to show where the time goes: the gap between this and ``gtm`` is what the
audit writer costs on the front's event loop (building, chaining, spooling and inserting one
row per distinct decision each flush), the gap between this and ``bare-protocol`` is the
front's own request path (decisions, the answer cache, tallies). The front still tallies every
response on its cached answers; the writer is just never given them.

    python bench/http/front_uncounted.py 127.0.0.1:PORT   (settings from GTM_* variables)
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop

from gtm.audit.record import AuditRecord
from gtm.audit.writer import TallySource
from gtm.front.server import FrontServer
from gtm.logs import configure
from gtm.node import tune_for_latency
from gtm.runtime import Runtime
from gtm.settings import load_settings


def _uncounted(record: AuditRecord, n: int = 1) -> None:
    del record, n


def _not_drained(source: TallySource) -> None:
    del source


async def main(listen: str) -> None:
    settings = load_settings()
    configure(settings.log_format, settings.log_level)
    runtime = Runtime(settings)
    await runtime.start()
    runtime.writer.count = _uncounted  # type: ignore[method-assign]
    runtime.writer.add_source = _not_drained  # type: ignore[method-assign]
    tune_for_latency()  # the same process settings as `gtm serve`
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await FrontServer(runtime, listen).run(stop)
    finally:
        await runtime.stop()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
