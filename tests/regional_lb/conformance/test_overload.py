"""Overload through the OpenAI SDK: what a 429 says about when to come back.

More clients arrive at once than the region's slots and queue hold. The refused ones must be
told a spread of Retry-After values that grows with their place in line (not one constant
that brings them all back together), in the OpenAI error shape with its code set, and the
SDK's own retries, following those values, must then get every request served.
(``bench/regional/overload.py`` measures the same at the issue's scale.)
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from tests.regional_lb.conftest import balancer, balancer_config, eventually, idle, sim

CLIENTS = 16


@dataclass
class Attempt:
    status: int = 0
    told: float | None = None
    code: str | None = None


@dataclass
class Record:
    arrival: int
    attempts: list[Attempt] = field(default_factory=list)
    ok: bool = False


CURRENT: contextvars.ContextVar[Record] = contextvars.ContextVar("current")


async def _on_response(response: httpx2.Response) -> None:
    rec = CURRENT.get(None)
    if rec is None:
        return
    attempt = Attempt(response.status_code)
    if response.status_code == 429:
        await response.aread()
        attempt.told = float(response.headers["retry-after-ms"]) / 1000
        assert int(response.headers["retry-after"]) >= attempt.told  # whole seconds, rounded up
        attempt.code = response.json()["error"]["code"]
    rec.attempts.append(attempt)


async def _ask(client: openai.AsyncOpenAI, rec: Record | None) -> None:
    if rec is not None:
        CURRENT.set(rec)
    await client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    if rec is not None:
        rec.ok = True


async def test_retry_after_tracks_the_backlog_and_sdk_retries_succeed() -> None:
    tiers = [{"name": "standard", "max_utilisation": 1.0, "queue_limit": 2, "queue_timeout_s": 2}]
    async with sim(speedup=5.0) as (u1, _):
        cfg = balancer_config([u1], tiers=tiers, default_tier="standard")
        cfg = cfg.model_copy(
            update={"instances": [cfg.instances[0].model_copy(update={"max_concurrency": 2})]}
        )
        hooks: dict[str, list[Any]] = {"response": [_on_response]}
        async with (
            balancer(cfg) as (url, pool),
            httpx2.AsyncClient(event_hooks=hooks, timeout=60) as http,
            openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=5, http_client=http
            ) as client,
        ):
            for _ in range(3):  # a balancer in service has seen requests like these
                await asyncio.gather(_ask(client, None), _ask(client, None))
            records = [Record(k) for k in range(CLIENTS)]
            started = time.monotonic()
            tasks = []
            for rec in records:  # arrivals in a known order, all within a few milliseconds
                tasks.append(asyncio.create_task(_ask(client, rec)))
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)
            backlog_s = time.monotonic() - started
            await eventually(lambda: idle(pool))
    assert all(r.ok for r in records)  # every refused request was served on a retry
    first_refusals = [
        (r.arrival, r.attempts[0].told) for r in records if r.attempts[0].status == 429
    ]
    assert len(first_refusals) >= CLIENTS - 2 - 2 - 2  # slots and queue places, give or take
    told = [t for _, t in first_refusals if t is not None]
    assert all(a.code == "rate_limit_exceeded" for r in records for a in r.attempts if a.told)
    assert len(set(told)) >= 0.8 * len(told)  # jittered: clients are told different instants
    # The spread follows the line: the later half of the refused is told later, on average,
    # and the last is told a good share of the time the backlog really took to clear.
    half = len(told) // 2
    assert sum(told[half:]) / (len(told) - half) > sum(told[:half]) / half
    assert max(told) > 0.3 * backlog_s
    assert max(told) > 2 * min(told)
