"""Real load from model servers' Prometheus metrics (vLLM, TGI, Triton, SGLang).

Several balancer replicas send work to the same instances, so each replica's own count of what
it sent is only part of the load. The servers' metrics say what is really running and queued;
the picker adds what they report beyond our own flights. A scrape older than
``stale_after_s`` is ignored entirely: routing on a stale number is worse than on none.

Each server kind names its gauges differently and means different things by them, so the
mapping is per kind (:data:`SEMANTICS`). Triton's ``nv_inference_pending_request_count`` is
requests *waiting* to execute (Triton's documentation), not running ones; with the
TensorRT-LLM backend the running batch is ``nv_trt_llm_request_metrics{request_type="active"}``
and the KV cache's blocks ``nv_trt_llm_kv_cache_block_metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class Gauge:
    """A sample name, optionally restricted to one value of one label."""

    name: str
    label: str = ""
    value: str = ""

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        return name == self.name and (not self.label or labels.get(self.label) == self.value)


@dataclass(frozen=True, slots=True)
class MetricSemantics:
    running: tuple[Gauge, ...] = ()  # sequences in the batch; the first present wins
    waiting: tuple[Gauge, ...] = ()  # requests queued at the server
    kv_usage: tuple[Gauge, ...] = ()  # a 0..1 (or 0..100) share of the KV cache
    kv_used_total: tuple[Gauge, Gauge] | None = None  # (used, total) when only blocks are given
    # Prefix-cache counters in tokens (vLLM's); the capacity report's hit rate.
    prefix_queries: tuple[Gauge, ...] = ()
    prefix_hits: tuple[Gauge, ...] = ()
    # A constant gauge whose label names the KV cache's size in blocks (vLLM's cache info).
    kv_blocks_label: tuple[Gauge, str] | None = None


VLLM = MetricSemantics(
    running=(Gauge("vllm:num_requests_running"),),
    waiting=(Gauge("vllm:num_requests_waiting"),),
    kv_usage=(Gauge("vllm:kv_cache_usage_perc"), Gauge("vllm:gpu_cache_usage_perc")),
    # Counters: the exposition names them with _total (older clients without it).
    prefix_queries=(
        Gauge("vllm:prefix_cache_queries_total"),
        Gauge("vllm:prefix_cache_queries"),
    ),
    prefix_hits=(Gauge("vllm:prefix_cache_hits_total"), Gauge("vllm:prefix_cache_hits")),
    kv_blocks_label=(Gauge("vllm:cache_config_info"), "num_gpu_blocks"),
)
SEMANTICS: dict[str, MetricSemantics] = {
    "vllm": VLLM,
    "tgi": MetricSemantics(
        running=(Gauge("tgi_batch_current_size"),), waiting=(Gauge("tgi_queue_size"),)
    ),
    "sglang": MetricSemantics(
        running=(Gauge("sglang:num_running_reqs"),),
        waiting=(Gauge("sglang:num_queue_reqs"),),
        kv_usage=(Gauge("sglang:token_usage"),),
    ),
    "triton": MetricSemantics(
        running=(Gauge("nv_trt_llm_request_metrics", "request_type", "active"),),
        waiting=(Gauge("nv_inference_pending_request_count"),),
        kv_used_total=(
            Gauge("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "used"),
            Gauge("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "max"),
        ),
    ),
    "openai": MetricSemantics(),  # a generic server: no load metrics are known
}


@dataclass(frozen=True, slots=True)
class LoadSignal:
    running: int | None
    waiting: int | None
    kv_usage: float | None  # 0..1
    at: float  # when it was scraped (monotonic seconds)
    prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache, ever
    prefix_hits: float | None = None  # of which found there
    kv_blocks: int | None = None  # the KV cache's size in blocks

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return now - self.at <= stale_after_s


def parse_metrics(text: str, at: float, kind: str = "vllm") -> LoadSignal:
    """Sum each gauge over its label sets (one per model or GPU) and map it to a field."""
    sem = SEMANTICS.get(kind, VLLM)
    share_gauges = set(sem.kv_usage)
    wanted = [
        *sem.running,
        *sem.waiting,
        *sem.kv_usage,
        *(sem.kv_used_total or ()),
        *sem.prefix_queries,
        *sem.prefix_hits,
    ]
    names = {g.name for g in wanted}
    sums: dict[Gauge, float] = {}
    blocks: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sem.kv_blocks_label is not None and sample.name == sem.kv_blocks_label[0].name:
                raw = sample.labels.get(sem.kv_blocks_label[1], "")
                if raw.isdigit():
                    blocks = (blocks or 0) + int(raw)
            if sample.name not in names:
                continue
            for g in wanted:
                if g.matches(sample.name, sample.labels):
                    if g in share_gauges:  # a share: take the highest, not the sum
                        sums[g] = max(sums.get(g, 0.0), sample.value)
                    else:
                        sums[g] = sums.get(g, 0.0) + sample.value

    def first(gauges: tuple[Gauge, ...]) -> float | None:
        return next((sums[g] for g in gauges if g in sums), None)

    running, waiting, kv = first(sem.running), first(sem.waiting), first(sem.kv_usage)
    if kv is not None and kv > 1.0:  # some servers export a percentage
        kv /= 100.0
    if sem.kv_used_total is not None:
        used, total = (sums.get(g) for g in sem.kv_used_total)
        if total and total > 0:
            blocks = int(total)
            if kv is None and used is not None:
                kv = min(1.0, used / total)
    return LoadSignal(
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=kv,
        at=at,
        prefix_queries=first(sem.prefix_queries),
        prefix_hits=first(sem.prefix_hits),
        kv_blocks=blocks,
    )
