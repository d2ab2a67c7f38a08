"""Which sender networks are established clients of the UDP listener (DESIGN.md rule 9).

Steering each sender network to a socket by a hash (:mod:`gtm.geodns.steering`) keeps one
flooding network in its own socket's buffer, but floods from many networks (spoofed senders,
a botnet) land on every socket, and the kernel drops from each buffer whatever comes next,
whoever sent it. So the group is split: the first sockets serve *established* networks only,
those the kernel finds in a map this module's decisions fill; everyone else shares the rest.
A flood from networks never seen before then overflows the general sockets, and the clients
that were being answered before it began keep their own buffers.

A network is established once it has been read in :data:`AGE_TICKS` consecutive ticks (a
second each) that were calm: next to no datagram dropped, by the kernel's buffers or by
admission (:func:`is_calm`). So
a client that asks steadily is established within seconds of an ordinary day, and during a
flood nobody new is: the flood's networks, new by definition, never are, and a legitimate
newcomer waits on the general sockets with them until the flood ends. What a member loses:

- its place, when it takes more than its share of a protected socket's read while that socket
  is behind (the listener's ``OVER_SHARE`` drop): it may not come back for :data:`BAR_TICKS`;
- its place, after :data:`IDLE_TICKS` ticks without a datagram (the map is bounded; the set
  tracks who asks now).

What it cannot do alone: tell a network's own clients from datagrams forged in its name; a
flood that spoofs an established network's addresses lands where that network's queries land
(and, over its share, costs the network its place). Forged senders can be kept from being
established at all: with ``proven`` (GTM_DNS_ESTABLISH_WITH_COOKIE), only a network whose
query brought back a valid DNS cookie (gtm.geodns.cookies), or came over TCP, within the hour
is; and where the network's clients speak cookies, the listener then tells their datagrams
from forged ones (gtm.geodns.udp, ``UNPROVEN``). Pure logic: no socket, no clock, ticks are
counted by the caller.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

AGE_TICKS = 3  # consecutive calm ticks a network is read in before it is established
IDLE_TICKS = 30  # ticks without a datagram before a member is dropped
BAR_TICKS = 60  # ticks a network demoted for flooding waits before it may be established again
PER_TICK = 1024  # networks established in one tick at most (each is a system call)

PROMOTED, EXPIRED, DEMOTED = "established", "expired", "demoted"
# What a tick may lose and still be calm: a few stray datagrams (a bad checksum, one client's
# burst past its queue, a drop on another address) must not stop anyone being established for
# good; a flood's thousands do.
CALM_DROPS = 16
CALM_SHARE = 0.001  # of the datagrams read in the tick


def is_calm(dropped: int, read: int) -> bool:
    """Whether a tick that read ``read`` datagrams and lost ``dropped`` (kernel buffers and
    admission) was calm.

    >>> is_calm(0, 0), is_calm(16, 0), is_calm(17, 0)
    (True, True, False)
    >>> is_calm(110, 100_000), is_calm(5_000, 100_000)
    (True, False)
    """
    return dropped <= CALM_DROPS + CALM_SHARE * read


class Changes(NamedTuple):
    """What a tick changed: networks to add to the map, and to take out of it."""

    added: list[Hashable]
    removed: list[Hashable]


class EstablishedNetworks:
    """The established set, bounded by ``capacity`` (the kernel map's size).

    >>> est = EstablishedNetworks(capacity=10)
    >>> [est.end_tick(["a", "b"], (), calm=True).added for _ in range(AGE_TICKS)]
    [[], [], ['a', 'b']]
    >>> est.end_tick(["c"], (), calm=False).added, "c" in est
    ([], False)
    >>> est.demote("a"), "a" in est, len(est)
    (True, False, 1)
    """

    __slots__ = (
        "_barred", "_candidates", "age", "bar", "capacity", "changes", "idle", "members",
        "proven", "tick",
    )  # fmt: skip

    def __init__(
        self,
        capacity: int,
        *,
        age: int = AGE_TICKS,
        idle: int = IDLE_TICKS,
        bar: int = BAR_TICKS,
        proven: Callable[[Hashable], bool] | None = None,
    ) -> None:
        if capacity < 1 or age < 1 or idle < 1:
            raise ValueError("capacity, age and idle must be positive")
        self.capacity = capacity
        self.age = age
        self.idle = idle
        self.bar = bar
        # With it, a network is established only while it holds: its return path proven by a
        # DNS cookie (gtm.geodns.guards.Guards.proven). Until then its streak goes on.
        self.proven = proven
        self.tick = 0
        self.members: dict[Hashable, int] = {}  # network -> the last tick it was read in
        # Networks read in calm ticks, not yet members: (the last such tick, how many in a row).
        self._candidates: dict[Hashable, tuple[int, int]] = {}
        self._barred: dict[Hashable, int] = {}  # network -> the first tick it may come back
        self.changes: Counter[str] = Counter()  # by PROMOTED, EXPIRED, DEMOTED

    def __contains__(self, network: Hashable) -> bool:
        return network in self.members

    def __len__(self) -> int:
        return len(self.members)

    def end_tick(
        self, general: Iterable[Hashable], protected: Iterable[Hashable], *, calm: bool
    ) -> Changes:
        """Close a tick: ``general`` and ``protected`` are the networks read on the general and
        on the protected sockets during it; ``calm``, whether nothing was dropped."""
        t = self.tick = self.tick + 1
        members = self.members
        for network in protected:
            if network in members:
                members[network] = t
        added: list[Hashable] = []
        candidates = self._candidates
        if calm:
            barred, proven = self._barred, self.proven
            room = min(PER_TICK, self.capacity - len(members))
            for network in general:
                if network in members:
                    members[network] = t  # read before its map entry took effect
                    continue
                last, streak = candidates.get(network, (0, 0))
                streak = streak + 1 if last == t - 1 else 1
                if (
                    streak >= self.age
                    and room > 0
                    and barred.get(network, 0) <= t
                    and (proven is None or proven(network))
                ):
                    members[network] = t
                    added.append(network)
                    candidates.pop(network, None)
                    barred.pop(network, None)
                    room -= 1
                else:
                    candidates[network] = (t, streak)
            if len(candidates) > 4 * self.capacity:
                # Those not read this tick have lost their streak anyway.
                self._candidates = {n: v for n, v in candidates.items() if v[0] == t}
                if len(self._candidates) > 4 * self.capacity:
                    self._candidates = {}
            if len(barred) > self.capacity:
                self._barred = {n: until for n, until in barred.items() if until > t}
        else:
            # A tick that lost datagrams makes nobody established: who sends now may be the
            # flood. Every streak starts again once calm returns.
            candidates.clear()
        removed = [n for n, last in members.items() if t - last >= self.idle]
        for network in removed:
            del members[network]
        self.changes[PROMOTED] += len(added)
        self.changes[EXPIRED] += len(removed)
        return Changes(added, removed)

    def demote(self, network: Hashable) -> bool:
        """``network`` took more than its share of a protected socket: out, and barred for
        ``bar`` ticks; False when it was not a member."""
        if self.members.pop(network, None) is None:
            return False
        self._barred[network] = self.tick + self.bar
        self.changes[DEMOTED] += 1
        return True

    def forget(self, network: Hashable) -> None:
        """Out without a bar (its map entry could not be written)."""
        self.members.pop(network, None)
