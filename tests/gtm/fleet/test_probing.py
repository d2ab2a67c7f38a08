"""Probing real HTTP endpoints on loopback: answers follow region health and reported capacity."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml

from gtm.decision.model import Channel, DecisionRequest, Outcome, Reason
from gtm.decision.routing import decide
from gtm.decision.snapshot import HealthState
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.balancer import SECRET, FakeBalancer

# Probes every 0.2 s with a 0.15 s timeout, failover held to seconds, a one-second re-admission
# ramp sampled as it grows: measured alone, not beside other tests' load (`make test`).
pytestmark = pytest.mark.timing

INTERVAL = 0.2
DE = "198.51.100.0/24"
READMIT_S = 1.0


@pytest.fixture
async def fleet(
    tmp_path: Path, geoip_path: Path
) -> AsyncIterator[tuple[Runtime, dict[str, FakeBalancer]]]:
    balancers = {}
    data: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    data.setdefault("routing", {})["readmit_window_s"] = READMIT_S
    for region in data["regions"]:
        b = balancers[region["id"]] = FakeBalancer(region["id"])
        await b.start()
        region["probe_url"] = f"http://127.0.0.1:{b.port}/gtm/capacity"
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(data))
    runtime = Runtime(
        Settings(
            config=config,
            policies=(POLICIES,),
            geoip_path=geoip_path,
            database_url=f"sqlite:///{tmp_path / 'p.sqlite3'}",
            spool_dir=tmp_path / "spool",
            probe_interval_s=INTERVAL,
            probe_timeout_s=0.15,
            health_rise=2,
            health_fall=3,
            report_secret=SECRET,
        )
    )
    await runtime.start()
    try:
        yield runtime, balancers
    finally:
        await runtime.stop()
        for b in balancers.values():
            await b.stop()


def ask(runtime: Runtime, service: str = "chat"):  # type: ignore[no-untyped-def]
    req = DecisionRequest(
        Channel.DNS, ip_address("203.0.113.1"), service, service, ecs=ip_network(DE)
    )
    return decide(req, runtime.store.current, time.time())


async def until(check: Callable[[], bool], within: float) -> float:
    """Seconds until ``check`` held; fails after ``within``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def share_on(runtime: Runtime, region: str, networks: int = 256) -> float:
    """The share of German client networks answered with ``region``."""
    snapshot, now = runtime.store.current, time.time()
    return (
        sum(
            decide(
                DecisionRequest(
                    Channel.DNS,
                    ip_address("203.0.113.1"),
                    "chat",
                    "chat",
                    ecs=ip_network(f"100.{72 + i // 256}.{i % 256}.0/24"),
                ),
                snapshot,
                now,
            ).region
            == region
            for i in range(networks)
        )
        / networks
    )


def state(runtime: Runtime, region: str) -> HealthState | None:
    h = runtime.store.current.health.get(region)
    return h.state if h is not None else None


async def test_regions_come_up_and_report_capacity(fleet) -> None:  # type: ignore[no-untyped-def]
    runtime, _ = fleet
    await until(
        lambda: all(
            state(runtime, r) is HealthState.UP for r in ("eu-west", "eu-central", "us-east")
        ),
        3,
    )
    cap = runtime.store.current.capacity["eu-central"]
    assert cap.utilisation == pytest.approx(0.3) and not cap.spilling
    assert ask(runtime).region == "eu-central"


async def test_a_killed_balancer_is_routed_around_and_readmitted(fleet) -> None:  # type: ignore[no-untyped-def]
    runtime, balancers = fleet
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 3)
    port = balancers["eu-central"].port
    await balancers["eu-central"].stop()
    # fall=3 probes at 0.2 s intervals: about 0.6 s, bounded generously here.
    took = await until(lambda: ask(runtime).region == "eu-west", 3)
    assert state(runtime, "eu-central") is HealthState.DOWN and took < 2
    assert ask(runtime).ttl == 10  # failing over: short TTL
    await balancers["eu-central"].start(port)
    # Re-admitted gradually: a growing share of client networks comes back, never all at once.
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 3)
    shares = [share_on(runtime, "eu-central")]
    while shares[-1] < 1.0:
        await asyncio.sleep(0.05)
        shares.append(share_on(runtime, "eu-central"))
        assert len(shares) < 100, shares
    assert shares == sorted(shares)  # growing only: no client flips back and forth
    assert any(0.0 < s < 1.0 for s in shares), shares
    assert share_on(runtime, "eu-west") == 0.0


