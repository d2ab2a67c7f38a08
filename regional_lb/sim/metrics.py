"""The simulated server's Prometheus metrics, in the shape of the server kind it plays.

vLLM and SGLang name running and waiting sequences and KV-cache use; TGI its batch and queue;
Triton (TensorRT-LLM backend) counts *pending* (waiting) requests per model, the active batch
and the KV cache's blocks, on a metrics port of its own. The balancer reads each kind with its
own mapping (``regional_lb.upstream.load_signals``), so a wrong mapping shows up in tests.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regional_lb.sim.engine import Engine

KINDS = ("vllm", "sglang", "tgi", "triton", "openai")
KV_BLOCK_TOKENS = 64  # tokens per KV block, for Triton's block counts


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), float(value))
    return g


class EngineCollector(Collector):
    """Exports the engine's state at scrape time under ``kind``'s metric names."""

    def __init__(self, engine: Engine, kind: str = "vllm") -> None:
        self.engine, self.kind = engine, kind

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        model = next(iter(e.loaded), "none")
        running, waiting = len(e.running), len(e.waiting)
        if self.kind == "vllm":
            m = {"model_name": model}
            yield _gauge("vllm:num_requests_running", "Sequences in the batch", running, m)
            yield _gauge("vllm:num_requests_waiting", "Sequences queued", waiting, m)
            yield _gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1", e.kv_usage, m)
            # vLLM states its cache's shape as the labels of a constant gauge.
            info = {
                "block_size": str(e.cache.block_size),
                "num_gpu_blocks": str(e.cache.capacity_blocks),
                "enable_prefix_caching": "True",
            }
            yield _gauge("vllm:cache_config_info", "Information of the KV cache config", 1, info)
            for name, doc, total in (
                ("vllm:prompt_tokens", "Prompt tokens processed", e.prompt_total),
                ("vllm:generation_tokens", "Tokens generated", e.generation_total),
                # In tokens, as vLLM counts them: prompt tokens looked up / found cached.
                ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", e.cache.queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", e.cache.hits),
            ):
                c = CounterMetricFamily(name, doc, labels=["model_name"])
                c.add_metric([model], float(total))
                yield c
        elif self.kind == "sglang":
            m = {"model_name": model}
            yield _gauge("sglang:num_running_reqs", "Running requests", running, m)
            yield _gauge("sglang:num_queue_reqs", "Queued requests", waiting, m)
            yield _gauge("sglang:token_usage", "KV token usage, 0..1", e.kv_usage, m)
        elif self.kind == "tgi":
            yield _gauge("tgi_batch_current_size", "Current batch size", running, {})
            yield _gauge("tgi_queue_size", "Current queue size", waiting, {})
        elif self.kind == "triton":
            m = {"model": model, "version": "1"}
            # Triton documents this as requests received and not yet executing: waiting.
            yield _gauge("nv_inference_pending_request_count", "Pending requests", waiting, m)
            req = GaugeMetricFamily(
                "nv_trt_llm_request_metrics", "TRT-LLM request metrics", labels=["request_type"]
            )
            req.add_metric(["active"], float(running))
            req.add_metric(["max"], float(e.gpu.batch_slots))
            yield req
            kv = GaugeMetricFamily(
                "nv_trt_llm_kv_cache_block_metrics", "KV blocks", labels=["kv_cache_block_type"]
            )
            kv.add_metric(["used"], float(e.kv_used // KV_BLOCK_TOKENS))
            kv.add_metric(["max"], float(e.kv_capacity // KV_BLOCK_TOKENS))
            yield kv
