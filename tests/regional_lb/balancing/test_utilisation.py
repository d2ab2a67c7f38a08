"""The capacity report's utilisation sees saturation: batching, the KV cache, queues at the
instance and at the balancer. Pure properties first, then simulated instances on loopback."""

from __future__ import annotations

import asyncio
import copy
import itertools
import math
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from regional_lb.balancing.gpus import batch_throughput
from regional_lb.balancing.instance import InstanceState, SpeedLearner
from regional_lb.balancing.pick import PickParams
from regional_lb.balancing.utilisation import UTILISATION_CAP, instance_load, pool_utilisation
from regional_lb.capacity_report import CapacityReport
from regional_lb.upstream.pool import Pool
from tests.regional_lb.conftest import balancer, balancer_config, chat, eventually, idle, sim

CHAT = "/v1/chat/completions"
PARAMS = PickParams(slow_start_s=0.0)
# The balancer's one-token model probes are real requests on the instance and would show in
# its metrics; the figures below are exact without them.
NO_PING: dict[str, Any] = {"health": {"probe_model": False}}


def _inst(
    slots: int = 32,
    in_flight: int = 0,
    running: int | None = None,
    waiting: int | None = None,
    kv: float | None = None,
    speed: float = 1.0,
    max_concurrency: int = 64,
) -> InstanceState:
    inst = InstanceState(
        id="i",
        speed=SpeedLearner(unit_speed=speed, slots=slots, penalty=0.15),
        max_concurrency=max_concurrency,
    )
    for k in range(in_flight):
        inst.add(k, 1.0, 0.0)
    inst.apply_load(running, waiting, kv, 0.0)
    return inst


def test_figures_for_one_a100() -> None:
    def u(**kw: int | float | None) -> float:
        return pool_utilisation([_inst(**kw)], 0, 1.0, PARAMS)  # type: ignore[arg-type]

    assert u() == 0.0
    # 8 of 32 sequences: 69% of the batch's throughput ceiling, not a quarter of the slots.
    assert math.isclose(u(in_flight=8), batch_throughput(8, 0.15) / batch_throughput(32, 0.15))
    assert math.isclose(u(in_flight=32), 1.0)
    assert math.isclose(u(in_flight=48), 1.5)  # 16 more than fit: half a batch queued
    # KV-bound: 12 running fill 95% of the KV cache (the limit), 4 wait at the instance.
    assert math.isclose(u(in_flight=16, running=12, waiting=4, kv=0.95), 1 + 4 / 12)
    assert u(in_flight=12, running=12, waiting=0, kv=0.94) > 0.98
    assert u(in_flight=12, running=12, waiting=0, kv=0.10) < 0.8  # the same batch, KV free
    # Another replica's requests, seen only in the instance's metrics.
    assert math.isclose(u(running=32, waiting=8, kv=0.5), 1.25)


def test_one_slot_instances_report_the_slot_share_and_the_pool_weighs_by_capacity() -> None:
    a, b = _inst(slots=1, in_flight=1), _inst(slots=1)
    assert pool_utilisation([a, b], 0, 1.0, PARAMS) == 0.5
    assert pool_utilisation([a, b], 3, 1.0, PARAMS) == 0.5 + 3 / 2  # 3 queued, 2 slots
    fast, slow = _inst(slots=1, in_flight=1, speed=4.0), _inst(slots=1, speed=1.0)
    assert math.isclose(pool_utilisation([fast, slow], 0, 1.0, PARAMS), 0.8)
    assert pool_utilisation([], 0, 1.0, PARAMS) == UTILISATION_CAP  # nothing to serve with
    assert pool_utilisation([_inst(in_flight=64)], 500, 1.0, PARAMS) == UTILISATION_CAP


def test_concurrency_limit_and_slow_start_shrink_what_fits() -> None:
    capped = _inst(in_flight=2, max_concurrency=2)
    assert (
        instance_load(capped, 0.0, PARAMS).fits == 2
        and pool_utilisation([capped], 0, 0.0, PARAMS) == 1.0
    )
    ramping = _inst(in_flight=4)
    ramping.joined_at = 0.0
    ramp = PickParams(slow_start_s=10.0)  # 1 s in: a tenth of the slots
    assert instance_load(ramping, 1.0, ramp).fits == 3
    assert pool_utilisation([ramping], 0, 1.0, ramp) > 1.0


