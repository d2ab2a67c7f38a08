"""The front's connections: how many may be open, from whom, how long a request may take to come.

A client that opens connections and sends its request heads a byte at a time (slowloris) holds
a connection, a parser and a buffer each, for as long as it likes: uvicorn bounds neither the
number of connections (``limit_concurrency`` answers 503 only once a head is complete) nor the
time a head may take (its keep-alive timer runs only between requests). So the front does both:

- **a connection cap** (``max_connections``) and **a per-client cap** (``max_per_client``, by the
  connection's address; trusted proxies are exempt, since every client behind them shares their
  address): a connection past either is closed at once, before a byte is read, and counted;
- **a head timeout** (``header_timeout_s``): a request head must arrive whole within this time
  of the connection being made, or of its first byte on a kept-alive connection. A head still
  incomplete then gets 408 and the connection is closed; a connection that sent nothing at all
  is closed without a word. A TLS handshake gets the same time, and holds its slot meanwhile.
- **a body deadline** (``body_timeout_s`` and ``body_min_rate``): a request body must keep
  arriving. It is cut when nothing of it came for ``body_timeout_s``, or when it is slower on
  average than ``body_min_rate`` bytes a second after a grace of ``body_timeout_s`` (the deadline
  is ``body_timeout_s`` after the head plus a second for every ``body_min_rate`` bytes received):
  a client that declares a length and stops, or trickles its body a byte at a time, holds its
  slot that long and no longer. Time the front itself is not reading (its application has not
  taken what came) is not the client's, and does not count. A request still being read is
  answered 408 by the application (:func:`body_timed_out`; counted with its decision, like every
  response) and the connection closed; a request already answered (a redirect does not wait for
  its body) has its connection closed.

Between requests, uvicorn's keep-alive timer closes an idle connection.

The per-client table holds an entry only while that client has a connection open, so it never
outgrows the cap. Every worker process (``--workers``) has its own budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 10_000
    max_per_client: int = 512  # 0: no per-client limit
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0  # a body's grace, and the longest it may stall
    # Bytes/s a body must average after its grace (0: it must be whole within body_timeout_s).
    body_min_rate: float = 1024.0

    def body_deadline(self, start: float, last: float, received: int) -> float:
        """When a body begun at ``start``, of which ``received`` bytes came, the last at
        ``last``, is cut unless it is complete by then."""
        stall = last + self.body_timeout_s
        if self.body_min_rate <= 0:
            return min(stall, start + self.body_timeout_s)
        return min(stall, start + self.body_timeout_s + received / self.body_min_rate)


class Refusal(StrEnum):
    CAP = "cap"  # the front's connection cap
    PER_CLIENT = "per_client"  # this client's own cap


class ConnectionBudget:
    """Open connections, in total and per client address; counters for the metrics."""

    def __init__(self, limits: ConnectionLimits, exempt: Callable[[str], bool]) -> None:
        self.limits = limits
        self._exempt = exempt  # addresses the per-client cap does not apply to
        self.open = 0
        self._per_client: dict[str, int] = {}
        self.refused: dict[Refusal, int] = dict.fromkeys(Refusal, 0)
        self.head_timeouts = 0
        self.body_timeouts = 0

    def admit(self, client: str | None) -> Refusal | None:
        """Take a slot for a new connection from ``client`` (its address as the socket gives
        it), or say why not. Every admitted connection is released exactly once."""
        limits = self.limits
        if self.open >= limits.max_connections:
            self.refused[Refusal.CAP] += 1
            return Refusal.CAP
        if client is not None and limits.max_per_client:
            held = self._per_client.get(client, 0)
            if held >= limits.max_per_client and not self._exempt(client):
                self.refused[Refusal.PER_CLIENT] += 1
                return Refusal.PER_CLIENT
            self._per_client[client] = held + 1
        self.open += 1
        return None

    def release(self, client: str | None) -> None:
        self.open -= 1
        if client is not None and self.limits.max_per_client:
            held = self._per_client.get(client, 0) - 1
            if held > 0:
                self._per_client[client] = held
            else:
                self._per_client.pop(client, None)

    def held_by(self, client: str) -> int:
        return self._per_client.get(client, 0)


# Set in a request's ASGI scope state by the protocol when its body is past its deadline.
BODY_TIMED_OUT = "gtm.body_timed_out"


def body_timed_out(scope: Mapping[str, Any]) -> bool:
    """Whether the protocol gave up on this request's body: the application answers 408."""
    state = scope.get("state")
    return bool(state and state.get(BODY_TIMED_OUT))


def peer_host(peer: object) -> str | None:
    """The address part of a transport's ``peername`` (None for a socket without one)."""
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


__all__ = [
    "BODY_TIMED_OUT",
    "ConnectionBudget",
    "ConnectionLimits",
    "Refusal",
    "body_timed_out",
    "peer_host",
]
