"""``POST /v1/capacity``: the signed capacity reports regional balancers push to the front.

A report is verified (signature, freshness, order: :mod:`gtm.fleet.capacity`) and folded into
the snapshot by the runtime. It is not a routing decision, so not an audit row; it is counted
in ``gtm_capacity_reports_total``. Served on the node's own hosts, never on a service's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gtm.fleet.capacity import Rejected
from gtm.front.connections import body_timed_out
from gtm.front.respond import Receive, Scope, Send, send_json
from gtm.metrics import CAPACITY_REPORTS
from gtm.runtime import Runtime

# Regional balancers push their signed capacity reports here (DESIGN.md "Interfaces").
CAPACITY_PATH = "/v1/capacity"
CAPACITY_MAX_BYTES = 64 * 1024


class CapacityEndpoint:
    """Takes pushed reports into one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.clock: Callable[[], float] = time.time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        signature = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"x-gtm-signature"), None
        )
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the balancer went away: no report, and no one to answer
            if message.get("more_body", False) and body_timed_out(scope):
                await send_json(
                    send,
                    408,
                    {
                        "error": "request_body_timeout",
                        "message": "the report did not arrive in time",
                    },
                    [(b"connection", b"close")],
                )
                return
            body += message.get("body", b"")
            if len(body) > CAPACITY_MAX_BYTES:
                CAPACITY_REPORTS.labels("too_large").inc()
                await send_json(
                    send,
                    413,
                    {"error": "too_large", "message": "a capacity report is a few hundred bytes"},
                    [],
                )
                return
            if not message.get("more_body", False):
                break
        result = self.runtime.intake.accept(body, signature, self.clock())
        if isinstance(result, Rejected):
            status = (
                401
                if result.reason.startswith("signature")
                else 409
                if result.reason.startswith(("replayed", "stale"))
                else 400
            )
            CAPACITY_REPORTS.labels("rejected").inc()
            await send_json(
                send, status, {"error": "report_rejected", "message": result.reason}, []
            )
            return
        self.runtime.apply_report(result)
        CAPACITY_REPORTS.labels("accepted").inc()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


__all__ = ["CAPACITY_MAX_BYTES", "CAPACITY_PATH", "CapacityEndpoint"]