state_st = st.tuples(
    st.integers(1, 48),  # batch slots
    st.integers(0, 100),  # ours in flight
    st.none() | st.integers(0, 100),  # scraped running
    st.none() | st.integers(0, 100),  # scraped waiting
    st.none() | st.floats(0.0, 1.5),  # KV usage
    st.floats(0.05, 5.0),  # speed
    st.integers(1, 128),  # concurrency limit
)


def _build(s: tuple[int, int, int | None, int | None, float | None, float, int]) -> InstanceState:
    slots, n, running, waiting, kv, speed, conc = s
    return _inst(slots, n, running, waiting, kv, speed, conc)


@settings(max_examples=300, deadline=None)
@given(st.lists(state_st, min_size=1, max_size=6), st.integers(0, 500), st.integers(0, 5))
def test_bounded_and_monotone_in_queued_work(
    states: list[tuple[int, int, int | None, int | None, float | None, float, int]],
    queued: int,
    extra: int,
) -> None:
    pool = [_build(s) for s in states]
    u = pool_utilisation(pool, queued, 1.0, PARAMS)
    assert math.isfinite(u) and 0.0 <= u <= UTILISATION_CAP
    # More waiting at the balancer, or more waiting at an instance, never reads as less busy.
    assert pool_utilisation(pool, queued + extra, 1.0, PARAMS) >= u
    first = list(states[0])
    first[3] = (first[3] or 0) + extra
    more = [_build(tuple(first)), *pool[1:]]  # type: ignore[arg-type]
    assert pool_utilisation(more, queued, 1.0, PARAMS) >= u - 1e-12
    for inst in pool:
        load = instance_load(inst, 1.0, PARAMS)
        assert 0.0 <= load.busy <= 1.0 and load.fits >= 1.0
        assert load.utilisation >= load.busy


# -- on loopback -------------------------------------------------------------------------------


async def _report(c: httpx.AsyncClient) -> CapacityReport:
    r = await c.get("/gtm/capacity")
    assert r.status_code == 200
    return CapacityReport.model_validate_json(r.content)


_TAGS = itertools.count()


async def _hold_streams(url: str, n: int, body: dict[str, object]) -> list[asyncio.Task[None]]:
    """Start ``n`` streams and keep them open in the background (each fails loudly unless
    answered 200: see _finish). Each prompt starts with a tag of its own, so no two share a
    KV block in the instance's prefix cache and each takes its full share of KV memory."""

    async def one() -> None:
        mine = copy.deepcopy(body)
        messages = mine.get("messages")
        if isinstance(messages, list) and messages:
            content = str(messages[0]["content"])
            messages[0]["content"] = f"{next(_TAGS):04d}{content[4:]}"
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as c,
            c.stream("POST", CHAT, json=mine) as r,
        ):
            assert r.status_code == 200, r.status_code
            async for _ in r.aiter_bytes():
                pass

    return [asyncio.create_task(one()) for _ in range(n)]


async def _finish(tasks: list[asyncio.Task[None]], pool: Pool) -> None:
    """Stop the streams (none may have failed) and wait until the instances say they are
    empty again (a fresh scrape), so the next phase starts clean."""
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert not [r for r in results if not isinstance(r, asyncio.CancelledError | None)]
    try:
        await eventually(lambda: idle(pool))
    except AssertionError:
        inst = pool.instances[0]
        raise AssertionError(
            f"not idle: admission {pool.admission.running} {pool.admission.depth()}, "
            f"flights {list(inst.flights)} outstanding {inst.outstanding}"
        ) from None
    await eventually(lambda: all(i.scraped_running == 0 for i in pool.instances))


def _long_prompt(tokens: int, max_tokens: int) -> dict[str, object]:
    body = chat(max_tokens=max_tokens, stream=True)
    body["messages"] = [{"role": "user", "content": "x" * (4 * tokens - 4)}]
    return body


