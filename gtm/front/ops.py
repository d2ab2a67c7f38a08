"""The front's operational endpoints: ``/livez``, ``/readyz`` and ``/metrics``.

Answered on the node's own hosts (its address, ``localhost``), never on a service's, whose
every path is traffic. Not decisions, so not counted in the audit store; counted in
``gtm_front_ops_requests``.
"""

from __future__ import annotations

from prometheus_client import generate_latest

from gtm.decision.snapshot import SnapshotStore
from gtm.front.metrics import FrontStats
from gtm.front.respond import Send, send_json

OPS_PATHS = frozenset({"/livez", "/readyz", "/metrics"})


class OpsEndpoints:
    """Liveness, readiness (ready once listening, not while draining) and metrics."""

    def __init__(self, store: SnapshotStore, stats: FrontStats) -> None:
        self.store = store
        self.stats = stats
        self.ready = False
        self.draining = False

    async def answer(self, path: str, send: Send) -> None:
        self.stats.ops += 1
        if path == "/livez":
            await send_json(send, 200, {"status": "live"}, [])
        elif path == "/readyz":
            ok = self.ready and not self.draining
            body = {
                "status": "ready" if ok else ("draining" if self.draining else "starting"),
                "snapshot_version": self.store.current.version,
            }
            await send_json(send, 200 if ok else 503, body, [])
        else:
            payload = generate_latest()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})


__all__ = ["OPS_PATHS", "OpsEndpoints"]
