"""The balancer in front of servers it did not write, as llama-cpp-python behaves
(:mod:`tests.regional_lb.openai_like`): probes that never cut or misjudge a stream, streams
that end once, models that are only what a server lists, errors that keep their words, and
health changes that say why. Each of these failed before issue 36; the same claims are checked
against the real llama-cpp-python server in ``tests/regional_lb/conformance/test_llamacpp.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
import structlog

from regional_lb.config import BalancerConfig
from regional_lb.protocol.serving import running
from regional_lb.upstream.forward import done_end
from tests.regional_lb.conftest import balancer, balancer_config, chat, eventually, idle, sim
from tests.regional_lb.openai_like import OpenAILike

CHAT = "/v1/chat/completions"


def like_config(url: str, kind: str = "openai", **overrides: Any) -> BalancerConfig:
    """One instance of ``kind`` with no configured models: it serves what it lists."""
    cfg = balancer_config([url], **overrides)
    return cfg.model_copy(
        update={"instances": [cfg.instances[0].model_copy(update={"models": [], "kind": kind})]}
    )


async def _lines(c: httpx.AsyncClient) -> list[str]:
    async with c.stream("POST", CHAT, json=chat(stream=True)) as s:
        return [line async for line in s.aiter_lines() if line.startswith("data:")]


async def test_probes_never_cut_a_running_stream() -> None:
    # Probes and model listings as often as the loop allows; the server ends a running stream
    # whenever /v1/models is called (before: every probe called it, and 5 of 30 streams were
    # cut against the real server).
    server = OpenAILike()
    async with running(server) as u:
        health = {"probe_interval_s": 0.02, "models_interval_s": 0.02}
        async with (
            balancer(like_config(u, health=health)) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=30) as c,
        ):
            inst = pool.instances[0]
            await eventually(lambda: inst.probe_ok_at is not None, 10)
            for _ in range(3):
                server.finish.clear()
                reading = asyncio.create_task(_lines(c))
                probes = server.probes
                # Several probe rounds while the stream runs (or its early end, before).
                await eventually(
                    lambda n=probes, r=reading: server.probes >= n + 5 or r.done(),
                    10,
                )
                server.finish.set()
                lines = await reading
                assert lines[-1] == "data: [DONE]", lines[-2:]
                assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
            assert server.interrupted == 0
            # The model list is read again, while no stream runs there.
            await eventually(lambda: server.listings > 1, 10)
            assert server.interrupted == 0
            assert inst.healthy and inst.consecutive_failures == 0
            await eventually(lambda: idle(pool))


async def test_a_close_after_a_complete_answer_is_no_failure() -> None:
    # llama-cpp-python closes the connection after an interrupted stream's [DONE]; any
    # server may close after the last chunk. The answer was whole: nothing more is sent and
    # nothing is charged (before: an error event after [DONE], and broken_stream).
    server = OpenAILike(close_after_done=True)
    server.finish.set()
    async with running(server) as u:
        cfg = like_config(u, health={"probe_interval_s": 30})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=30) as c:
            await eventually(lambda: pool.instances[0].probe_ok_at is not None, 10)
            for _ in range(3):
                lines = await _lines(c)
                assert lines[-1] == "data: [DONE]", lines[-2:]
                assert all("error" not in json.loads(x[6:]) for x in lines[:-1])
            metrics = (await c.get("/metrics")).text
            assert "regional_lb_upstream_failures_total{" not in metrics
            assert pool.instances[0].consecutive_failures == 0
            await eventually(lambda: idle(pool))


def test_done_is_found_across_chunk_boundaries_and_ends_the_event() -> None:
    assert done_end(b"", b'data: {"a": 1}\n\ndata: [DONE]\n\n') == 30
    assert done_end(b"", b"data: [DONE]\r\n\r\ndata: late\n\n") == 16
    assert done_end(b"\n\ndata: [DO", b"NE]\n\n") == 5  # split between two chunks
    assert done_end(b"", b'data: {"text": "data: [DONE]"}\n\n') is None  # inside a token
    assert done_end(b"", b"data:[DONE]\n\n") == 13  # the space is optional in SSE


async def test_a_probe_behind_a_long_generation_is_busy_not_down() -> None:
    # With interrupt_requests off, llama-cpp-python answers nothing until the running
    # generation ends: probes time out while our stream makes progress (before: two timeouts
    # and the instance was out of service while it was generating).
    server = OpenAILike(interrupt=False, serialise=True, has_health=True)
    async with running(server) as u:
        health = {
            "probe_interval_s": 0.05,
            "probe_timeout_s": 0.2,
            "unhealthy_after": 2,
            "models_interval_s": 3600,
        }
        async with (
            balancer(like_config(u, health=health)) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=30) as c,
        ):
            inst = pool.instances[0]
            await eventually(lambda: inst.probe_ok_at is not None, 10)
            reading = asyncio.create_task(_lines(c))
            # Four probes arrived during the stream: at least three of them timed out.
            await eventually(lambda: server.probes >= 4 or reading.done(), 10)
            assert inst.healthy
            server.finish.set()
            lines = await reading
            assert lines[-1] == "data: [DONE]"
            assert inst.healthy and inst.consecutive_failures == 0
            metrics = (await c.get("/metrics")).text
            assert 'healthy="false"' not in metrics
            assert 'probe="readiness",reason="timeout_busy"' in metrics


async def test_a_mistyped_model_never_becomes_a_model() -> None:
    async with sim() as (u, engine):
        # No models in the configuration: the instance serves what it lists (m1).
        cfg = like_config(u, kind="vllm")
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=30) as c:
            await eventually(lambda: pool.instances[0].probe_ok_at is not None, 10)
            r = await c.post(CHAT, json=chat(model="typo-x"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert engine.prompt_total == 0  # never sent to the instance
            listed = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            assert listed == ["m1"]
            assert (await c.get("/v1/models/typo-x")).status_code == 404
            assert (await c.post(CHAT, json=chat(model="m1", max_tokens=2))).status_code == 200
            await eventually(lambda: idle(pool))


async def test_an_instance_without_a_model_list_is_asked_before_it_takes_work() -> None:
    server = OpenAILike()
    server.listing_open.clear()  # the server has not answered /v1/models yet
    async with running(server) as u:
        health = {"probe_interval_s": 0.05, "probe_timeout_s": 30}
        async with (
            balancer(like_config(u, health=health)) as (url, pool),
            httpx.AsyncClient(base_url=url, timeout=30) as c,
        ):
            await eventually(lambda: server.listings >= 1, 10)
            r = await c.post(CHAT, json=chat(model="m1"))
            # Not a 404 (the model may well exist) and not routed: come back shortly.
            assert r.status_code == 503 and "retry-after" in r.headers
            assert server.generations == 0
            server.listing_open.set()
            await eventually(lambda: "i0" in pool.listed, 10)
            r = await c.post(CHAT, json=chat(model="m1"))
            assert r.status_code == 200 and server.generations == 1


async def test_upstream_errors_keep_their_status_and_words() -> None:
    # llama-cpp-python's shapes: its error handler's, and FastAPI's for a bad key.
    llama_500 = {
        "error": {
            "message": "llama_decode returned -3",
            "type": "internal_server_error",
            "param": None,
            "code": None,
        }
    }
    server = OpenAILike(
        errors=[
            (500, json.dumps(llama_500).encode()),
            (401, b'{"detail": "Invalid API key"}'),
            (400, b"prompt is too long"),
        ]
    )
    async with running(server) as u:
        cfg = like_config(u, health={"probe_interval_s": 30})
        async with balancer(cfg) as (url, pool):
            inst = pool.instances[0]
            await eventually(lambda: inst.probe_ok_at is not None, 10)
            c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
            messages: Any = [{"role": "user", "content": "x"}]
            with pytest.raises(openai.InternalServerError) as e500:
                await c.chat.completions.create(model="m1", messages=messages)
            assert e500.value.status_code == 500
            assert e500.value.body == {
                "message": "llama_decode returned -3",
                "type": "internal_server_error",
                "param": None,
                "code": "upstream_error",
            }
            assert e500.value.response.headers["x-regional-instance"] == "i0"
            with pytest.raises(openai.AuthenticationError) as e401:
                await c.chat.completions.create(model="m1", messages=messages)
            assert e401.value.body == {
                "message": "Invalid API key",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            with pytest.raises(openai.BadRequestError) as e400:
                await c.chat.completions.create(model="m1", messages=messages)
            assert isinstance(e400.value.body, dict)
            assert e400.value.body["message"] == "prompt is too long"
            await c.close()
            # Only the server error is the instance's failure.
            assert inst.consecutive_failures == 1
            await eventually(lambda: idle(pool))


async def test_health_changes_and_failed_scrapes_say_why() -> None:
    # kind vllm in front of a server without /health or /metrics: never healthy (vLLM always
    # has /health), and now the log and the counters say why, once, not every second.
    server = OpenAILike()
    async with running(server) as u:
        cfg = balancer_config([u], health={"probe_interval_s": 0.05})
        with structlog.testing.capture_logs() as logs:
            async with (
                balancer(cfg) as (url, pool),
                httpx.AsyncClient(base_url=url, timeout=30) as c,
            ):
                await eventually(lambda: not pool.instances[0].healthy, 10)
                scrapes = 'probe="metrics",reason="http_404"} '

                async def scraped_thrice() -> bool:
                    text = (await c.get("/metrics")).text
                    line = next((x for x in text.splitlines() if scrapes in x), "")
                    return bool(line) and float(line.rsplit(" ", 1)[1]) >= 3

                await eventually(scraped_thrice, 10, "three failed scrapes")
                metrics = (await c.get("/metrics")).text
        assert (
            'regional_lb_health_changes_total{healthy="false",instance="i0",reason="http_404"} 1.0'
        ) in metrics
        changes = [e for e in logs if e["event"] == "instance health changed"]
        assert changes and changes[0]["reason"] == "http_404" and changes[0]["healthy"] is False
        failed = [e for e in logs if e["event"] == "instance metrics failed"]
        assert [e["reason"] for e in failed] == ["http_404"]  # said once


async def test_a_404_health_is_no_readiness_route_unless_health_url_names_it() -> None:
    # The same server without /health: up on kind openai's default probe (the 404 shows a
    # server with no readiness route), down when the operator named that URL (a typo).
    server = OpenAILike()
    async with running(server) as u:
        health = {"probe_interval_s": 0.05}
        async with balancer(like_config(u, health=health)) as (_, pool):
            inst = pool.instances[0]
            await eventually(lambda: inst.probe_ok_at is not None and "i0" in pool.listed, 10)
            assert inst.healthy
        cfg = like_config(u, health=health)
        named = cfg.instances[0].model_copy(update={"health_url": f"{u}/health"})
        cfg = cfg.model_copy(update={"instances": [named]})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            await eventually(lambda: not pool.instances[0].healthy, 10)
            metrics = (await c.get("/metrics")).text
            assert 'instance="i0",reason="http_404"} 1.0' in metrics
