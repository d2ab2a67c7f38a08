"""A node cut off from the fleet longer than its bound fences restricted traffic (it may hold
a residency policy the fleet has since tightened); unrestricted traffic keeps being served."""

from __future__ import annotations

import time
from ipaddress import ip_address
from pathlib import Path

from prometheus_client import REGISTRY

from gtm.decision.model import Outcome, Reason
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import Snapshot
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES

US = "203.0.113.10"


def ask(snapshot: Snapshot, service: str) -> tuple[Outcome, int, set[str]]:
    request = DecisionRequest(Channel.DNS, ip_address(US), service, service)
    d = decide(request, snapshot, time.time())
    return d.outcome, d.ttl, {c.reason.value for c in d.candidates}


async def test_a_node_cut_off_too_long_fences_restricted_traffic(
    tmp_path: Path, geoip_path: Path
) -> None:
    settings = Settings(
        config=DEMO,
        policies=(POLICIES,),
        geoip_path=geoip_path,
        database_url=f"sqlite:///{tmp_path / 'g.sqlite3'}",
        spool_dir=tmp_path / "spool",
        probes=False,
        fence_after_s=30,
    )
    runtime = Runtime(settings)
    await runtime.start()
    try:
        assert ask(runtime.store.current, "chat-eu")[0] is Outcome.ANSWER
        # The shared database has not answered for a minute: the sync's next round says so.
        runtime.sync.last_ok = time.time() - 60
        runtime.sync.recompose()
        outcome, ttl, reasons = ask(runtime.store.current, "chat-eu")
        assert outcome is Outcome.FAIL_CLOSED and ttl == 0 and Reason.FENCED.value in reasons
        assert ask(runtime.store.current, "chat")[0] is Outcome.ANSWER  # unrestricted: served
        assert REGISTRY.get_sample_value("gtm_fenced") == 1
        # Heard from again: unfenced at once.
        runtime.sync.last_ok = time.time()
        runtime.sync.recompose()
        assert ask(runtime.store.current, "chat-eu")[0] is Outcome.ANSWER
        assert REGISTRY.get_sample_value("gtm_fenced") == 0
    finally:
        await runtime.stop()


def test_a_short_ttl_fence_answers_restricted_traffic_briefly(snapshot: Snapshot) -> None:
    normal = ask(snapshot, "chat-eu")
    fenced = ask(snapshot.evolve(1000.0, fence="short_ttl"), "chat-eu")
    assert normal[0] is fenced[0] is Outcome.ANSWER
    assert fenced[1] == min(normal[1], snapshot.topology.routing.degraded_ttl) < normal[1]
    assert ask(snapshot.evolve(1000.0, fence="short_ttl"), "chat")[1] == ask(snapshot, "chat")[1]
