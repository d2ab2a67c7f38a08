"""Admission: priority tiers with reserved capacity, bounded queues with a timeout, and
per-tenant token buckets.

A tier may start a request while the pool's running requests stay under its share of the
pool's slots (the top tier's share is 1.0, so ``1 - standard share`` is reserved for it).
Otherwise the request waits in its tier's FIFO queue; higher tiers are woken first. When the
queue is full, or the predicted wait is longer than the tier's timeout, the request is refused
at once with a 429 rather than after sitting out the whole timeout.

Retry-After tells the truth about when a slot would be free for the refused request: the
queue ahead of it drains one place per release, and releases come ``running / service time``
per second (the service time learned from admitted requests, the pool's cost-based estimate
until then). Requests refused earlier and told to come back are ahead of it too: each refusal
promises a return, so a burst of refusals is told a spread of times that match the backlog,
instead of one small number that brings them all back together. A jitter (a share either way)
separates those told the same thing at the same moment.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
import time
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
    # Seconds one admitted request holds its slot, from the cost estimate and the batch it
    # joins: what the drain prediction uses before it has observed any (0: unknown).
    service_s_hint: float = 0.0


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


def drain_wait(position: int, running: int, allowed: int, service_s: float) -> float:
    """Seconds until the ``position``-th request in line (1: the head) could start: after
    ``running - allowed + position`` releases, which come ``running / service_s`` per second
    (half an interval is already gone on average when the prediction is made)."""
    releases = max(0, running - allowed + position)
    if releases == 0:
        return 0.0
    if service_s <= 0:
        return math.inf
    return max(0.0, releases - 0.5) * service_s / max(running, allowed, 1)


@dataclass(slots=True)
class RetryBudget:
    """Balancer-side retries (another instance after a refused connection) may add at most
    ``ratio`` of the requests received, plus ``min_per_s``: when a whole pool fails, retries
    must not double the load on what is left (a budget, as Finagle and Envoy keep)."""

    ratio: float = 0.2
    min_per_s: float = 5.0
    tokens: float = 0.0
    updated: float = -1.0

    def _refill(self, now: float) -> None:
        if self.updated >= 0:
            self.tokens += (now - self.updated) * self.min_per_s
        self.updated = now
        self.tokens = min(self.tokens, max(10.0, self.min_per_s))

    def deposit(self, now: float) -> None:
        self._refill(now)
        self.tokens = min(self.tokens + self.ratio, max(10.0, self.min_per_s))

    def withdraw(self, now: float) -> bool:
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


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
    clock: Callable[[], float] = time.monotonic
    jitter: float = 0.0  # Retry-After is spread by this share either way
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    running: int = 0
    queues: dict[str, deque[_Waiter]] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    # Learned seconds a slot is held (exponentially weighted), and how many samples it has.
    service_s: float = 0.0
    service_samples: int = 0
    # When requests refused so far were told to come back (sorted): those due back before a
    # newly refused request would be are ahead of it in line.
    promised: list[float] = field(default_factory=list)
    max_promised: int = 10_000  # rule 8: a bound, whatever the refusal rate

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

    def service_time(self, load: PoolLoad) -> float:
        """Seconds a slot is held: observed once a few requests have finished, else the
        pool's estimate, else the work in flight over the pool's capacity."""
        if self.service_samples >= 3:
            return self.service_s
        if load.service_s_hint > 0:
            return load.service_s_hint
        if self.service_samples:
            return self.service_s
        if load.capacity > 0 and load.outstanding > 0:
            return load.outstanding / load.capacity
        return 0.0

    def _forget_due(self, now: float) -> None:
        due = bisect.bisect_right(self.promised, now)
        if due:
            del self.promised[:due]

    def _wait_at(self, tier: TierSpec, position: int, load: PoolLoad) -> float:
        allowed = allowed_running(tier, load.slots)
        return drain_wait(position, self.running, allowed, self.service_time(load))

    def _reject(self, tier: TierSpec, position: int, load: PoolLoad, why: str) -> Overloaded:
        """Refuse, telling the client when its turn would come: behind the queue and the
        refused requests still due back."""
        self.rejected[tier.name] += 1
        now = self.clock()
        self._forget_due(now)
        # Fixed point: the refused requests due back before this one's turn are ahead of it,
        # which pushes its turn later, which may put more of them ahead.
        place = position
        wait = self._wait_at(tier, place, load)
        for _ in range(64):
            if not math.isfinite(wait):
                break
            ahead = position + bisect.bisect_right(self.promised, now + wait)
            if ahead <= place:
                break
            place, wait = ahead, self._wait_at(tier, ahead, load)
        if not math.isfinite(wait):
            wait = tier.queue_timeout_s
        wait *= 1.0 + self.jitter * (2.0 * self.rng.random() - 1.0)
        bisect.insort(self.promised, now + wait)
        if len(self.promised) > self.max_promised:
            del self.promised[0]
        return Overloaded(f"{why} (tier {tier.name})", retry_after=wait)

    async def acquire(self, tier_name: str, cost: float) -> float:
        """Wait for a slot; returns when it was granted (the clock's time), which
        :meth:`release` takes back to learn how long slots are held."""
        tier = self.tiers[tier_name]
        load = self.load()
        ahead, _ = self._ahead(tier)
        if ahead == 0 and self._can_start(tier, load.slots):
            self.running += 1
            return self.clock()
        queue = self.queues[tier.name]
        if len(queue) >= tier.queue_limit:
            raise self._reject(tier, ahead + 1, load, "queue full")
        if self._wait_at(tier, ahead + 1, load) > tier.queue_timeout_s:
            raise self._reject(tier, ahead + 1, load, "predicted wait exceeds the queue timeout")
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
            return self.clock()
        except TimeoutError:
            if waiter.future.done():
                return self.clock()  # woken as the timer fired: the slot is already counted
            # Waited the full timeout: its turn is as far as its place in line says.
            position = self._ahead_of(waiter)
            queue.remove(waiter)
            waiter.future.cancel()
            raise self._reject(tier, position, self.load(), "queue timeout") from None
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

    def _ahead_of(self, waiter: _Waiter) -> int:
        """1 + the requests that start before ``waiter`` (higher tiers, then its own queue)."""
        count = 1
        for other in self.tiers.values():
            if other.rank < waiter.tier.rank:
                count += len(self.queues[other.name])
        for w in self.queues[waiter.tier.name]:
            if w is waiter:
                break
            count += 1
        return count

    def release(self, granted_at: float | None = None) -> None:
        self.running = max(0, self.running - 1)
        if granted_at is not None:
            held = max(0.0, self.clock() - granted_at)
            # A memory of ~10 requests: the drain rate follows a change of request mix fast.
            self.service_samples += 1
            gain = max(0.1, 1.0 / self.service_samples)
            self.service_s += gain * (held - self.service_s)
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
        granted = await self.acquire(tier_name, cost)
        try:
            yield
        finally:
            self.release(granted)
