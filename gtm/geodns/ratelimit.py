"""Response rate limiting (RRL) per client network, as authoritative servers do against
reflection attacks: a token bucket per /24 (IPv6 /56); past the limit, one response in ``slip``
is sent truncated (so a real client behind a spoofed flood retries over TCP, which cannot be
spoofed) and the rest are dropped. TCP is never limited, and neither are the exempt networks
(loopback by default: it cannot be spoofed from outside the host).

The buckets live in two generations (:mod:`gtm.geodns.budget`): a network that keeps sending
keeps its bucket, so a flood from spoofed random sources cannot push the limited networks'
buckets out (before, a full table was cleared and every limited network started afresh with a
full burst); a network dropped with its generation had not sent for a whole generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address


class Limit(Enum):
    ANSWER = "answer"
    SLIP = "slip"  # answer truncated, empty
    DROP = "drop"


_ANSWER, _SLIP, _DROP = Limit.ANSWER, Limit.SLIP, Limit.DROP


def network_key(client: IPv4Address | IPv6Address) -> tuple[int, int]:
    """The network a client's responses are limited by: its /24 (IPv4) or /56 (IPv6)."""
    return (4, int(client) >> 8) if client.version == 4 else (6, int(client) >> 72)


class ResponseRateLimiter:
    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        slip: int = 2,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 100_000,
        exempt: tuple[IPv4Network | IPv6Network, ...] = (),
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst if burst is not None else rate
        self.slip = slip
        self._clock = clock
        self._half = max(1, max_entries // 2)
        self.exempt = exempt
        # network key -> [tokens, last refill time, limited responses so far]; young and old.
        self._buckets: dict[tuple[int, int], list[float]] = {}
        self._old: dict[tuple[int, int], list[float]] = {}
        # Sender host string -> its network key, None when exempt. Bounded like the buckets.
        self._keys: dict[str, tuple[int, int] | None] = {}
        self.limited = 0
        self.slipped = 0

    def __len__(self) -> int:
        return len(self._buckets) + len(self._old)

    def check(self, client: IPv4Address | IPv6Address) -> Limit:
        if any(client in net for net in self.exempt):
            return _ANSWER
        return self.check_key(network_key(client))

    def check_host(self, host: str) -> Limit:
        """:meth:`check` for a sender as the transport names it (memoised per host string)."""
        keys = self._keys
        if host in keys:
            key = keys[host]
        else:
            if len(keys) >= self._half:
                keys.clear()  # a pure memo: clearing costs a recomputation, not state
            client = ip_address(host.split("%", 1)[0])
            key = keys[host] = (
                None if any(client in net for net in self.exempt) else network_key(client)
            )
        return _ANSWER if key is None else self.check_key(key)

    def check_key(self, key: tuple[int, int]) -> Limit:
        """:meth:`check` for a client whose :func:`network_key` the caller already knows.

        On every UDP query when the limiter is on, so written for the interpreter: no calls
        but the clock, and the verdicts as module globals (an enum member through its class
        costs more than the arithmetic here)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._old.pop(key, None)
            if len(self._buckets) >= self._half:
                self._old, self._buckets = self._buckets, {}
            if bucket is None:
                self._buckets[key] = [self.burst - 1, now, 0]
                return _ANSWER
            self._buckets[key] = bucket
        tokens = bucket[0] + (now - bucket[1]) * self.rate
        if tokens > self.burst:
            tokens = self.burst
        bucket[1] = now
        if tokens >= 1:
            bucket[0] = tokens - 1
            return _ANSWER
        bucket[0] = tokens
        bucket[2] += 1
        self.limited += 1
        if self.slip and int(bucket[2]) % self.slip == 0:
            self.slipped += 1
            return _SLIP
        return _DROP
