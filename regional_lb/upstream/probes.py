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
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import structlog

from regional_lb.balancing.health import busy_not_stuck, record_probe
from regional_lb.balancing.instance import InstanceState
from regional_lb.capacity_report import SIGNATURE_HEADER, sign
from regional_lb.metrics import BalancerMetrics
from regional_lb.upstream.cache_stats import CacheStats
from regional_lb.upstream.load_signals import LoadSignal, parse_metrics
from regional_lb.upstream.pool import Pool

log = structlog.get_logger("regional_lb")


def apply_models(
    inst: InstanceState,
    listing: Any,
    now: float,
    cards: dict[str, dict[str, Any]] | None = None,
    configured: frozenset[str] | None = None,
) -> bool:
    """Update which models are loaded from an OpenAI ``/v1/models`` answer; False when it is
    not one. Servers that say which models are resident (the simulator's ``loaded``) are
    believed; otherwise every model listed is taken as loaded (vLLM and TGI list only what
    they serve). ``cards`` receives each listed model's entry as the server gave it
    (max_model_len and all). An instance without ``configured`` models serves exactly what it
    lists."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return False
    loaded = {}
    listed = set()
    if cards is not None:
        cards.clear()
    for entry in data:
        ok = isinstance(entry, dict) and isinstance(entry.get("id"), str)
        if ok:
            listed.add(entry["id"])
        if ok and cards is not None:
            cards[entry["id"]] = entry
        if ok and entry.get("loaded", True):
            loaded[entry["id"]] = inst.loaded.get(entry["id"], now)
    # Models with requests in flight stay: the listing can lag behind a load.
    for flight in inst.flights.values():
        if flight.model and flight.model not in loaded:
            loaded[flight.model] = now
    inst.loaded = loaded
    if not configured:
        inst.servable = frozenset(listed)
    return True


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe round: ``busy`` (it timed out while our requests there progress) changes
    nothing; ``reason`` is what the health change is logged and counted with."""

    state: Literal["up", "down", "busy"]
    reason: str = "ok"


