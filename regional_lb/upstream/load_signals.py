"""Real load from model servers' Prometheus metrics (vLLM, TGI, Triton).

Several balancer replicas send work to the same instances, so each replica's own count of what
it sent is only part of the load. The servers' metrics say what is really running and queued;
the picker adds what they report beyond our own flights. A scrape older than
``stale_after_s`` is ignored entirely: routing on a stale number is worse than on none.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# name -> which field it feeds; the first present wins per field.
RUNNING = (
    "vllm:num_requests_running",
    "tgi_batch_current_size",
    "nv_inference_pending_request_count",  # Triton: requests received but not finished
)
WAITING = ("vllm:num_requests_waiting", "tgi_queue_size")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True, slots=True)
class LoadSignal:
    running: int | None
    waiting: int | None
    kv_usage: float | None  # 0..1
    at: float  # when it was scraped (monotonic seconds)

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return now - self.at <= stale_after_s


def parse_metrics(text: str, at: float) -> LoadSignal:
    """Sum each gauge over its label sets (one per model or GPU) and map it to a field."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (*RUNNING, *WAITING, *KV_USAGE):
                if sample.name in KV_USAGE:  # a share: take the highest, not the sum
                    sums[sample.name] = max(sums.get(sample.name, 0.0), sample.value)
                else:
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    running, waiting, kv = first(RUNNING), first(WAITING), first(KV_USAGE)
    if kv is not None and kv > 1.0:  # some servers export a percentage
        kv /= 100.0
    return LoadSignal(
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=kv,
        at=at,
    )
