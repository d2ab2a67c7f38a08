"""The balancer's KV-cache index kept by the instances' event streams, and what it says about
each stream: live, waiting for its first event, or fallen back to the routing-history estimate.

Each instance with ``kv_events`` in the configuration is followed by
:class:`regional_lb.upstream.kv_subscriber.KvEventSubscriber`. A stream falls back when

* its publisher's connection drops (``disconnected``: the ZMQ monitor says so at once), or
* it goes silent while it should speak (``silent``): a request whose prompt had blocks the
  index did not hold ended well there, so the server stored new blocks and published them, yet
  no event came within ``kv_cache.silent_after_s``. Silence alone proves nothing (a server
  whose cache does not change has nothing to publish), which is why only an expected event
  counts.

Falling back empties the instance's entries (they can no longer be kept current) and the
index estimates it from what is routed there until its next event, which brings it back. Each
fallback is counted (``regional_lb_kv_stream_fallbacks_total``), logged once per episode, and
shown by ``GET /admin/kv``. Instances without ``kv_events`` are estimated from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regional_lb.balancing.kv_index import KvIndex
from regional_lb.config import BalancerConfig, InstanceConfig
from regional_lb.upstream.kv_subscriber import KvEventSubscriber
from regional_lb.upstream.pool import Lease

log = structlog.get_logger("regional_lb")


@dataclass(slots=True)
class StreamState:
    endpoint: str
    topic: str
    status: str = "waiting"  # waiting (no event yet), live, fallback
    reason: str | None = None  # why it fell back: disconnected, silent
    since: float = 0.0  # pool clock: when the status was entered
    # When a request that must have stored new blocks ended with no event since (pool clock).
    expected_since: float | None = None


class KvStreams:
    """Owns the index's subscriptions; ``clock`` is the pool's."""

    def __init__(self, config: BalancerConfig, index: KvIndex, clock: Callable[[], float]):
        self.index, self.clock = index, clock
        self.silent_after_s = config.kv_cache.silent_after_s
        self.streams: dict[str, StreamState] = {}
        self.fallbacks: dict[tuple[str, str], int] = {}
        self.subscriber: KvEventSubscriber | None = None
        self._configured = list(config.instances)
        for ic in config.instances:
            index.track(ic.id)

    # -- lifecycle (on the running loop) --------------------------------------------------------

    def start(self) -> None:
        self.subscriber = KvEventSubscriber(
            self.index, self.clock, on_batch=self.heard, on_disconnect=self.disconnected
        )
        for ic in self._configured:
            self.join(ic)

    async def stop(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.close()
            self.subscriber = None

    def join(self, ic: InstanceConfig) -> None:
        self.index.track(ic.id)
        if ic.kv_events is None or self.subscriber is None:
            return
        self.streams[ic.id] = StreamState(
            ic.kv_events.endpoint, ic.kv_events.topic, since=self.clock()
        )
        self.subscriber.add(ic.id, ic.kv_events.endpoint, ic.kv_events.topic.encode())

    def leave(self, instance_id: str) -> None:
        self.streams.pop(instance_id, None)
        if self.subscriber is not None:
            self.subscriber.remove(instance_id)
        self.index.untrack(instance_id)

    # -- what the streams do ---------------------------------------------------------------------

    def heard(self, instance_id: str) -> None:
        """A batch arrived from the instance's publisher."""
        st = self.streams.get(instance_id)
        if st is None:
            return
        st.expected_since = None
        if st.status != "live":
            if st.status == "fallback":
                log.info("kv events resumed", instance=instance_id, was=st.reason)
            st.status, st.reason, st.since = "live", None, self.clock()

    def disconnected(self, instance_id: str) -> None:
        self.fall_back(instance_id, "disconnected")

    def fall_back(self, instance_id: str, reason: str) -> None:
        st = self.streams.get(instance_id)
        if st is None or st.status == "fallback":
            return
        self.index.lost_stream(instance_id)
        st.status, st.reason, st.since, st.expected_since = "fallback", reason, self.clock(), None
        key = (instance_id, reason)
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1
        log.warning(
            "kv events lost: routing on the routing-history estimate",
            instance=instance_id,
            reason=reason,
            endpoint=st.endpoint,
        )

    def routed(self, lease: Lease, blocks: Sequence[int]) -> None:
        """A request with these blocks was leased: when it ends well on a live stream and the
        index lacked some of its blocks, the server stored them, so an event is due."""
        iid = lease.instance.id
        st = self.streams.get(iid)
        if st is None or st.status != "live" or not blocks:
            return
        if self.index.matched_blocks(iid, blocks) >= len(blocks):
            return  # all cached already: nothing new to publish
        routed_at = self.clock()

        def ended() -> None:
            if lease.outcome != "ok" or st.status != "live" or st.expected_since is not None:
                return
            heard = self.index.last_event_at(iid)
            if heard is None or heard < routed_at:
                st.expected_since = self.clock()

        lease.on_end.append(ended)

    def check(self) -> None:
        """Streams that owe an event past ``silent_after_s`` fall back (on a schedule)."""
        now = self.clock()
        for iid, st in list(self.streams.items()):
            due = st.expected_since
            if st.status == "live" and due is not None and now - due > self.silent_after_s:
                self.fall_back(iid, "silent")

    async def check_job(self) -> None:
        self.check()

    # -- reading ---------------------------------------------------------------------------------

    def status(self, instance_ids: Iterable[str]) -> list[dict[str, object]]:
        now = self.clock()
        out: list[dict[str, object]] = []
        for iid in instance_ids:
            st = self.streams.get(iid)
            last = self.index.last_event_at(iid)
            out.append(
                {
                    "id": iid,
                    "endpoint": st.endpoint if st else None,
                    "topic": st.topic if st else None,
                    # live / waiting / fallback; "none": no kv_events configured.
                    "stream": st.status if st else "none",
                    "reason": st.reason if st else None,
                    "for_s": round(now - st.since, 3) if st else None,
                    "index": self.index.mode(iid),  # events / history
                    "blocks_held": self.index.blocks_held(iid),
                    "last_event_age_s": None if last is None else round(now - last, 3),
                }
            )
        return out