def failure_reason(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    return "transport"


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
        cache: CacheStats | None = None,
    ) -> None:
        self.pool, self.client, self.metrics = pool, client, metrics
        self.cache = cache  # prefix-cache and KV figures for the capacity report
        self.secret, self.next_report = secret, next_report
        self.signals: dict[str, LoadSignal] = {}
        self.model_probed_at: dict[str, float] = {}  # instance id -> last model check
        self.listing_refused: set[str] = set()  # instances whose last listing was a 401/403
        self.listing_tried: dict[str, float] = {}  # instance id -> last listing attempt
        self.failing: dict[tuple[str, str], str] = {}  # (instance, probe) -> last reason
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

    async def probe(self, inst: InstanceState) -> ProbeResult:
        """Readiness at the server kind's own path or ``health_url`` (no inference, never the
        model list), the model list when due (:meth:`list_models`), then the opt-in model
        check; all with the instance's credential."""
        h = self.pool.config.health
        timeout = httpx.Timeout(h.probe_timeout_s)
        first_byte_s = self.pool.config.timeouts.first_byte_s
        up = self.pool.upstreams.get(inst.id)
        if up is None:
            return ProbeResult("down", "removed")  # left the pool while being probed
        auth = dict(up.auth)
        try:
            r = await self.client.get(up.health_url, headers=auth, timeout=timeout)
        except httpx.HTTPError as exc:
            reason = failure_reason(exc)
            # A server that answers one request at a time (llama-cpp-python) keeps a probe
            # waiting behind a long generation: busy, not down, while our requests progress.
            if reason == "timeout" and busy_not_stuck(inst, self.pool.clock(), first_byte_s):
                return ProbeResult("busy", "timeout_busy")
            return ProbeResult("down", reason)
        if not (200 <= r.status_code < 300 or (r.status_code == 404 and up.readiness_optional)):
            return ProbeResult("down", f"http_{r.status_code}")
        refused = await self.list_models(inst)
        if refused is not None:
            return refused
        now = self.pool.clock()
        due = now - self.model_probed_at.get(inst.id, -math.inf) >= h.model_probe_interval_s
        if h.probe_model and inst.loaded and due:
            self.model_probed_at[inst.id] = now
            # The port answering is not enough: ask a loaded model for one token (or, on an
            # embedding server, one embedding: it has no completions route).
            model = next(iter(inst.loaded))
            body: dict[str, Any]
            if up.task == "embed":
                path, body = "/v1/embeddings", {"model": model, "input": "ping"}
            else:
                path, body = "/v1/completions", {"model": model, "prompt": "ping", "max_tokens": 1}
            try:
                r = await self.client.post(
                    f"{inst.url}{path}", json=body, headers=auth, timeout=timeout
                )
            except httpx.TimeoutException:
                # A full batch queues the probe like any request, and marking a saturated
                # instance unhealthy would push its load onto the others. Busy is not
                # dead while its own requests are within their patience.
                if busy_not_stuck(inst, self.pool.clock(), first_byte_s):
                    return ProbeResult("busy", "timeout_busy")
                return ProbeResult("down", "model_check_timeout")
            except httpx.HTTPError as exc:
                return ProbeResult("down", f"model_check_{failure_reason(exc)}")
            if r.status_code != 200:
                return ProbeResult("down", f"model_check_http_{r.status_code}")
        return ProbeResult("up")

    async def list_models(self, inst: InstanceState) -> ProbeResult | None:
        """Read the instance's model list when it is due: every probe until it has been read
        once (the instance takes no work without it) and while the server refuses our
        credential (401/403: every request would be refused too, so the instance is down),
        otherwise every ``models_interval_s``. Other failures keep the last list, are logged
        and counted, and wait for the next interval: a server that answers one request at a
        time would otherwise collect an abandoned listing every probe."""
        pool = self.pool
        up = pool.upstreams.get(inst.id)
        now = pool.clock()
        due = (
            inst.id not in pool.listed
            or inst.id in self.listing_refused
            or now - self.listing_tried.get(inst.id, -math.inf)
            >= pool.config.health.models_interval_s
        )
        if up is None or not due or not pool.begin_listing(inst.id):
            return None
        self.listing_tried[inst.id] = now
        reason: str | None = None
        try:
            r = await self.client.get(
                up.models_url,
                headers=dict(up.auth),
                timeout=httpx.Timeout(pool.config.health.probe_timeout_s),
            )
            if r.status_code != 200:
                reason = f"http_{r.status_code}"
            else:
                cards = pool.model_cards.setdefault(inst.id, {})
                if apply_models(inst, r.json(), pool.clock(), cards, up.models):
                    pool.listed[inst.id] = pool.clock()
                else:
                    reason = "invalid_body"
        except httpx.HTTPError as exc:
            reason = failure_reason(exc)
        except ValueError:
            reason = "invalid_body"
        finally:
            pool.end_listing(inst.id)
        self.note(inst, "models", reason)
        if reason in ("http_401", "http_403"):
            self.listing_refused.add(inst.id)
            return ProbeResult("down", f"models_{reason}")
        self.listing_refused.discard(inst.id)
        return None

    def note(self, inst: InstanceState, probe: str, reason: str | None) -> None:
        """Count a failed listing or scrape (``reason``), or a good one (None); log when the
        reason changes, so a failure repeated every second is one line, not one per try."""
        key = (inst.id, probe)
        before = self.failing.get(key)
        if reason is None:
            if before is not None:
                del self.failing[key]
                log.info(f"instance {probe} recovered", instance=inst.id, was=before)
            return
        self.metrics.probe_failures.labels(inst.id, probe, reason).inc()
        if before != reason:
            self.failing[key] = reason
            log.warning(f"instance {probe} failed", instance=inst.id, reason=reason)

    async def probe_all(self) -> None:
        members = list(self.pool.instances)  # joins and leaves may happen while we probe
        results = await asyncio.gather(*(self.probe(i) for i in members))
        h = self.pool.config.health
        for inst, res in zip(members, results, strict=True):
            if res.state == "busy":
                self.metrics.probe_failures.labels(inst.id, "readiness", res.reason).inc()
                continue
            now = self.pool.clock()
            ok = res.state == "up"
            if ok:
                inst.probe_ok_at = now
            else:
                self.metrics.probe_failures.labels(inst.id, "readiness", res.reason).inc()
            if record_probe(inst, ok, now, rise=h.healthy_after, fall=h.unhealthy_after):
                up = self.pool.upstreams.get(inst.id)
                log.info(
                    "instance health changed",
                    instance=inst.id,
                    healthy=ok,
                    reason=res.reason,
                    url=up.health_url if up is not None else None,
                )
                self.metrics.health_changes.labels(inst.id, str(ok).lower(), res.reason).inc()
        # Also without a change: ejections and slow-start ramps end with time, not events,
        # and queued requests must not wait for an unrelated completion to notice.
        self.pool.admission.wake()

    # -- load signals ---------------------------------------------------------------------------

    async def scrape(self, inst: InstanceState) -> None:
        up = self.pool.upstreams.get(inst.id)
        if up is None or up.metrics_url is None:
            return
        reason: str | None = None
        try:
            r = await self.client.get(
                up.metrics_url,
                headers=dict(up.auth),
                timeout=httpx.Timeout(self.pool.config.scrape.interval_s),
            )
            if r.status_code == 200:
                sig = self.signals[inst.id] = parse_metrics(r.text, time.monotonic(), up.kind)
                if self.cache is not None:
                    self.cache.observe(inst.id, sig)
            else:
                reason = f"http_{r.status_code}"
        except httpx.HTTPError as exc:
            reason = failure_reason(exc)
        except ValueError:
            reason = "invalid_body"
        # The old sample ages out in scrape_all; the failure is said once and counted.
        self.note(inst, "metrics", reason)

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