@pytest.mark.parametrize("mode", ["slow", "forged"])
async def test_slow_or_forged_counts_as_down(fleet, mode: str) -> None:  # type: ignore[no-untyped-def]
    runtime, balancers = fleet
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 3)
    balancers["eu-central"].utilisation = 0.99  # a forged report must not bring this in
    balancers["eu-central"].mode = mode
    await until(lambda: state(runtime, "eu-central") is HealthState.DOWN, 4)
    assert ask(runtime).region == "eu-west"
    if mode == "forged":
        assert runtime.store.current.capacity["eu-central"].utilisation == pytest.approx(0.3)
        assert runtime.intake.rejected >= 3


async def test_draining_and_refusing_take_effect_at_once(fleet) -> None:  # type: ignore[no-untyped-def]
    runtime, balancers = fleet
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 3)
    balancers["eu-central"].mode = "draining"
    took = await until(lambda: state(runtime, "eu-central") is HealthState.DRAINING, 2)
    assert took < 1 and ask(runtime).region == "eu-west"
    balancers["eu-central"].mode = "ok"
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 2)
    await until(lambda: share_on(runtime, "eu-central") == 1.0, 1 + READMIT_S)
    balancers["eu-central"].mode = "refuse"  # the balancer's own report says it cannot work
    moved: list[Any] = []
    await until(lambda: (d := ask(runtime)).region == "eu-west" and not moved.append(d), 2)
    # Answers moved on the first report, before the three failed probes that mark it DOWN.
    reasons = {c.region: c.reason for c in moved[0].candidates}
    assert reasons["eu-central"] is Reason.CANNOT_TAKE_WORK


async def test_overload_spills_and_residency_fails_closed(fleet) -> None:  # type: ignore[no-untyped-def]
    runtime, balancers = fleet
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 3)
    balancers["eu-central"].utilisation = 0.99
    await until(lambda: runtime.store.current.capacity["eu-central"].spilling, 2)
    spilled = sum(
        decide(
            DecisionRequest(
                Channel.DNS,
                ip_address("203.0.113.1"),
                "chat",
                "chat",
                ecs=ip_network(f"100.{72 + i // 256}.{i % 256}.0/24"),
            ),
            runtime.store.current,
            time.time(),
        ).region
        == "eu-west"
        for i in range(512)
    )
    assert 0.15 < spilled / 512 < 0.45  # share for u=0.99: (0.99-0.70)/0.99 = 29%
    for region in ("eu-west", "eu-central"):
        await balancers[region].stop()
    await until(lambda: ask(runtime, "chat-eu").outcome is Outcome.FAIL_CLOSED, 4)
    assert ask(runtime, "chat").region == "us-east"


async def test_flapping_within_the_thresholds_moves_no_answer(fleet) -> None:  # type: ignore[no-untyped-def]
    runtime, balancers = fleet
    await until(lambda: state(runtime, "eu-central") is HealthState.UP, 3)
    answers, version = set(), runtime.store.current.version
    assert runtime.prober is not None
    deadline = time.monotonic() + 20
    while runtime.prober.failures < 3 and time.monotonic() < deadline:
        # About one failed probe (fall is 3), then good ones: a flapping region. One failure
        # at a time leaves room for a probe that a loaded machine times out besides.
        balancers["eu-central"].mode = "forged"
        await asyncio.sleep(INTERVAL)
        balancers["eu-central"].mode = "ok"
        await asyncio.sleep(INTERVAL * 2)
        answers.add(ask(runtime).region)
    assert runtime.prober.failures >= 3  # it did flap
    assert answers == {"eu-central"} and state(runtime, "eu-central") is HealthState.UP
    assert runtime.store.current.version > version  # reports kept coming; health held still
