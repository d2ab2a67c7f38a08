"""Probes and load signals per server kind, against the simulator playing vLLM (with an API
key), TGI and Triton (metrics on a port of their own); readiness that costs no inference; the
opt-in model check; and streams that wait in the server's queue without being cut as stalls.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from regional_lb.config import parse_config
from regional_lb.protocol.serving import running
from regional_lb.sim.server import create_metrics_app
from regional_lb.upstream.load_signals import parse_metrics
from regional_lb.upstream.profiles import upstream_for
from tests.regional_lb.conftest import balancer, balancer_config, chat, eventually, idle, sim

KEY = "sk-vllm-" + "k" * 32


def _with(cfg: Any, **instance: Any) -> Any:
    return cfg.model_copy(
        update={"instances": [i.model_copy(update=instance) for i in cfg.instances]}
    )


async def test_vllm_with_an_api_key_needs_credentials_on_probes_and_scrapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLB_TEST_VLLM_KEY", KEY)
    async with sim(api_key=KEY) as (u1, engine):
        # Without credentials (the only way before issue 19) the model list is refused:
        # the instance never comes into service.
        async with balancer(balancer_config([u1])) as (_, pool):
            await eventually(lambda: not pool.instances[0].healthy, within=5)
        auth = {"token": {"env": "RLB_TEST_VLLM_KEY"}}
        async with (
            balancer(balancer_config([u1], upstream_auth=auth)) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=20) as c,
        ):
            inst = pool.instances[0]
            await eventually(lambda: inst.healthy and inst.probe_ok_at is not None)
            # A queue at the server shows up as its waiting count, read with the key.
            for _ in range(40):  # an A100 batches 32: 8 wait
                engine.submit("m1", 10, 2000, exact=True)
            await eventually(lambda: inst.scraped_waiting == 8 and inst.scraped_running == 32)
            r = await c.get("/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "m1"


async def test_readiness_costs_no_inference_and_the_model_check_is_opt_in_and_rare() -> None:
    async with sim() as (u1, engine):
        async with balancer(balancer_config([u1])) as (_, pool):
            inst = pool.instances[0]
            first = inst.probe_ok_at
            await eventually(lambda: inst.probe_ok_at is not None and inst.probe_ok_at != first)
            await eventually(lambda: (inst.probe_ok_at or 0) > (first or 0) + 0.5, within=10)
        assert engine.generation_total == 0 and engine.prompt_total == 0
        health = {"probe_model": True, "model_probe_interval_s": 3600}
        async with balancer(balancer_config([u1], health=health)) as (_, pool):
            inst = pool.instances[0]
            await eventually(lambda: inst.probe_ok_at is not None)
            seen = inst.probe_ok_at
            await eventually(lambda: (inst.probe_ok_at or 0) > (seen or 0) + 0.5, within=10)
        assert engine.generation_total == 1  # one model check in all those probes


async def test_an_embedding_only_instance_is_checked_with_an_embedding() -> None:
    async with sim(models=("e5",)) as (u1, engine):
        # An embedding server has no completions route: the model check must not use it.
        engine.check_model("e5")
        health = {"probe_model": True, "model_probe_interval_s": 3600}
        cfg = _with(balancer_config([u1], health=health), task="embed", models=["e5"])
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            await eventually(lambda: engine.prompt_total > 0)
            assert engine.generation_total == 0 and pool.instances[0].healthy
            r = await c.post("/v1/embeddings", json={"model": "e5", "input": "x"})
            assert r.status_code == 200


async def test_tgi_shapes_are_read_as_tgi() -> None:
    async with sim(kind="tgi") as (u1, engine):
        cfg = _with(balancer_config([u1]), kind="tgi")
        async with balancer(cfg) as (_, pool):
            inst = pool.instances[0]
            await eventually(lambda: inst.probe_ok_at is not None)
            for _ in range(40):
                engine.submit("m1", 10, 2000, exact=True)
            await eventually(lambda: (inst.scraped_running, inst.scraped_waiting) == (32, 8))


async def test_triton_readiness_path_and_metrics_on_their_own_port() -> None:
    async with sim(kind="triton") as (u1, engine):
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{u1}/health")).status_code == 404  # Triton has no /health
            assert (await c.get(f"{u1}/v2/health/ready")).status_code == 200
        async with running(create_metrics_app(engine, "triton")) as metrics_url:
            cfg = _with(balancer_config([u1]), kind="triton", metrics_url=f"{metrics_url}/metrics")
            async with balancer(cfg) as (_, pool):
                inst = pool.instances[0]
                await eventually(lambda: inst.healthy and inst.probe_ok_at is not None)
                # Pending requests are waiting ones (Triton's meaning), not running ones.
                for _ in range(40):  # more than an A100's 32 slots: 8 must wait
                    engine.submit("m1", 10, 2000, exact=True)
                await eventually(lambda: (inst.scraped_running, inst.scraped_waiting) == (32, 8))


def test_profiles_default_paths_and_triton_metrics_port() -> None:
    cfg = parse_config(
        {
            "region": "r",
            "instances": [
                {"id": "v", "url": "http://10.0.0.1:8000"},
                {"id": "t", "url": "http://10.0.0.2:8000", "kind": "triton"},
                {"id": "g", "url": "http://10.0.0.3:8080/", "kind": "tgi"},
                {"id": "o", "url": "http://10.0.0.4:9000", "kind": "openai"},
            ],
        }
    )
    v, t, g, o = (upstream_for(i, cfg) for i in cfg.instances)
    assert (v.health_url, v.metrics_url) == (
        "http://10.0.0.1:8000/health",
        "http://10.0.0.1:8000/metrics",
    )
    assert t.health_url == "http://10.0.0.2:8000/v2/health/ready"
    assert t.metrics_url == "http://10.0.0.2:8002/metrics"
    assert g.health_url == "http://10.0.0.3:8080/health"
    # Readiness is never the model list (llama-cpp-python ends running streams on it).
    assert o.health_url == "http://10.0.0.4:9000/health" and o.metrics_url is None
    assert o.readiness_optional and o.listing_disturbs
    triton = (
        'nv_inference_pending_request_count{model="m",version="1"} 7\n'
        'nv_trt_llm_request_metrics{request_type="active"} 3\n'
        'nv_trt_llm_request_metrics{request_type="max"} 64\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"} 25\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 100\n'
    )
    s = parse_metrics(triton, 0.0, "triton")
    assert (s.running, s.waiting, s.kv_usage) == (3, 7, 0.25)
    sglang = "sglang:num_running_reqs 5\nsglang:num_queue_reqs 2\nsglang:token_usage 0.5\n"
    s = parse_metrics(sglang, 0.0, "sglang")
    assert (s.running, s.waiting, s.kv_usage) == (5, 2, 0.5)
    # vLLM's names mean nothing to a Triton instance: no guessing across kinds.
    assert parse_metrics("vllm:num_requests_running 4\n", 0.0, "triton").running is None


async def test_streams_queued_at_the_server_are_not_cut_as_stalls() -> None:
    # A T4 batches 8; 16 streams go to it at once (its concurrency limit is 16), so 8 wait in
    # its queue with their headers sent and no token, for longer than the stall timeout.
    async with sim(gpu="T4") as (u1, engine):
        cfg = _with(
            balancer_config([u1], health={"stall_timeout_s": 0.5, "probe_interval_s": 30}),
            gpu="T4",
        )
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=60) as c:

            async def one() -> list[str]:
                body = chat(max_tokens=120, stream=True)  # ~1.2 s: the queued wait as long
                async with c.stream("POST", "/v1/chat/completions", json=body) as s:
                    return [line async for line in s.aiter_lines() if line.startswith("data:")]

            waited: list[int] = []

            async def watch() -> None:
                while True:
                    waited.append(len(engine.waiting))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            results = await asyncio.gather(*(one() for _ in range(16)))
            watcher.cancel()
            assert max(waited) >= 1  # some did queue at the server
            for lines in results:
                assert lines[-1] == "data: [DONE]", lines[-1]
                assert all("error" not in json.loads(x[6:]) for x in lines[:-1])
            assert pool.instances[0].consecutive_failures == 0
            await eventually(lambda: idle(pool))


async def test_no_first_token_from_an_idle_instance_is_a_failure() -> None:
    async with sim() as (u1, engine):
        health = {"first_token_timeout_s": 0.3, "stall_timeout_s": 5.0, "probe_interval_s": 30}
        cfg = balancer_config([u1], health=health, scrape={"interval_s": 30})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=30) as c:
            engine.stalled_until = float("inf")
            body = chat(max_tokens=5, stream=True)
            async with c.stream("POST", "/v1/chat/completions", json=body) as s:
                lines = [line async for line in s.aiter_lines() if line.startswith("data:")]
            error = json.loads(lines[-1][6:])["error"]
            assert error["code"] == "upstream_error" and "first token" in error["message"]
            assert pool.instances[0].consecutive_failures == 1
            engine.stalled_until = 0.0
            await eventually(lambda: idle(pool))
