"""Admission: priority tiers with reserved capacity, bounded queues with a timeout, and
per-tenant token buckets.

A tier may start a request while the pool's running requests stay under its share of the
pool's slots (the top tier's share is 1.0, so ``1 - standard share`` is reserved for it).
Otherwise the request waits in its tier's FIFO queue; higher tiers are woken first. When the
queue is full, or the predicted wait is longer than the tier's timeout, the request is refused
at once with a 429 whose Retry-After is that predicted drain time, rather than after sitting
out the whole timeout.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from regional_lb.errors import Overloaded


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    rank: int  # 0 is the top tier
    max_utilisation: float  # share of the pool's slots this tier may fill
    queue_limit: int = 100
    queue_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class PoolLoad:
    slots: int  # concurrent requests the eligible instances accept
    outstanding: float  # cost units in flight
    capacity: float  # cost units per second the eligible instances finish


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up."""

    rate: float
    burst: float
    tokens: float = -1.0
    updated: float = 0.0

    def take(self, now: float, n: float = 1.0) -> float:
        """Take ``n`` tokens; returns 0 when granted, else seconds until they would be."""
        if self.tokens < 0:
            self.tokens, self.updated = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate if self.rate > 0 else math.inf


def allowed_running(tier: TierSpec, slots: int) -> int:
    return math.floor(tier.max_utilisation * slots + 1e-9)


def predicted_wait(
    tier: TierSpec, running: int, queued_ahead_work: float, cost: float, load: PoolLoad
) -> float:
    """Seconds until this request would start: the work queued ahead of it, plus the part of
    the running work that must finish before its tier is under its limit, over capacity."""
    if load.capacity <= 0:
        return math.inf
    allowed = allowed_running(tier, load.slots)
    excess = max(0, running + 1 - allowed)
    excess_work = load.outstanding * excess / max(running, 1)
    return (queued_ahead_work + excess_work + cost) / load.capacity


def retry_after_for(wait: float, tier: TierSpec) -> float:
    """Refused because the predicted wait passes the timeout: the pool must first drain the
    excess, after which a request would start within the timeout."""
    return max(0.0, wait - tier.queue_timeout_s)


def retry_after_header(seconds: float) -> str:
    """HTTP Retry-After is whole seconds; round up so a client never comes back too early."""
    if not math.isfinite(seconds):
        return "60"
    return str(max(1, math.ceil(seconds)))


@dataclass(slots=True)
class _Waiter:
    tier: TierSpec
    cost: float
    future: asyncio.Future[None]


@dataclass
class AdmissionController:
    tiers: dict[str, TierSpec]
    load: Callable[[], PoolLoad]
    running: int = 0
    queues: dict[str, deque[_Waiter]] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.tiers:
            self.queues.setdefault(name, deque())
            self.rejected.setdefault(name, 0)

    def depth(self) -> dict[str, int]:
        return {name: len(q) for name, q in self.queues.items()}

    def _ahead(self, tier: TierSpec) -> tuple[int, float]:
        count, work = 0, 0.0
        for other in self.tiers.values():
            if other.rank <= tier.rank:
                q = self.queues[other.name]
                count += len(q)
                work += sum(w.cost for w in q)
        return count, work

    def _can_start(self, tier: TierSpec, slots: int) -> bool:
        return self.running < allowed_running(tier, slots)

    def _reject(self, tier: TierSpec, wait: float, why: str) -> Overloaded:
        self.rejected[tier.name] += 1
        return Overloaded(f"{why} (tier {tier.name})", retry_after=wait)

    async def acquire(self, tier_name: str, cost: float) -> None:
        tier = self.tiers[tier_name]
        load = self.load()
        ahead, ahead_work = self._ahead(tier)
        if ahead == 0 and self._can_start(tier, load.slots):
            self.running += 1
            return
        wait = predicted_wait(tier, self.running, ahead_work, cost, load)
        queue = self.queues[tier.name]
        if len(queue) >= tier.queue_limit:
            # Come back when the head of the queue should have started: a place frees then.
            head = predicted_wait(tier, self.running, 0.0, queue[0].cost if queue else 0.0, load)
            raise self._reject(tier, head, "queue full")
        if wait > tier.queue_timeout_s:
            raise self._reject(
                tier, retry_after_for(wait, tier), "predicted wait exceeds the queue timeout"
            )
        waiter = _Waiter(tier, cost, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), tier.queue_timeout_s)
            if task is not None and task.cancelling() > cancels:
                # Python 3.11's wait_for returns the result, swallowing the cancellation,
                # when the client goes away in the instant its slot is granted: stop here
                # (the slot is handed back below) rather than run a request nobody awaits.
                raise asyncio.CancelledError
        except TimeoutError:
            if waiter.future.done():
                return  # woken as the timer fired: the slot is already counted
            queue.remove(waiter)
            waiter.future.cancel()
            # Waited the full timeout: retry when the work still ahead should have drained.
            _, ahead_work = self._ahead(tier)
            wait = predicted_wait(tier, self.running, ahead_work, cost, self.load())
            raise self._reject(tier, wait, "queue timeout") from None
        except asyncio.CancelledError:
            # The client went away while waiting: leave the queue, and hand back a slot
            # that was granted in the same instant.
            if waiter in queue:
                queue.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()
            else:
                waiter.future.cancel()
            raise

    def release(self) -> None:
        self.running = max(0, self.running - 1)
        self.wake()

    def wake(self) -> None:
        """Start queued requests, top tier first, while their tier has room."""
        if not any(self.queues.values()):
            return  # the common case, once per completion: skip computing the pool's load
        slots = self.load().slots
        for tier in sorted(self.tiers.values(), key=lambda t: t.rank):
            queue = self.queues[tier.name]
            while queue and self._can_start(tier, slots):
                waiter = queue.popleft()
                if waiter.future.done():
                    continue
                self.running += 1
                waiter.future.set_result(None)

    @asynccontextmanager
    async def slot(self, tier_name: str, cost: float) -> AsyncIterator[None]:
        await self.acquire(tier_name, cost)
        try:
            yield
        finally:
            self.release()
