"""Response rate limiting (RRL) per client network, as authoritative servers do against
reflection attacks: a token bucket per /24 (IPv6 /56); past the limit, one response in ``slip``
is sent truncated (so a real client behind a spoofed flood retries over TCP, which cannot be
spoofed) and the rest are dropped. TCP is never limited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from ipaddress import IPv4Address, IPv6Address


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
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst if burst is not None else rate
        self.slip = slip
        self._clock = clock
        self._max = max_entries
        # network key -> [tokens, last refill time, limited responses so far]
        self._buckets: dict[tuple[int, int], list[float]] = {}
        self.limited = 0
        self.slipped = 0

    def check(self, client: IPv4Address | IPv6Address) -> Limit:
        return self.check_key(network_key(client))

    def check_key(self, key: tuple[int, int]) -> Limit:
        """:meth:`check` for a client whose :func:`network_key` the caller already knows.

        On every UDP query when the limiter is on, so written for the interpreter: no calls
        but the clock, and the verdicts as module globals (an enum member through its class
        costs more than the arithmetic here)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._max:
                self._purge(now)
            self._buckets[key] = [self.burst - 1, now, 0]
            return _ANSWER
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

    def _purge(self, now: float) -> None:
        # Buckets that have refilled completely carry no state worth keeping.
        full = [
            k for k, b in self._buckets.items() if b[0] + (now - b[1]) * self.rate >= self.burst
        ]
        for k in full:
            del self._buckets[k]
        if len(self._buckets) >= self._max:
            self._buckets.clear()
