"""The region's prefix-cache hit rate and KV headroom, for the capacity report.

Both come from the instances' own metrics (:mod:`regional_lb.upstream.load_signals`):

* **hit rate**: vLLM counts prompt tokens looked up in its prefix cache and found there
  (``vllm:prefix_cache_queries`` / ``_hits``, counters since the server started). The region's
  rate is the tokens found over the tokens looked up, summed over the instances in service,
  over the last :data:`WINDOW_S` seconds (a counter that went back is a restarted server: its
  count starts again from zero). None when nothing was looked up in the window.
* **KV headroom**: the share of the KV cache no running request holds (``1 - kv usage``;
  cached blocks nobody uses are free: the server evicts them when it needs the room), over the
  instances in service with a fresh scrape, weighted by their cache sizes when the servers
  state them (``vllm:cache_config_info``'s ``num_gpu_blocks``; Triton's block counts), and that
  many free blocks. None when no instance in service says.

Pure apart from the samples it keeps: one per scrape per instance, at most :data:`WINDOW_S`
seconds of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from regional_lb.upstream.load_signals import LoadSignal

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class CacheFigures:
    prefix_cache_hit_rate: float | None
    kv_free_fraction: float | None
    kv_free_blocks: int | None


class CacheStats:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._counters: dict[str, deque[tuple[float, float, float]]] = {}
        self._latest: dict[str, LoadSignal] = {}

    def observe(self, instance_id: str, signal: LoadSignal) -> None:
        """One scrape of an instance (``signal.at`` on the monotonic clock)."""
        self._latest[instance_id] = signal
        if signal.prefix_queries is None or signal.prefix_hits is None:
            return
        samples = self._counters.setdefault(instance_id, deque())
        samples.append((signal.at, signal.prefix_queries, signal.prefix_hits))
        while len(samples) > 2 and samples[1][0] < signal.at - self.window_s:
            samples.popleft()

    def forget(self, instance_id: str) -> None:
        self._counters.pop(instance_id, None)
        self._latest.pop(instance_id, None)

    def figures(self, live: Iterable[str], now: float, stale_after_s: float) -> CacheFigures:
        queries = hits = 0.0
        free_share: list[float] = []
        free_blocks = total_blocks = 0.0
        every_size_known = True
        for iid in live:
            samples = self._counters.get(iid)
            if samples:
                _, q0, h0 = samples[0]
                _, q1, h1 = samples[-1]
                if q1 < q0 or h1 < h0:  # restarted: its counters began again at zero
                    q0 = h0 = 0.0
                queries += q1 - q0
                hits += h1 - h0
            sig = self._latest.get(iid)
            if sig is None or not sig.fresh(now, stale_after_s) or sig.kv_usage is None:
                continue
            free = max(0.0, 1.0 - sig.kv_usage)
            free_share.append(free)
            if sig.kv_blocks:
                free_blocks += free * sig.kv_blocks
                total_blocks += sig.kv_blocks
            else:
                every_size_known = False
        rate = min(1.0, hits / queries) if queries > 0 else None
        if not free_share:
            return CacheFigures(rate, None, None)
        if every_size_known and total_blocks > 0:
            fraction = free_blocks / total_blocks
        else:
            fraction = sum(free_share) / len(free_share)
        return CacheFigures(
            rate, round(min(1.0, fraction), 6), int(free_blocks) if total_blocks else None
        )
