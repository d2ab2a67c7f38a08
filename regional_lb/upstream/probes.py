"""Background loops of the balancer: active health probes and model discovery, metrics
scraping (with staleness), and the capacity-report push to GTM.

None of them ever blocks request handling: each runs as its own task, every network call has
a timeout, and failures are logged and counted rather than raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import structlog

from regional_lb.balancing.health import busy_not_stuck, record_probe
from regional_lb.balancing.instance import InstanceState
from regional_lb.capacity_report import SIGNATURE_HEADER, sign
from regional_lb.metrics import BalancerMetrics
from regional_lb.upstream.load_signals import LoadSignal, parse_metrics
from regional_lb.upstream.pool import Pool

log = structlog.get_logger("regional_lb")


def apply_models(
    inst: InstanceState, listing: Any, now: float, cards: dict[str, dict[str, Any]] | None = None
) -> None:
    """Update which models are loaded from an OpenAI ``/v1/models`` answer. Servers that say
    which models are resident (the simulator's ``loaded``) are believed; otherwise every model
    listed is taken as loaded (vLLM and TGI list only what they serve). ``cards`` receives
    each listed model's entry as the server gave it (max_model_len and all)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return
    loaded = {}
    if cards is not None:
        cards.clear()
    for entry in data:
        ok = isinstance(entry, dict) and isinstance(entry.get("id"), str)
        if ok and cards is not None:
            cards[entry["id"]] = entry
        if ok and entry.get("loaded", True):
            loaded[entry["id"]] = inst.loaded.get(entry["id"], now)
    # Models with requests in flight stay: the listing can lag behind a load.
    for flight in inst.flights.values():
        if flight.model and flight.model not in loaded:
            loaded[flight.model] = now
    inst.loaded = loaded


def apply_signal(inst: InstanceState, signal: LoadSignal | None, now: float) -> None:
    """Fresh load signal, or None when the last scrape is stale (``now`` on the pool's clock)."""
    if signal is None:
        inst.apply_load(None, None, None, now)
    else:
        inst.apply_load(signal.running, signal.waiting, signal.kv_usage, now)


class Background:
    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        metrics: BalancerMetrics,
        secret: bytes | None,
        next_report: Callable[[], tuple[bytes, int]],
    ) -> None:
        self.pool, self.client, self.metrics = pool, client, metrics
        self.secret, self.next_report = secret, next_report
        self.signals: dict[str, LoadSignal] = {}
        self.model_probed_at: dict[str, float] = {}  # instance id -> last model check
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        cfg = self.pool.config
        self._spawn(self._every(cfg.health.probe_interval_s, self.probe_all), "probe")
        self._spawn(self._every(cfg.scrape.interval_s, self.scrape_all), "scrape")
        if cfg.gtm_urls:
            self._spawn(self._every(cfg.report_interval_s, self.push), "push")

    def every(
        self, interval: float, job: Callable[[], Coroutine[Any, Any, None]], name: str
    ) -> None:
        """Run another job on this schedule (the balancer's JWKS refresh)."""
        self._spawn(self._every(interval, job), name)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.tasks.append(asyncio.create_task(coro, name=f"regional-lb-{name}"))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks.clear()

    async def _every(self, interval: float, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        while True:
            try:
                await job()
            except Exception as exc:  # a loop must outlive any one failure
                log.warning("background job failed", job=job.__name__, error=repr(exc))
            await asyncio.sleep(interval)

    # -- health -------------------------------------------------------------------------------

    async def probe(self, inst: InstanceState) -> bool:
        """Readiness at the server kind's own path (no inference), then its model list; both
        with the instance's credential. The model check is opt-in and rate-limited: it
        would otherwise add an inference every probe interval per instance per replica."""
        h = self.pool.config.health
        timeout = httpx.Timeout(h.probe_timeout_s)
        first_byte_s = self.pool.config.timeouts.first_byte_s
        up = self.pool.upstreams.get(inst.id)
        if up is None:
            return False  # left the pool while being probed
        auth = dict(up.auth)
        try:
            r = await self.client.get(up.health_url, headers=auth, timeout=timeout)
            if r.status_code != 200:
                return False
            if up.health_url != up.models_url:
                r = await self.client.get(up.models_url, headers=auth, timeout=timeout)
                if r.status_code != 200:
                    return False
            cards = self.pool.model_cards.setdefault(inst.id, {})
            apply_models(inst, r.json(), self.pool.clock(), cards)
            now = self.pool.clock()
            due = now - self.model_probed_at.get(inst.id, -math.inf) >= h.model_probe_interval_s
            if h.probe_model and inst.loaded and due:
                self.model_probed_at[inst.id] = now
                # The port answering is not enough: ask a loaded model for one token (or,
                # on an embedding server, one embedding: it has no completions route).
                model = next(iter(inst.loaded))
                body: dict[str, Any]
                if up.task == "embed":
                    path, body = "/v1/embeddings", {"model": model, "input": "ping"}
                else:
                    path, body = (
                        "/v1/completions",
                        {"model": model, "prompt": "ping", "max_tokens": 1},
                    )
                try:
                    r = await self.client.post(
                        f"{inst.url}{path}", json=body, headers=auth, timeout=timeout
                    )
                except httpx.TimeoutException:
                    # A full batch queues the probe like any request, and marking a saturated
                    # instance unhealthy would push its load onto the others. Busy is not
                    # dead while its own requests are within their patience.
                    return busy_not_stuck(inst, self.pool.clock(), first_byte_s)
                return r.status_code == 200
            return True
        except (httpx.HTTPError, ValueError):
            return False

    async def probe_all(self) -> None:
        members = list(self.pool.instances)  # joins and leaves may happen while we probe
        results = await asyncio.gather(*(self.probe(i) for i in members))
        h = self.pool.config.health
        for inst, ok in zip(members, results, strict=True):
            now = self.pool.clock()
            if ok:
                inst.probe_ok_at = now
            if record_probe(inst, ok, now, rise=h.healthy_after, fall=h.unhealthy_after):
                log.info("instance health changed", instance=inst.id, healthy=ok)
        # Also without a change: ejections and slow-start ramps end with time, not events,
        # and queued requests must not wait for an unrelated completion to notice.
        self.pool.admission.wake()

    # -- load signals ---------------------------------------------------------------------------

    async def scrape(self, inst: InstanceState) -> None:
        up = self.pool.upstreams.get(inst.id)
        if up is None or up.metrics_url is None:
            return
        try:
            r = await self.client.get(
                up.metrics_url,
                headers=dict(up.auth),
                timeout=httpx.Timeout(self.pool.config.scrape.interval_s),
            )
            if r.status_code == 200:
                self.signals[inst.id] = parse_metrics(r.text, time.monotonic(), up.kind)
        except (httpx.HTTPError, ValueError):
            pass  # the old sample ages out below

    async def scrape_all(self) -> None:
        cfg = self.pool.config
        await asyncio.gather(*(self.scrape(i) for i in self.pool.instances if i.scrape))
        now = time.monotonic()
        for inst in self.pool.instances:
            sig = self.signals.get(inst.id)
            fresh = sig is not None and sig.fresh(now, cfg.scrape.stale_after_s)
            apply_signal(inst, sig if fresh else None, self.pool.clock())

    # -- capacity report ----------------------------------------------------------------------

    async def push(self) -> None:
        body, _ = self.next_report()
        headers = {"content-type": "application/json"}
        if self.secret:
            headers[SIGNATURE_HEADER] = sign(body, self.secret)
        for url in self.pool.config.gtm_urls:
            try:
                r = await self.client.post(
                    f"{url.rstrip('/')}/v1/capacity",
                    content=body,
                    headers=headers,
                    timeout=httpx.Timeout(2.0),
                )
                result = "ok" if r.status_code < 300 else f"http_{r.status_code}"
            except httpx.HTTPError as exc:
                result = "error"
                log.warning("capacity push failed", url=url, error=type(exc).__name__)
            self.metrics.report_push.labels(result).inc()
