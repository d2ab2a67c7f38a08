"""The capacity report's prefix-cache hit rate and KV headroom: read from the servers' own
metrics (vLLM's exposition, Triton's block counts), summed over the instances in service, and
carried by the report a real balancer serves in front of real simulated servers."""

from __future__ import annotations

import httpx

from regional_lb.capacity_report import CapacityReport
from regional_lb.upstream.cache_stats import CacheStats
from regional_lb.upstream.load_signals import parse_metrics
from tests.regional_lb.conftest import balancer, balancer_config, chat, eventually, sim

# What vLLM 0.11 exposes (trimmed): counters with _total, the cache's size as labels.
VLLM_TEXT = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="8000"} 1.0
"""


def test_vllm_metrics_give_the_prefix_counters_and_the_cache_size() -> None:
    sig = parse_metrics(VLLM_TEXT, 1.0, "vllm")
    assert (sig.prefix_queries, sig.prefix_hits, sig.kv_blocks, sig.kv_usage) == (
        1000.0,
        400.0,
        8000,
        0.25,
    )


def test_triton_block_counts_give_the_cache_size() -> None:
    text = (
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"} 30\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 120\n'
    )
    sig = parse_metrics(text, 1.0, "triton")
    assert sig.kv_blocks == 120 and sig.kv_usage == 0.25


def test_the_hit_rate_is_over_the_window_and_survives_a_restart() -> None:
    stats = CacheStats(window_s=60)
    base = parse_metrics(VLLM_TEXT, 0.0, "vllm")
    stats.observe("a", base)
    later = VLLM_TEXT.replace("1000.0", "2000.0").replace("400.0", "1300.0")
    stats.observe("a", parse_metrics(later, 10.0, "vllm"))
    figures = stats.figures(["a"], 10.0, 5.0)
    assert figures.prefix_cache_hit_rate == 0.9  # 900 of the 1,000 tokens looked up since
    assert figures.kv_free_fraction == 0.75 and figures.kv_free_blocks == 6000
    # Restarted: its counters began again; what it counted since is what counts.
    restarted = VLLM_TEXT.replace("1000.0", "100.0").replace("400.0", "25.0")
    stats.observe("a", parse_metrics(restarted, 20.0, "vllm"))
    assert stats.figures(["a"], 20.0, 5.0).prefix_cache_hit_rate == 0.25
    # Out of service: not in the region's figures; a stale scrape gives no headroom.
    assert stats.figures([], 20.0, 5.0).prefix_cache_hit_rate is None
    assert stats.figures(["a"], 40.0, 5.0).kv_free_fraction is None


async def test_the_report_carries_the_regions_hit_rate_and_kv_headroom() -> None:
    async with sim() as (u0, e0), sim() as (u1, e1):
        async with balancer(balancer_config([u0, u1])) as (url, _):
            body = chat(max_tokens=4)
            body["messages"] = [{"role": "user", "content": "a shared prompt. " * 200}]
            async with httpx.AsyncClient(timeout=30) as c:
                for _ in range(4):
                    assert (await c.post(f"{url}/v1/chat/completions", json=body)).is_success

                async def current() -> bool:
                    r = await c.get(f"{url}/gtm/capacity")
                    report = CapacityReport.model_validate_json(r.content)
                    queries = e0.cache.queries + e1.cache.queries
                    want = (e0.cache.hits + e1.cache.hits) / queries
                    rate = report.prefix_cache_hit_rate
                    return rate is not None and abs(rate - want) < 1e-9

                await eventually(current, within=30, what="the report's hit rate")
                report = CapacityReport.model_validate_json(
                    (await c.get(f"{url}/gtm/capacity")).content
                )
        assert report.prefix_cache_hit_rate is not None and report.prefix_cache_hit_rate > 0.3
        # Idle now: every block is free (cached ones too: they are evicted on demand).
        assert report.kv_free_fraction == 1.0
        assert report.kv_free_blocks == e0.cache.capacity_blocks + e1.cache.capacity_blocks
