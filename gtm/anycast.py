"""Anycast: this node announces the service prefix over BGP only while it should get traffic.

A BGP speaker on the node (BIRD) holds a static protocol with the service prefix, exported to
its peers; GTM enables or disables that protocol through ``birdc`` (BIRD's control socket), so
the route appears and is withdrawn as GTM's own view of itself changes. The node withdraws when

* it is **draining**: the drain file (``GTM_ANYCAST_DRAIN_FILE``) exists, for maintenance, or
  the node is stopping (the route goes before the listeners do);
* it is **unhealthy**: its own DNS listener did not answer a query from this node
  ``fall`` times in a row (the address the world reaches is the one that must work);
* it has **lost the database** for longer than ``GTM_ANYCAST_MAX_DB_LOSS_S``: its view of
  policies and drains may be stale, and other nodes that still hear the fleet should answer.

Everything but the ``birdc`` call and the self-query is the pure :func:`wanted`, so the rules
are tested without a speaker; the speaker itself is tested against real BIRD daemons.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import dns.asyncquery
import dns.exception
import dns.message
import structlog
from prometheus_client import Gauge

log = structlog.get_logger(__name__)

ANNOUNCED = Gauge("gtm_anycast_announced", "1 while this node announces the anycast prefix")


@dataclass(frozen=True, slots=True)
class Health:
    draining: bool
    self_check_failures: int  # consecutive failed queries to the node's own listener
    db_lost_s: float  # seconds since the node last heard from the shared database


@dataclass(frozen=True, slots=True)
class Rules:
    fall: int = 2
    max_db_loss_s: float = 30.0


def wanted(health: Health, rules: Rules) -> tuple[bool, str]:
    """Whether to announce, and why (or why not)."""
    if health.draining:
        return False, "draining"
    if health.self_check_failures >= rules.fall:
        return False, f"own DNS listener failed {health.self_check_failures} checks in a row"
    if rules.max_db_loss_s > 0 and health.db_lost_s > rules.max_db_loss_s:
        return False, f"no word from the shared database for {health.db_lost_s:.0f} s"
    return True, "healthy"


class BirdError(RuntimeError):
    pass


@dataclass
class Bird:
    """BIRD 2's control socket: enable or disable the protocol holding the prefix."""

    socket: Path
    protocol: str = "gtm_anycast"
    birdc: str = "birdc"

    async def set(self, announce: bool) -> None:
        verb = "enable" if announce else "disable"
        proc = await asyncio.create_subprocess_exec(
            self.birdc,
            "-s",
            str(self.socket),
            verb,
            self.protocol,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        text = out.decode(errors="replace")
        # "gtm_anycast: enabled", "...: already enabled" (and the same for disabled)
        if proc.returncode != 0 or f"{self.protocol}:" not in text:
            raise BirdError(f"birdc {verb} {self.protocol}: {text.strip() or proc.returncode}")


async def self_check(host: str, port: int, name: str, timeout_s: float = 1.0) -> bool:
    """One query to the node's own DNS listener: any well-formed answer is good."""
    query = dns.message.make_query(name, "SOA")
    try:
        await dns.asyncquery.udp(query, host, port=port, timeout=timeout_s)
    except (dns.exception.DNSException, OSError):
        return False
    return True


class Announcer:
    def __init__(
        self,
        speaker: Bird,
        rules: Rules,
        *,
        db_lost_s: Callable[[], float],
        check: Callable[[], Awaitable[bool]] | None,
        drain_file: Path | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.speaker, self.rules = speaker, rules
        self.db_lost_s, self.check = db_lost_s, check
        self.drain_file, self.interval_s = drain_file, interval_s
        self.stopping = False
        self.failures = 0
        self.announced: bool | None = None  # unknown until the speaker has been told once
        self.reason = ""
        self._task: asyncio.Task[None] | None = None

    def health(self) -> Health:
        draining = self.stopping or (self.drain_file is not None and self.drain_file.exists())
        return Health(draining, self.failures, self.db_lost_s())

    async def step(self) -> bool:
        """Check once and tell the speaker if the answer changed; returns what is wanted."""
        if self.check is not None:
            ok = await self.check()
            self.failures = 0 if ok else self.failures + 1
        announce, reason = wanted(self.health(), self.rules)
        if announce != self.announced:
            await self.speaker.set(announce)
            log.warning("anycast.announce" if announce else "anycast.withdraw", reason=reason)
            self.announced = announce
            ANNOUNCED.set(1 if announce else 0)
        self.reason = reason
        return announce

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="anycast")

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception as exc:  # birdc missing or the speaker down: try again
                self.announced = None  # tell it again once it answers
                log.error("anycast.speaker_failed", error=str(exc))
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Withdraw first: the route goes while the listeners still answer what is in flight."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.stopping = True
        try:
            await self.speaker.set(False)
            ANNOUNCED.set(0)
            self.announced = False
        except (BirdError, OSError) as exc:
            log.error("anycast.withdraw_failed", error=str(exc))


__all__ = ["Announcer", "Bird", "BirdError", "Health", "Rules", "self_check", "wanted"]
