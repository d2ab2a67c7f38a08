"""The official OpenAI SDK against the balancer, in front of simulated instances that require
an API key (``vllm serve --api-key``): every endpoint, streamed and not, errors, model
retrieval, upstream headers, and the accounting of a cancelled stream.

The client holds a key of the balancer's (a tenant's); the instances hold another, which the
balancer presents on probes, scrapes and requests. Neither is in the YAML.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from regional_lb.credentials import key_digest
from regional_lb.errors import RequestError
from regional_lb.protocol.openai_io import parse_request
from regional_lb.sim.engine import Engine
from regional_lb.upstream.pool import Pool
from tests.regional_lb.conftest import balancer, balancer_config, eventually, idle, sim

UPSTREAM_KEY = "sk-upstream-" + "u" * 32
CLIENT_KEY = "sk-client-" + "c" * 32


@asynccontextmanager
async def fleet(
    monkeypatch: pytest.MonkeyPatch, n: int = 2, **overrides: Any
) -> AsyncIterator[tuple[str, Pool, list[Engine]]]:
    monkeypatch.setenv("RLB_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    async with AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                sim(models=("m1", "e1"), api_key=UPSTREAM_KEY, max_model_len=4096)
            )
            for _ in range(n)
        ]
        doc: dict[str, Any] = {
            "upstream_auth": {"token": {"env": "RLB_TEST_UPSTREAM_KEY"}},
            "tenants": {"acme": {"tier": "standard", "key_sha256": [key_digest(CLIENT_KEY)]}},
            **overrides,
        }
        cfg = balancer_config([u for u, _ in sims], **doc)
        cfg = cfg.model_copy(
            update={
                "instances": [i.model_copy(update={"models": ["m1", "e1"]}) for i in cfg.instances]
            }
        )
        url, pool = await stack.enter_async_context(balancer(cfg))
        await eventually(lambda: all(i.probe_ok_at is not None for i in pool.instances), 10)
        yield url, pool, [e for _, e in sims]


def client(url: str, key: str = CLIENT_KEY, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=retries, timeout=30)


async def test_every_endpoint_through_the_sdk_with_an_authenticated_fleet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with fleet(monkeypatch) as (url, pool, engines):
        assert all(i.healthy for i in pool.instances)  # probes carried the instances' key
        async with client(url) as c:
            chat = await c.chat.completions.create(
                model="m1",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                extra_body={"ignore_eos": True},
            )
            assert chat.object == "chat.completion" and chat.usage is not None
            assert chat.usage.completion_tokens == 5 and chat.choices[0].message.content
            stream = await c.chat.completions.create(
                model="m1",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            pieces = [ch async for ch in stream]
            assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 7
            assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
            # ignore_eos: without it the simulator stops at a random 1..3 tokens (as a model
            # that meets its end-of-sequence), and the count below would depend on the draw.
            comp = await c.completions.create(
                model="m1", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert comp.choices[0].text and comp.object == "text_completion"
            comp_stream = await c.completions.create(
                model="m1", prompt="hello", max_tokens=3, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert len([x async for x in comp_stream]) >= 2
            emb = await c.embeddings.create(model="e1", input="some text")
            assert emb.data[0].embedding and emb.model == "e1"
            # The servers' own model fields survive the balancer (max_model_len and all).
            listed = {m.id: m for m in (await c.models.list()).data}
            assert set(listed) >= {"m1", "e1"}
            assert (listed["m1"].model_extra or {}).get("max_model_len") == 4096
            one = await c.models.retrieve("m1")
            assert one.id == "m1" and (one.model_extra or {}).get("max_model_len") == 4096
            with pytest.raises(openai.NotFoundError) as missing:
                await c.models.retrieve("nope")
            assert missing.value.code == "model_not_found"
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "x"}]
                )
            with pytest.raises(openai.BadRequestError) as bad:
                await c.chat.completions.create(model="m1", messages=[], max_tokens=2)
            assert bad.value.code == "invalid_request_error" and bad.value.param == "messages"
            await eventually(lambda: idle(pool))
            assert sum(e.generation_total for e in engines) >= 5 + 7 + 3 + 3


async def test_upstream_request_ids_and_rate_limit_headers_reach_the_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with fleet(monkeypatch, n=1) as (url, pool, _), client(url) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="m1",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers={"x-request-id": "req-123"},
        )
        assert raw.headers["x-request-id"] == "req-123"  # the instance's, relayed
        assert raw.headers["x-regional-instance"] == "i0"
        async with c.chat.completions.with_streaming_response.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        ) as streamed:
            assert streamed.headers["x-request-id"]
            assert len([line async for line in streamed.iter_lines() if line]) >= 2
        await eventually(lambda: idle(pool))


async def test_a_cancelled_stream_releases_its_work_and_the_instance_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with fleet(monkeypatch, n=1) as (url, pool, engines), client(url) as c:
        stream = await c.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                assert pool.instances[0].in_flight == 1
                break
        await stream.close()
        await eventually(lambda: idle(pool))
        await eventually(lambda: not engines[0].running and not engines[0].waiting)
        assert engines[0].generation_total < 3000


async def test_keys_required_refuse_callers_without_one_in_openai_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with fleet(monkeypatch, n=1, clients={"require_key": True}) as (url, pool, engines):
        async with client(url, key="sk-wrong") as wrong, client(url, UPSTREAM_KEY) as theirs:
            with pytest.raises(openai.AuthenticationError) as denied:
                await wrong.chat.completions.create(
                    model="m1", messages=[{"role": "user", "content": "x"}]
                )
            assert denied.value.code == "invalid_api_key"
            # The instances' key is not a client key either: holding it gets nothing here.
            with pytest.raises(openai.AuthenticationError):
                await theirs.chat.completions.create(
                    model="m1", messages=[{"role": "user", "content": "x"}]
                )
        async with client(url) as c:
            ok = await c.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert ok.choices
        await eventually(lambda: idle(pool))
        assert engines[0].generation_total >= 1


async def test_unknown_routes_and_balancer_health_answer_in_openai_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with fleet(monkeypatch, n=1) as (url, _, _), httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/v1/nothing-here")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found" and "detail" not in r.json()


async def test_images_and_long_prompts_fit_the_default_body_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = "data:image/png;base64," + "A" * (3 << 20)  # a 3 MiB picture: over the old 1 MiB
    async with fleet(monkeypatch, n=1) as (url, pool, _), client(url) as c:
        answer = await c.chat.completions.create(
            model="m1",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": image}},
                    ],
                }
            ],
            max_tokens=2,
        )
        assert answer.choices
        await eventually(lambda: idle(pool))


def test_n_choices_multiply_the_output_the_cost_expects() -> None:
    one = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10}
    assert parse_request("chat", json.dumps(one).encode()).shape.max_tokens == 10
    four = parse_request("chat", json.dumps({**one, "n": 4}).encode())
    assert four.shape.max_tokens == 40
    with pytest.raises(RequestError, match="'n' must be"):
        parse_request("completion", json.dumps({"model": "m", "prompt": "x", "n": 0}).encode())
