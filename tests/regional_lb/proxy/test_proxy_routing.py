"""The balancer in front of simulated instances on loopback: routing, input, admission,
reports and load signals."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack

import httpx
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families

from regional_lb.capacity_report import SIGNATURE_HEADER, CapacityReport, verify
from regional_lb.credentials import key_digest
from regional_lb.protocol.serving import running
from tests.regional_lb.conftest import (
    balancer,
    balancer_config,
    chat,
    eventually,
    idle,
    sim,
)

CHAT = "/v1/chat/completions"


async def test_unary_and_streaming_pass_through_and_release_work() -> None:
    async with (
        sim() as (u1, _),
        sim() as (u2, _),
        balancer(balancer_config([u1, u2])) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        t0 = time.perf_counter()
        r = await c.post(CHAT, json=chat(max_tokens=15))
        unary_s = time.perf_counter() - t0
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 15
        assert r.headers["x-regional-instance"] in {"i0", "i1"}
        arrivals: list[float] = []
        events: list[str] = []
        t0 = time.monotonic()
        async with c.stream("POST", CHAT, json=chat(max_tokens=200, stream=True)) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            async for line in s.aiter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    arrivals.append(time.monotonic() - t0)
        assert events[-1] == "data: [DONE]"
        assert len(events) == 200 + 2  # tokens, the finish chunk, [DONE]
        # Passed through as produced: the first token arrives long before the last.
        assert arrivals[0] < arrivals[-1] / 2
        await eventually(lambda: idle(pool))
        assert sum(i.completed for i in pool.instances) == 2
        # What the balancer adds is measured on the unary answer: part of what the client
        # waited (15 tokens on a simulated GPU), not all of it.
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families((await c.get("/metrics")).text)
            for s in family.samples
            if s.name.startswith("regional_lb_proxy_overhead_seconds_")
        }
        assert samples["regional_lb_proxy_overhead_seconds_count"] == 1
        assert 0 < samples["regional_lb_proxy_overhead_seconds_sum"] < unary_s / 2


async def test_models_are_aggregated_from_instances() -> None:
    async with sim(models=("a", "b")) as (u1, _), sim(models=("c",)) as (u2, _):
        cfg = balancer_config([u1, u2])
        cfg = cfg.model_copy(
            update={
                "instances": [
                    cfg.instances[0].model_copy(update={"models": []}),
                    cfg.instances[1].model_copy(update={"models": []}),
                ]
            }
        )
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            await eventually(lambda: all(i.loaded for i in pool.instances))
            r = await c.get("/v1/models")
            assert {m["id"] for m in r.json()["data"]} == {"a", "b", "c"}
            r = await c.post(CHAT, json=chat(model="c"))
            assert r.status_code == 200 and r.headers["x-regional-instance"] == "i1"


async def test_bad_input_is_a_4xx_and_counts_nothing() -> None:
    # No model probe: the instance's own counters must show that nothing reached it.
    cfg_extra = {"max_body_bytes": 2000, "health": {"probe_model": False}}
    async with (
        sim() as (u1, engine),
        balancer(balancer_config([u1], **cfg_extra)) as (url, pool),
        httpx.AsyncClient(base_url=url) as c,
    ):
        cases = [
            (b"{not json", 400),
            (b"[1, 2]", 400),
            (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400),
            (json.dumps({"model": "m1"}).encode(), 400),
            (json.dumps({**chat(), "max_tokens": -3}).encode(), 400),
            (json.dumps(chat(model="nope")).encode(), 404),
            (
                json.dumps(
                    {**chat(), "messages": [{"role": "user", "content": "x" * 5000}]}
                ).encode(),
                413,
            ),
        ]
        for body, status in cases:
            r = await c.post(CHAT, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:40], r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"]
            assert idle(pool)
        r = await c.post("/v1/embeddings", json={"model": "m1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert all(i.completed == 0 for i in pool.instances)
        assert engine.prompt_total == 0  # nothing reached the instance


async def test_embeddings_and_completions_route() -> None:
    async with (
        sim() as (u1, _),
        balancer(balancer_config([u1])) as (url, pool),
        httpx.AsyncClient(base_url=url) as c,
    ):
        r = await c.post("/v1/embeddings", json={"model": "m1", "input": ["a b c", "d"]})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"]
        r = await c.post(
            "/v1/completions",
            json={"model": "m1", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        await eventually(lambda: idle(pool))


async def test_capacity_report_signed_and_pushed() -> None:
    received: list[tuple[bytes, str]] = []
    gtm = FastAPI()

    @gtm.post("/v1/capacity")
    async def capacity(request: Request) -> dict[str, bool]:
        received.append((await request.body(), request.headers.get(SIGNATURE_HEADER, "")))
        return {"ok": True}

    secret = b"s3cret"
    async with running(gtm) as gtm_url, sim() as (u1, _):
        cfg = balancer_config([u1], gtm_urls=[gtm_url], report_interval_s=0.1)
        async with balancer(cfg, secret) as (url, _pool), httpx.AsyncClient(base_url=url) as c:
            r = await c.get("/gtm/capacity")
            assert r.status_code == 200
            assert verify(r.content, r.headers[SIGNATURE_HEADER], secret)
            report = CapacityReport.model_validate_json(r.content)
            assert report.region == "test-region" and report.can_take_work
            assert report.instances_healthy == 1 and report.capacity > 0
            await eventually(lambda: len(received) >= 3)
            seqs = []
            for body, sig in received[:3]:
                assert verify(body, sig, secret)
                assert not verify(body, sig, b"wrong")
                seqs.append(CapacityReport.model_validate_json(body).seq)
            assert seqs == sorted(seqs) and len(set(seqs)) == 3
            assert (await c.get("/livez")).status_code == 200
            assert (await c.get("/readyz")).status_code == 200


async def test_metrics_scrape_reconciles_and_goes_stale() -> None:
    sim_stack = AsyncExitStack()
    u1, engine = await sim_stack.enter_async_context(sim(speedup=2.0))
    try:
        async with (
            balancer(balancer_config([u1])) as (url, pool),
            httpx.AsyncClient(base_url=url) as c,
        ):
            inst = pool.instances[0]
            # Another balancer replica's requests: sent to the instance directly.
            async with httpx.AsyncClient(base_url=u1, timeout=30) as direct:
                tasks = [
                    asyncio.create_task(direct.post(CHAT, json=chat(max_tokens=400)))
                    for _ in range(3)
                ]
                await eventually(lambda: (inst.scraped_running or 0) >= 3)
                assert inst.in_flight == 0  # not ours, yet the picker now counts them
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            assert "regional_lb_pick_seconds_bucket" in (await c.get("/metrics")).text
            await eventually(lambda: inst.scraped_running == 0)
            # The instance goes away: its last scrape ages out instead of being trusted.
            await sim_stack.aclose()
            await eventually(lambda: inst.scraped_running is None and inst.kv_usage is None)
            assert not engine.running
    finally:
        await sim_stack.aclose()


async def test_overload_gives_429_with_retry_after() -> None:
    tiers = [{"name": "standard", "max_utilisation": 1.0, "queue_limit": 0, "queue_timeout_s": 5}]
    async with sim(speedup=5.0) as (u1, _):
        cfg = balancer_config([u1], tiers=tiers, default_tier="standard")
        cfg = cfg.model_copy(
            update={"instances": [cfg.instances[0].model_copy(update={"max_concurrency": 1})]}
        )
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=20) as c:
            first = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=400)))
            await eventually(lambda: pool.instances[0].in_flight == 1)
            r = await c.post(CHAT, json=chat(max_tokens=400))
            assert r.status_code == 429
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert (await first).status_code == 200
            await eventually(lambda: idle(pool))


async def test_queued_request_waits_then_runs_and_timeout_gives_429() -> None:
    tiers = [{"name": "standard", "max_utilisation": 1.0, "queue_limit": 5, "queue_timeout_s": 0.3}]
    async with sim(speedup=5.0) as (u1, _):
        cfg = balancer_config([u1], tiers=tiers, default_tier="standard")
        cfg = cfg.model_copy(
            update={"instances": [cfg.instances[0].model_copy(update={"max_concurrency": 1})]}
        )
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=20) as c:
            # A short request holds the only slot; the next waits in the queue and then runs.
            a = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=10)))
            await eventually(lambda: pool.admission.running == 1)
            b = await c.post(CHAT, json=chat(max_tokens=10))
            assert (await a).status_code == 200 and b.status_code == 200
            # A long one holds it past the queue timeout: the waiter gets a 429.
            long = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=300)))
            await eventually(lambda: pool.admission.running == 1)
            r = await c.post(CHAT, json=chat(max_tokens=10))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert (await long).status_code == 200
            await eventually(lambda: idle(pool))


async def test_tenant_rate_limit() -> None:
    # The tenant is whoever holds its key; since issue 19 an X-Tenant header names nobody.
    t1 = {"rate": 0.5, "burst": 2, "key_sha256": [key_digest("sk-t1-secret")]}
    async with sim() as (u1, _):
        cfg = balancer_config([u1], tenants={"t1": t1})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            as_t1 = {"Authorization": "Bearer sk-t1-secret"}
            codes = [(await c.post(CHAT, json=chat(max_tokens=2), headers=as_t1)) for _ in range(3)]
            assert [r.status_code for r in codes] == [200, 200, 429]
            assert int(codes[2].headers["retry-after"]) == 2  # 1 token at 0.5/s
            assert codes[2].json()["error"]["code"] == "rate_limit_exceeded"
            other = await c.post(CHAT, json=chat(max_tokens=2), headers={"X-Tenant": "t1"})
            assert other.status_code == 200  # not t1's bucket: the header proves nothing
            await eventually(lambda: idle(pool))


async def test_instance_joining_at_run_time_ramps_up_with_slow_start() -> None:
    async with sim(speedup=1.0) as (u0, _), sim(speedup=1.0) as (u1, _):
        cfg = balancer_config([u0], health={"slow_start_s": 3.0, "probe_model": False})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=30) as c:

            async def burst() -> int:
                rs = await asyncio.gather(
                    *(c.post(CHAT, json=chat(max_tokens=5)) for _ in range(12))
                )
                assert all(r.status_code == 200 for r in rs)
                return sum(r.headers["x-regional-instance"] == "new" for r in rs)

            r = await c.post("/admin/instances", json={"id": "new", "url": u1, "models": ["m1"]})
            assert r.status_code == 201
            assert (
                await c.post("/admin/instances", json={"id": "new", "url": u1})
            ).status_code == 409
            early = await burst()
            await asyncio.sleep(3.1)
            late = await burst()
            assert early < late  # a newcomer takes a growing share, not a full one at once
            await eventually(lambda: idle(pool))
            assert (await c.delete("/admin/instances/new")).status_code == 200
            assert [i.id for i in pool.instances] == ["i0"]
