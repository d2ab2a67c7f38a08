"""The official OpenAI SDK through the balancer in front of a real OpenAI-compatible server it
did not write: llama-cpp-python's ``llama_cpp.server`` on the CPU, with a tiny random-weight
llama model built at test time (:mod:`tests.regional_lb.llamacpp`).

The server runs one request at a time and, by default, ends a running stream whenever another
request that needs the model arrives (``/v1/models`` included): the balancer must probe it
without disturbing work, hold it to one request at a time, and never let a stream end twice.
A stream is cut when it ends without a ``finish_reason`` (the server sent ``[DONE]`` early).

Marker ``llamacpp`` (``make test-llamacpp``, which installs the ``llamacpp`` extra first):
skipped when llama-cpp-python or gguf is not installed, failed instead with
``GTM_TEST_REQUIRE_LLAMACPP=1`` (as make test-llamacpp sets).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from regional_lb.config import BalancerConfig, parse_config
from regional_lb.upstream.pool import Pool
from tests.regional_lb.conftest import balancer, eventually, idle

# Looked up, not imported: the server runs in its own process, and importing llama_cpp here
# would load the library (and leave its /dev/null handles to the garbage collector).
if find_spec("llama_cpp") is None or find_spec("gguf") is None:
    _missing = "llama-cpp-python and gguf are not installed: pip install -e '.[llamacpp]'"
    if os.environ.get("GTM_TEST_REQUIRE_LLAMACPP") == "1":  # make test-llamacpp: fail, not skip
        pytest.fail(_missing, pytrace=False)
    pytest.skip(_missing, allow_module_level=True)

from tests.regional_lb.llamacpp import ALIAS, llama_server, write_model

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama") / "tiny.gguf")


@pytest.fixture(scope="module")
def server(model_file: Path) -> Iterator[str]:
    # The server's defaults: interrupt_requests on, as a new user would run it.
    with llama_server(model_file) as url:
        yield url


def llama_config(url: str, **overrides: Any) -> BalancerConfig:
    doc: dict[str, Any] = {
        "region": "test-region",
        "server_kind": "openai",
        # One request at a time: the server runs one, and a second one waiting there would
        # interrupt the first. A one-slot pool needs a tier allowed all of it.
        "instances": [
            {"id": "llama", "url": url, "gpu": "cpu", "speed": 1.0, "max_concurrency": 1}
        ],
        "tiers": [{"name": "standard", "max_utilisation": 1.0, "queue_limit": 100}],
        "health": {
            # Probe as often as the machine allows: every probe is a chance to cut a stream.
            "probe_interval_s": 0.02,
            "probe_timeout_s": 2.0,
            "models_interval_s": 0.1,
            "slow_start_s": 0,
        },
        "timeouts": {"connect_s": 2.0, "first_byte_s": 30.0, "read_s": 30.0},
        **overrides,
    }
    return parse_config(doc)


@asynccontextmanager
async def through(
    url: str, key: str = "unused", **overrides: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, Pool, str]]:
    async with balancer(llama_config(url, **overrides)) as (lb, pool):
        await eventually(lambda: "llama" in pool.listed, 20, "the model list")
        async with openai.AsyncOpenAI(
            base_url=f"{lb}/v1", api_key=key, max_retries=0, timeout=60
        ) as c:
            yield c, pool, lb


async def streamed(c: openai.AsyncOpenAI, max_tokens: int = 48) -> str | None:
    """One streamed chat; its finish_reason (None: the stream was cut)."""
    stream = await c.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=max_tokens,
        stream=True,
    )
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    return finish


async def test_the_sdk_suite_against_llama_cpp(server: str) -> None:
    async with through(server) as (c, pool, _):
        listed = [m.id for m in (await c.models.list()).data]
        assert listed == [ALIAS]
        assert (await c.models.retrieve(ALIAS)).id == ALIAS
        with pytest.raises(openai.NotFoundError) as missing:
            await c.models.retrieve("typo-x")
        assert missing.value.code == "model_not_found"

        chat = await c.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert chat.object == "chat.completion" and chat.choices[0].finish_reason
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        comp = await c.completions.create(model=ALIAS, prompt="once upon", max_tokens=8)
        assert comp.object == "text_completion" and comp.choices[0].finish_reason
        pieces = [
            p
            async for p in await c.completions.create(
                model=ALIAS, prompt="once upon", max_tokens=8, stream=True
            )
        ]
        assert pieces[-1].choices[0].finish_reason
        assert await streamed(c) is not None
        emb = await c.embeddings.create(model=ALIAS, input="some text")
        assert len(emb.data[0].embedding) == 64

        # llama-cpp-python answers any model name with its one model; the balancer does not,
        # and a mistyped model never becomes one.
        with pytest.raises(openai.NotFoundError) as typo:
            await c.chat.completions.create(
                model="typo-x", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert typo.value.code == "model_not_found"
        assert [m.id for m in (await c.models.list()).data] == [ALIAS]

        # The server's own error, its status and words, and no charge to the instance.
        with pytest.raises(openai.BadRequestError) as too_long:
            await c.completions.create(model=ALIAS, prompt="hello " * 300, max_tokens=400)
        assert too_long.value.code == "context_length_exceeded"
        assert "maximum context length is 512" in too_long.value.message
        assert too_long.value.response.headers["x-regional-instance"] == "llama"

        # Concurrency: eight at once, queued at the balancer, one at a time at the server.
        answers = await asyncio.gather(
            *(
                c.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": f"n{k}"}], max_tokens=4
                )
                for k in range(8)
            )
        )
        assert all(a.choices[0].finish_reason for a in answers)

        # Cancellation: a long stream closed after a few chunks returns in-flight to 0.
        stream = await c.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=400,
            stream=True,
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        await eventually(lambda: idle(pool))
        inst = pool.instances[0]
        assert inst.healthy and inst.consecutive_failures == 0


async def test_no_stream_is_cut_while_the_balancer_probes(server: str) -> None:
    """100 sequential and 20 concurrent streams, with probes and model listings running as
    often as the machine allows: none ends without its finish_reason, none is charged."""
    async with through(server) as (c, pool, lb):
        listings = pool.listed["llama"]
        sequential = [await streamed(c) for _ in range(100)]
        concurrent = await asyncio.gather(*(streamed(c) for _ in range(20)))
        cut = sum(1 for f in [*sequential, *concurrent] if f is None)
        assert cut == 0, f"{cut} of 120 streams were cut"
        # The model list is read between streams (when none runs there): at least once more.
        await eventually(lambda: pool.listed["llama"] > listings, 10, "another listing")
        await eventually(lambda: idle(pool))
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(f"{lb}/metrics")).text
        assert "regional_lb_upstream_failures_total{" not in metrics
        assert pool.instances[0].healthy


async def test_an_upstream_401_reaches_the_client_in_openai_shape(
    model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLB_TEST_LLAMA_KEY", "sk-right")
    with llama_server(model_file, api_key="sk-right") as url:
        # The balancer's key on probes and listings; the client's own key on its requests.
        auth = {"token": {"env": "RLB_TEST_LLAMA_KEY"}, "client_authorization": "pass"}
        async with through(url, key="sk-wrong", upstream_auth=auth) as (c, pool, _):
            with pytest.raises(openai.AuthenticationError) as denied:
                await c.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
            # llama-cpp-python says {"detail": "Invalid API key"}: FastAPI's shape.
            assert isinstance(denied.value.body, dict)
            assert denied.value.body["message"] == "Invalid API key"
            assert denied.value.code == "invalid_api_key"
            inst = pool.instances[0]
            assert inst.healthy and inst.consecutive_failures == 0
        # Without the balancer's key the listing is refused, and the health change says so.
        async with balancer(llama_config(url)) as (lb, pool):
            await eventually(lambda: not pool.instances[0].healthy, 20, "refused listing")
            async with httpx.AsyncClient(base_url=lb) as h:
                metrics = (await h.get("/metrics")).text
            assert (
                'regional_lb_health_changes_total{healthy="false",instance="llama",'
                'reason="models_http_401"} 1.0'
            ) in metrics