async def test_a_kv_bound_instance_reports_saturation() -> None:
    # Long contexts: 6 sequences of 2,000 + 400 tokens fill the KV cache of an instance
    # with 32 batch slots; a 7th waits at the instance.
    body = _long_prompt(2000, 400)
    seq_tokens = 2000 + 400
    async with (
        sim(speedup=5.0, kv_tokens=6 * seq_tokens + 200) as (u1, engine),
        balancer(balancer_config([u1], **NO_PING)) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        tasks = await _hold_streams(url, 7, body)
        inst = pool.instances[0]
        await eventually(lambda: inst.scraped_running == 6 and inst.scraped_waiting == 1)
        report = await _report(c)
        assert len(engine.running) == 6 and engine.kv_usage > 0.95
        assert inst.in_flight / inst.speed.slots < 0.25  # the slot share
        assert report.utilisation > 1.1  # saturated, and one request queued behind
        await _finish(tasks, pool)

        # The same six without the seventh: saturated, nothing queued.
        tasks = await _hold_streams(url, 6, body)
        await eventually(
            lambda: (
                inst.scraped_running == 6
                and inst.scraped_waiting == 0
                and (inst.kv_usage or 0) > 0.9
            )
        )
        report = await _report(c)
        assert 0.95 <= report.utilisation <= 1.1
        await _finish(tasks, pool)

    # Control: the same six on an instance with room in its KV cache are far from saturating it.
    async with (
        sim(speedup=5.0) as (u1, engine),
        balancer(balancer_config([u1], **NO_PING)) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        tasks = await _hold_streams(url, 6, body)
        inst = pool.instances[0]
        await eventually(lambda: inst.scraped_running == 6)
        report = await _report(c)
        assert report.utilisation < 0.7
        await _finish(tasks, pool)


async def test_requests_queued_at_the_balancer_raise_utilisation() -> None:
    tiers = [{"name": "standard", "max_utilisation": 1.0, "queue_limit": 10, "queue_timeout_s": 20}]
    async with sim(speedup=5.0) as (u1, _):
        cfg = balancer_config([u1], tiers=tiers, default_tier="standard", **NO_PING)
        cfg = cfg.model_copy(
            update={"instances": [cfg.instances[0].model_copy(update={"max_concurrency": 2})]}
        )
        async with (
            balancer(cfg) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=10) as c,
        ):
            body = chat(max_tokens=2000, stream=True)
            running = await _hold_streams(url, 2, body)
            await eventually(lambda: pool.admission.running == 2)
            full = (await _report(c)).utilisation
            assert math.isclose(full, 1.0)  # both places the balancer may use are taken
            waiting = await _hold_streams(url, 1, body)
            await eventually(lambda: pool.admission.depth()["standard"] == 1)
            report = await _report(c)
            assert report.queue_depth == {"standard": 1}
            assert math.isclose(report.utilisation, 1.5)  # one more request per 2 that fit
            await _finish(waiting + running, pool)
            assert (await _report(c)).utilisation == 0.0


async def test_requests_waiting_at_the_instance_count_from_its_metrics() -> None:
    # Another balancer replica fills a T4 (8 batch slots) and queues 4 more on it. (The model
    # probe is off anyway, but here it would matter: this balancer has nothing in flight there,
    # so a probe stuck behind the other replica's queue would count as a dead instance, see
    # regional_lb.balancing.health.busy_not_stuck.)
    async with sim(gpu="T4", speedup=5.0) as (u1, _):
        cfg = balancer_config([u1], **NO_PING)
        cfg = cfg.model_copy(
            update={"instances": [cfg.instances[0].model_copy(update={"gpu": "T4"})]}
        )
        async with (
            balancer(cfg) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=10) as c,
        ):
            inst = pool.instances[0]
            tasks = await _hold_streams(u1, 12, chat(max_tokens=2000, stream=True))
            await eventually(lambda: inst.scraped_running == 8 and inst.scraped_waiting == 4)
            assert inst.in_flight == 0  # none of it is ours
            report = await _report(c)
            assert math.isclose(report.utilisation, 1.5)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await eventually(lambda: inst.scraped_running == 0)
            assert (await _report(c)).utilisation == 0.0
