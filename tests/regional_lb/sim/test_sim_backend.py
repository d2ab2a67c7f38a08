"""The simulated inference server on loopback: OpenAI shapes, batching, KV, model loads."""

from __future__ import annotations

import asyncio
import time

import httpx

from regional_lb.upstream.load_signals import parse_metrics
from tests.regional_lb.conftest import chat, eventually, sim

CHAT = "/v1/chat/completions"


async def test_openai_shapes_health_models_and_metrics() -> None:
    async with (
        sim(models=("m1",), loadable=["m2"]) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        assert (await c.get("/health")).status_code == 200
        models = {m["id"]: m["loaded"] for m in (await c.get("/v1/models")).json()["data"]}
        assert models == {"m1": True, "m2": False}
        r = await c.post(CHAT, json=chat(max_tokens=6))
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == 6
        r = await c.post(CHAT, json=chat(model="unknown"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        chunks = []
        async with c.stream(
            "POST",
            CHAT,
            json=chat(max_tokens=4, stream=True, stream_options={"include_usage": True}),
        ) as s:
            chunks = [line async for line in s.aiter_lines() if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]" and '"usage"' in chunks[-2]
        text = (await c.get("/metrics")).text
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:generation_tokens_total",
        ):
            assert name in text
        assert parse_metrics(text, 0.0).running == 0


async def test_continuous_batching_slows_each_sequence_but_raises_throughput() -> None:
    async with (
        sim(gpu="T4", speedup=20.0) as (url, engine),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        t0 = time.monotonic()
        await c.post(CHAT, json=chat(max_tokens=100))
        alone = time.monotonic() - t0
        t0 = time.monotonic()
        await asyncio.gather(*(c.post(CHAT, json=chat(max_tokens=100)) for _ in range(8)))
        together = time.monotonic() - t0
        # 8 in one batch: slower than one alone, far faster than 8 one after another.
        assert alone < together < 8 * alone * 0.6
        assert engine.generation_total == 900


async def test_slots_and_kv_limit_make_requests_wait() -> None:
    async with (
        sim(gpu="T4", kv_tokens=300, speedup=20.0) as (url, engine),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        tasks = [asyncio.create_task(c.post(CHAT, json=chat(max_tokens=100))) for _ in range(4)]
        # Each needs ~105 KV tokens: only two fit in 300, the others wait.
        await eventually(lambda: len(engine.running) == 2 and len(engine.waiting) == 2)
        assert engine.kv_usage > 0.6
        text = (await c.get("/metrics")).text
        sig = parse_metrics(text, 0.0)
        assert sig.running == 2 and sig.waiting == 2
        await asyncio.gather(*tasks)
        assert engine.kv_used == 0


async def test_switching_model_pays_load_time_and_evicts_lru() -> None:
    async with (
        sim(
            models=("m1",), loadable=["m2", "m3"], max_loaded=2, load_time_s=10.0, speedup=20.0
        ) as (url, engine),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        t0 = time.monotonic()
        await c.post(CHAT, json=chat(model="m2", max_tokens=2))
        assert time.monotonic() - t0 >= 0.5  # 10 s / 20
        t0 = time.monotonic()
        await c.post(CHAT, json=chat(model="m2", max_tokens=2))
        assert time.monotonic() - t0 < 0.3  # loaded now
        await c.post(CHAT, json=chat(model="m3", max_tokens=2))
        assert list(engine.loaded) == ["m2", "m3"]  # m1 was least recently used
        assert engine.loads == 2


async def test_injected_failures_and_disconnect_frees_the_slot() -> None:
    async with sim(speedup=5.0) as (url, engine), httpx.AsyncClient(base_url=url, timeout=30) as c:
        await c.post("/sim/faults", json={"fail_next": 1})
        assert (await c.post(CHAT, json=chat())).status_code == 500
        assert (await c.post(CHAT, json=chat(max_tokens=2))).status_code == 200
        async with c.stream("POST", CHAT, json=chat(max_tokens=5000, stream=True)) as s:
            async for _ in s.aiter_lines():
                break
        await eventually(lambda: not engine.running and engine.kv_used == 0)
