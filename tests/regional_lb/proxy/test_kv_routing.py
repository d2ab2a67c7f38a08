"""Prefix-cache routing through the running balancer, end to end on loopback: simulated
servers (HTTP + their vLLM-format KV-event publishers on ZMQ, ephemeral ports), the real
proxy subscribed to each, and the official ``openai`` SDK sending conversations whose turns
share a prefix. The follow-up of a conversation goes where its prefix is cached (the sim's own
prefix-cache hits say it was reused); a publisher that goes away or falls silent makes the
balancer fall back to its routing-history estimate and say so; a drained instance loses its
entries at once; bad events are counted and change no answer."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import zmq
import zmq.asyncio

from regional_lb.balancing.cost import CHARS_PER_TOKEN
from regional_lb.balancing.kv_blocks import block_hash, block_hashes, tokens_of
from regional_lb.balancing.kv_events import BlockStored, KvEventBatch, encode_batch
from regional_lb.config import BalancerConfig
from regional_lb.errors import ConfigError
from regional_lb.protocol.kv_prompt import prompt_block_hashes, prompt_token_ids
from regional_lb.sim.engine import Engine
from tests.regional_lb.conftest import balancer, balancer_config, eventually, sim

SYSTEM = "You are a careful assistant for the regional fleet. " * 150  # ~7,700 characters


def conversation(n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Conversation {n} of the test. {SYSTEM}"},
        {"role": "user", "content": f"Question {n}: what does the balancer do with caches? " * 8},
    ]


def config(engines: list[tuple[str, Engine]], **overrides: Any) -> BalancerConfig:
    instances = []
    for k, (url, engine) in enumerate(engines):
        assert engine.kv_publisher is not None
        instances.append(
            {
                "id": f"i{k}",
                "url": url,
                "gpu": "A100",
                "models": ["m1"],
                "kv_events": {"endpoint": engine.kv_publisher.endpoint},
            }
        )
    return balancer_config([], instances=instances, **overrides)


@asynccontextmanager
async def fleet(
    n: int, **overrides: Any
) -> AsyncIterator[tuple[str, list[Engine], openai.AsyncOpenAI]]:
    """``n`` simulated servers publishing KV events, the balancer subscribed to each, and an
    SDK client of the balancer."""
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(sim(kv_events_endpoint="tcp://127.0.0.1:*"))
            for _ in range(n)
        ]
        url, _ = await stack.enter_async_context(balancer(config(engines, **overrides)))
        # PUB drops what it sends before a subscription arrives: wait for every subscriber.
        for _, engine in engines:
            pub = engine.kv_publisher
            assert pub is not None
            await eventually(lambda pub=pub: pub.subscribers() >= 1, within=30, what="subscribed")
        client = await stack.enter_async_context(sdk(url))
        yield url, [e for _, e in engines], client


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


async def ask(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> tuple[str, str]:
    """One turn: the instance that served it and the reply."""
    raw = await client.chat.completions.with_raw_response.create(
        model="m1", messages=messages, max_tokens=8, extra_body={"ignore_eos": True}
    )
    reply = raw.parse().choices[0].message.content or ""
    return raw.headers["x-regional-instance"], reply


async def kv_status(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        body: dict[str, Any] = (await c.get(f"{url}/admin/kv")).json()
        return body


def row(status: dict[str, Any], iid: str) -> dict[str, Any]:
    return next(r for r in status["instances"] if r["id"] == iid)


async def holds(url: str, iid: str, messages: list[dict[str, str]]) -> bool:
    """Whether the balancer's index has every full block of ``messages`` at ``iid``: the
    server published them (the index learns nothing else while the stream is live)."""
    st = row(await kv_status(url), iid)
    return st["stream"] == "live" and st["blocks_held"] >= len(
        prompt_block_hashes({"messages": messages}, 16)
    )


def test_the_sim_and_the_balancer_cut_a_prompt_into_the_same_blocks() -> None:
    body = {"messages": conversation(1)}
    assert prompt_block_hashes(body, 16) == block_hashes(prompt_token_ids(body), 16)
    follow = {"messages": [*conversation(1), {"role": "assistant", "content": "tok1 tok2"}]}
    first, second = prompt_block_hashes(body, 16), prompt_block_hashes(follow, 16)
    # A conversation's next turn starts with every full block of the one before.
    assert len(first) >= 30 and second[: len(first) - 1] == first[:-1]


def test_the_cut_names_blocks_as_the_per_block_reference_does() -> None:
    """The request path's cut (remembered chunk ids, a compiled packing) names every block
    exactly as hashing each chunk and chaining block_hash block by block does: any difference
    would be a miss on every request."""
    rng = random.Random(34)
    chunk = int(CHARS_PER_TOKEN)
    for _ in range(100):
        text = "".join(rng.choice("abcdefgh é日\x00") for _ in range(rng.randrange(0, 2000)))
        data = text.encode()
        fresh = [
            int.from_bytes(hashlib.blake2b(data[i : i + chunk], digest_size=4).digest(), "big")
            for i in range(0, len(data), chunk)
        ]
        assert tokens_of(text) == fresh
        assert tokens_of(text) == fresh  # the second time from the remembered ids
        for size in (1, 4, 16):
            parent, reference = None, []
            for start in range(0, len(fresh) - size + 1, size):
                parent = block_hash(parent, fresh[start : start + size])
                reference.append(parent)
            assert block_hashes(fresh, size) == reference
    # Ids past 64 bits are masked as block_hash masks them.
    first = block_hash(None, [-1])
    assert block_hashes([-1, 1 << 70], 1) == [first, block_hash(first, [1 << 70])]
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        block_hashes([1, 2], 0)


async def test_follow_up_turns_go_where_their_prefix_is_cached() -> None:
    async with fleet(2) as (url, engines, client):
        talks = [conversation(n) for n in range(6)]
        # First turns at once: least outstanding work spreads them over both instances.
        firsts = await asyncio.gather(*(ask(client, t) for t in talks))
        owners = [iid for iid, _ in firsts]
        assert set(owners) == {"i0", "i1"}, owners  # else the test would prove nothing
        for talk, (iid, reply) in zip(talks, firsts, strict=True):
            talk.append({"role": "assistant", "content": reply})
            await eventually(lambda t=talk[:2], i=iid: holds(url, i, t), within=30)
        hits_before = [e.cache.hits for e in engines]
        # Follow-ups one at a time, so load does not decide: each goes to its prefix.
        for n, (talk, owner) in enumerate(zip(talks, owners, strict=True)):
            talk.append({"role": "user", "content": f"And then, for conversation {n}?"})
            served, _ = await ask(client, talk)
            assert served == owner, (n, served, owner)
        # The servers themselves say the prefixes were reused (vllm:prefix_cache_hits).
        for k, engine in enumerate(engines):
            expected = owners.count(f"i{k}") * (len(SYSTEM) // 4 // 16 * 16)
            assert engine.cache.hits - hits_before[k] >= expected
        async with httpx.AsyncClient() as c:
            metrics = (await c.get(f"{url}/metrics")).text
        assert 'regional_lb_kv_stream_live{instance="i0"} 1.0' in metrics
        assert 'regional_lb_kv_events_total{result="stored"}' in metrics


async def test_a_publisher_that_goes_away_falls_back_visibly() -> None:
    async with fleet(2, kv_cache={"silent_after_s": 60}) as (url, engines, client):
        talk = conversation(7)
        owner, _ = await ask(client, talk)
        await eventually(lambda: holds(url, owner, talk), within=30)
        engine = engines[int(owner[1:])]
        assert engine.kv_publisher is not None
        engine.kv_publisher.close()  # the server runs on; its event stream is gone

        async def fell_back() -> bool:
            st = row(await kv_status(url), owner)
            return st["stream"] == "fallback" and st["reason"] == "disconnected"

        await eventually(fell_back, within=30, what="fallback after the publisher closed")
        st = await kv_status(url)
        assert row(st, owner)["blocks_held"] == 0  # what it held can no longer be trusted
        other = "i1" if owner == "i0" else "i0"
        assert row(st, other)["stream"] == "waiting"  # never published: nothing lost
        async with httpx.AsyncClient() as c:
            metrics = (await c.get(f"{url}/metrics")).text
        line = f'regional_lb_kv_stream_fallbacks_total{{instance="{owner}",reason="disconnected"}}'
        assert f"{line} 1.0" in metrics
        assert f'regional_lb_kv_stream_live{{instance="{owner}"}} 0.0' in metrics
        # Requests still flow; the instance is now indexed from what is routed there.
        served, _ = await ask(client, conversation(8))
        assert row(await kv_status(url), served)["index"] in ("history", "events")
        assert row(await kv_status(url), owner)["stream"] == "fallback"


async def test_a_publisher_that_falls_silent_falls_back_after_silent_after_s() -> None:
    async with fleet(1, kv_cache={"silent_after_s": 0.3}) as (url, engines, client):
        await ask(client, conversation(9))
        await eventually(lambda: holds(url, "i0", conversation(9)), within=30)
        engines[0].on_kv_events = None  # connected, but publishes nothing any more
        await ask(client, conversation(10))  # new blocks: an event is owed

        async def silent() -> bool:
            st = row(await kv_status(url), "i0")
            return st["stream"] == "fallback" and st["reason"] == "silent"

        await eventually(silent, within=30, what="fallback after the stream fell silent")
        # The estimate takes over: what is routed there now is what the index holds.
        await ask(client, conversation(11))
        st = row(await kv_status(url), "i0")
        assert st["index"] == "history"
        assert st["blocks_held"] == len(prompt_block_hashes({"messages": conversation(11)}, 16))


async def test_a_drained_instance_loses_its_entries_and_its_followers() -> None:
    async with fleet(2) as (url, _, client):
        talk = conversation(12)
        owner, reply = await ask(client, talk)
        await eventually(lambda: holds(url, owner, talk), within=30)
        async with httpx.AsyncClient() as c:
            assert (await c.post(f"{url}/admin/drain/{owner}")).status_code == 200
        talk += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        served, _ = await ask(client, talk)
        assert served != owner
        assert row(await kv_status(url), owner)["blocks_held"] == 0


async def test_an_instance_that_leaves_stops_being_followed() -> None:
    async with fleet(2) as (url, engines, client):
        talk = conversation(14)
        owner, _ = await ask(client, talk)
        await eventually(lambda: holds(url, owner, talk), within=30)
        pub = engines[int(owner[1:])].kv_publisher
        assert pub is not None
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.post(f"{url}/admin/drain/{owner}")).status_code == 200
            assert (await c.delete(f"{url}/admin/instances/{owner}")).status_code == 200
        assert owner not in {r["id"] for r in (await kv_status(url))["instances"]}
        # Its subscription is closed: the publisher hears the unsubscription.
        await eventually(lambda: pub.subscribers() == 0, within=30, what="unsubscribed")
        served, _ = await ask(client, talk)
        assert served != owner


async def test_bad_events_are_counted_the_index_stays_bounded_and_answers_stay_right() -> None:
    """i0's events come from a publisher that sends garbage, replays, foreign block sizes,
    a flood of unique blocks, and false claims of the very prompt asked next."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        async with sim() as (u0, _), sim() as (u1, _):
            cfg = balancer_config(
                [],
                instances=[
                    {"id": "i0", "url": u0, "models": ["m1"], "kv_events": {"endpoint": endpoint}},
                    {"id": "i1", "url": u1, "models": ["m1"]},
                ],
                kv_cache={"max_blocks": 1000},
            )
            async with balancer(cfg) as (url, _):
                assert (await asyncio.wait_for(pub.recv(), 30))[:1] == b"\x01"

                async def send(seq: int, *events: BlockStored) -> None:
                    batch = encode_batch(KvEventBatch(1.0, events))
                    await pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])

                await pub.send_multipart([b"", b"\x00" * 8])  # two frames
                await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"])  # not msgpack
                await send(5, BlockStored((1, 2), None, (), 16))
                await send(3, BlockStored((3,), None, (), 16))  # from the past
                await send(6, BlockStored((4,), None, (), 32))  # another block size
                flood = tuple(range(10_000, 15_000))
                await send(8, BlockStored(flood, None, (), 16))  # 7 never came: a gap
                talk = conversation(13)
                lie = tuple(prompt_block_hashes({"messages": talk}, 16))
                await send(9, BlockStored(lie, None, (), 16))

                async def counted() -> bool:
                    c = (await kv_status(url))["counts"]
                    return bool(c["batches"] == 4 and c["malformed"] == 2)

                await eventually(counted, within=30, what="every message handled")
                st = await kv_status(url)
                c = st["counts"]
                assert c["out_of_order"] == 1 and c["foreign_block_size"] == 1
                assert c["gaps"] == 1 and c["overflow"] >= 4000
                assert row(st, "i0")["blocks_held"] <= 1000
                # The lie costs hit rate, nothing else: the request is answered.
                async with sdk(url) as client:
                    served, reply = await ask(client, talk)
                assert served in ("i0", "i1") and reply
                async with httpx.AsyncClient() as c:
                    metrics = (await c.get(f"{url}/metrics")).text
                assert 'regional_lb_kv_events_total{result="malformed"} 2.0' in metrics
                assert 'regional_lb_kv_blocks_indexed{instance="i0"}' in metrics
    finally:
        pub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("kv_events", "words"),
    [
        ({"endpoint": "tcp://*:5557"}, "connect to"),
        ({"endpoint": "http://h:5557"}, "not a ZMQ endpoint"),
        ({"endpoint": "tcp://h:70000"}, "out of range"),
        ({"endpoint": "tcp://h:1", "topics": "x"}, "Extra inputs"),
    ],
)
def test_bad_kv_event_settings_are_refused_with_the_reason(
    kv_events: dict[str, str], words: str
) -> None:
    inst = {"id": "i0", "url": "http://127.0.0.1:1", "models": ["m1"], "kv_events": kv_events}
    with pytest.raises(ConfigError, match=words):
        balancer_config([], instances=[inst])


def test_two_instances_cannot_share_one_event_stream() -> None:
    same = {"endpoint": "tcp://127.0.0.1:5557"}
    insts = [
        {"id": f"i{k}", "url": "http://127.0.0.1:1", "models": ["m1"], "kv_events": same}
        for k in range(2)
    ]
    with pytest.raises(ConfigError, match="kv_events endpoints must be unique"):
        balancer_config([], instances=insts)
