"""The simulated prefix cache: vLLM's block rules, LRU eviction, its metrics over HTTP."""

from __future__ import annotations

import httpx
import pytest

from regional_lb.balancing.kv_blocks import block_hashes, cacheable_hit_blocks, tokens_of
from regional_lb.balancing.kv_events import BlockRemoved, BlockStored
from regional_lb.sim.prefix_cache import PrefixCache
from tests.regional_lb.conftest import sim

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_block_hashes_are_chained_and_only_full_blocks_count() -> None:
    a, b = toks(0, 10), [*toks(0, 8), 99, 98]
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert len(ha) == 2  # 10 tokens: two full blocks, 2 tokens left over
    assert ha == hb  # differ only in the partial block
    c = [7, *toks(1, 9)]  # first token differs: every later block differs too
    assert not set(block_hashes(c, BS)) & set(ha)
    assert tokens_of("abcdefgh") == tokens_of("abcdefgh")[:2] and len(tokens_of("abcdefghi")) == 3


def test_never_the_whole_prompt_from_cache() -> None:
    assert cacheable_hit_blocks(8, 2, BS) == 1  # all cached: the last block is recomputed
    assert cacheable_hit_blocks(9, 2, BS) == 2
    assert cacheable_hit_blocks(0, 0, BS) == 0


def test_second_request_hits_the_shared_prefix_and_counts_tokens() -> None:
    cache = PrefixCache(capacity_blocks=100, block_size=BS)
    first = cache.admit(toks(0, 12), output_tokens=4)
    assert first is not None and first.hit_tokens == 0 and first.prefill_tokens == 12
    stored = cache.take_events()
    hashes = tuple(block_hashes(toks(0, 12), BS))
    assert stored == [BlockStored(hashes, None, tuple(toks(0, 12)), BS)]
    cache.release(first)
    second = cache.admit([*toks(0, 8), 50, 51, 52, 53, 54], output_tokens=4)
    assert second is not None and second.hit_tokens == 8 and second.prefill_tokens == 5
    assert (cache.queries, cache.hits) == (25, 8)
    # The new third block chains onto the shared second one.
    (event,) = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == block_hashes(toks(0, 12), BS)[1]
    # A running request's blocks are pinned: the cache holds them and counts them as used.
    assert cache.used_blocks == 3 + 2  # 3 shared + ceil((1 + 4) / 4) private


def test_eviction_takes_the_least_recently_freed_tail_first() -> None:
    cache = PrefixCache(capacity_blocks=6, block_size=BS)
    a = cache.admit(toks(0, 12), output_tokens=0)  # blocks a0 a1 a2
    assert a is not None
    cache.release(a)
    b = cache.admit(toks(100, 8), output_tokens=0)  # blocks b0 b1
    assert b is not None
    cache.release(b)
    cache.take_events()
    ha, hb = block_hashes(toks(0, 12), BS), block_hashes(toks(100, 8), BS)
    # Three new blocks need room for one more than the 5 cached + 3 = 8 > 6: two go, and the
    # first to go are a's, tail first (a2, then a1), because a was freed before b.
    c = cache.admit(toks(200, 12), output_tokens=0)
    assert c is not None
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((ha[2], ha[1]))]
    assert ha[0] in cache and hb[0] in cache and hb[1] in cache
    assert cache.evictions == 2


def test_pinned_blocks_are_never_evicted_and_a_full_cache_refuses() -> None:
    cache = PrefixCache(capacity_blocks=4, block_size=BS)
    a = cache.admit(toks(0, 13), output_tokens=0)  # 3 shared + 1 private = 4: full
    assert a is not None
    assert cache.admit(toks(100, 4), output_tokens=0) is None  # no room, nothing evictable
    forced = cache.admit(toks(100, 8), output_tokens=0, force=True)
    assert forced is not None and forced.private == 2  # computed, not cached
    assert all(h in cache for h in block_hashes(toks(0, 12), BS))
    cache.release(forced)
    cache.release(a)
    cache.release(a)  # idempotent
    assert cache.used_blocks == 0 and cache.cached_blocks == 3


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    cache = PrefixCache(capacity_blocks=10, block_size=BS)
    a = cache.admit(toks(0, 8), output_tokens=0)
    assert a is not None and not cache.reset()
    cache.release(a)
    assert cache.reset() and cache.cached_blocks == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(10, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def test_sim_serves_prefix_cache_metrics_like_vllm() -> None:
    system = "You are a careful assistant. " * 40  # ~1,160 characters: ~290 tokens
    async with (
        sim(speedup=50.0) as (url, engine),
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        for question in ("first question?", "second question?"):
            body = {
                "model": "m1",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 2,
                "ignore_eos": True,
            }
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        text = (await c.get("/metrics")).text
    queries = _counter(text, "vllm:prefix_cache_queries_total")
    hits = _counter(text, "vllm:prefix_cache_hits_total")
    assert queries == engine.cache.queries > 0
    # The second request found the system prompt's full blocks; the first found nothing.
    shared = len(tokens_of(f"system\x00{system}\x00user\x00")) // 16 * 16
    assert hits == engine.cache.hits and shared - 16 <= hits <= shared


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "--block-size"),
        (["--kv-events", "5557"], "--kv-events"),
    ],
)
def test_sim_backend_refuses_bad_cache_options(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from regional_lb.cli import app

    result = CliRunner().invoke(app, ["sim-backend", *args])
    assert result.exit_code == 2 and message in result.output


async def test_the_engine_charges_prefill_only_for_blocks_not_cached() -> None:
    from regional_lb.balancing.gpus import profile
    from regional_lb.sim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(gpu=profile("A100"), models=["m1"]))
    rate = engine.gpu.prefill_tokens_per_s
    shared = toks(0, 1600)  # 100 blocks of 16
    first = engine.submit("m1", 1610, 4, exact=True, token_ids=[*shared, *toks(5000, 10)])
    assert await engine._admit() == pytest.approx(1610 / rate)
    engine.abort(first)  # its blocks stay cached, free
    engine.submit("m1", 1610, 4, exact=True, token_ids=[*shared, *toks(9000, 10)])
    # 1,600 tokens found in the cache: only the 10 after them are prefilled.
    assert await engine._admit() == pytest.approx(10 / rate)
    assert engine.cache.hits == 1600 and engine.cache.queries == 3220
