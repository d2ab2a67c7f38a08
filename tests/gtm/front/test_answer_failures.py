"""An exception on the HTTP front's answering path (gtm.failures): answered 500 and counted,
every one, by path and type; one log line for the interval; other clients answered as usual."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

import gtm.front.answers
import gtm.front.app
from gtm.decision.routing import DecisionRequest, decide
from tests.gtm.front.conftest import FrontFactory

CHAT = "chat.gtm.example"
BAD = "203.0.113.66"  # the client whose decisions raise (an injected bug)
GOOD = "198.51.100.7"


def _failures(error: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "gtm_answer_failures_total", {"path": "front.decide", "error": error}
        )
        or 0.0
    )


async def test_a_decision_that_raises_is_a_counted_500_logged_once(
    start_front: FrontFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def raising(request: DecisionRequest, *args: Any) -> Any:
        if str(request.client) == BAD:
            raise ZeroDivisionError("injected")
        return decide(request, *args)

    monkeypatch.setattr(gtm.front.app, "decide", raising)
    monkeypatch.setattr(gtm.front.answers, "decide", raising)
    before = _failures("ZeroDivisionError")
    async with (
        start_front() as front,
        httpx.AsyncClient(base_url=front.url, follow_redirects=False, trust_env=False) as http,
    ):
        front.runtime.failures.interval_s = 3600  # the whole test is one interval
        with capture_logs() as logs:
            for _ in range(40):
                bad = await http.get("/", headers={"host": CHAT, "x-forwarded-for": BAD})
                assert bad.status_code == 500
                good = await http.get("/", headers={"host": CHAT, "x-forwarded-for": GOOD})
                assert good.status_code == 307 and good.headers["x-gtm-region"] == "eu-central"
    assert _failures("ZeroDivisionError") - before == 40
    lines = [e for e in logs if e["event"] == "answer.failed"]
    assert len(lines) == 1
    assert lines[0]["path"] == "front.decide" and lines[0]["error_type"] == "ZeroDivisionError"
    assert lines[0]["location"].startswith(f"{__name__}:")
    assert "ZeroDivisionError: injected" in lines[0]["exception"]