class KvCollector(Collector):
    """The index and its streams as Prometheus metrics, read at scrape time."""

    def __init__(self, streams: KvStreams, instance_ids: Callable[[], list[str]]) -> None:
        self.streams, self.instance_ids = streams, instance_ids

    def collect(self) -> Iterable[Metric]:
        s, index = self.streams, self.streams.index
        held = GaugeMetricFamily(
            "regional_lb_kv_blocks_indexed",
            "KV blocks the index holds for the instance (bounded by kv_cache.max_blocks)",
            labels=["instance"],
        )
        live = GaugeMetricFamily(
            "regional_lb_kv_stream_live",
            "1 while the instance's KV events keep the index (0: routing-history estimate)",
            labels=["instance"],
        )
        for iid in self.instance_ids():
            held.add_metric([iid], index.blocks_held(iid))
            st = s.streams.get(iid)
            live.add_metric([iid], 1.0 if st is not None and st.status == "live" else 0.0)
        yield held
        yield live
        falls = CounterMetricFamily(
            "regional_lb_kv_stream_fallbacks",
            "Times an instance's KV-event stream was lost (disconnected, silent) and routing "
            "fell back to the routing-history estimate",
            labels=["instance", "reason"],
        )
        for (iid, reason), n in sorted(s.fallbacks.items()):
            falls.add_metric([iid, reason], n)
        yield falls
        events = CounterMetricFamily(
            "regional_lb_kv_events",
            "What the KV index did with the events it was sent: blocks stored, removed, "
            "caches cleared, batches applied, and each kind of bad input dropped or trimmed",
            labels=["result"],
        )
        c = index.counts
        for name in (
            "batches",
            "stored",
            "removed",
            "cleared",
            "malformed",
            "out_of_order",
            "gaps",
            "unknown_instance",
            "foreign_block_size",
            "overflow",
            "restarts",
            "fallbacks",
        ):
            events.add_metric([name], getattr(c, name))
        yield events
