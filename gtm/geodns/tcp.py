"""DNS over TCP (RFC 7766): length-prefixed messages on a connection, answered in order, with
idle and connection limits; the slow path admitted per sender network, as over UDP.

A message a first-level cache holds is answered as it is read. With fair admission on
(:mod:`gtm.geodns.admission`), one that would need parsing, a GeoIP lookup or a rendering waits
in a queue per sender network (/24, /56), drained round robin with a time bound per loop turn,
and its connection reads nothing more meanwhile (TCP's own flow control holds the sender back,
nothing is dropped). So a flood of connections asking for new names or subnets gets the TCP
slow path's capacity in its network's share, and does not hold the loop from answering cached
queries over UDP and TCP. At the connection cap, a newcomer from a network holding fewer
connections than the one holding the most closes that one's oldest: a network alone may use
every connection, but cannot keep them from the others. A connection answers at most
:data:`TURN_MESSAGES` messages a loop turn, however many it pipelined; its messages that miss
wait one at a time, so a network's connections take its share of the slow path in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Hashable
from ipaddress import IPv4Address, IPv6Address

from gtm.geodns.admission import SHUTDOWN, SlowLane, sender_network
from gtm.geodns.responder import SLOW, Responder
from gtm.geodns.wire import peer_address

IPAddress = IPv4Address | IPv6Address
_Waiting = tuple[bytes, IPAddress, "asyncio.Future[bytes | None]"]

# The TCP slow path's time in one loop turn, at most (and at least one message).
SLOW_TURN_S = 0.001
# Messages a connection answers in a row before it lets the loop turn: reading from a full
# buffer and writing below the high-water mark never suspend, so a client pipelining thousands
# of cached queries (256 KiB a read) would otherwise hold the loop, every UDP client and every
# other connection for all of them.
TURN_MESSAGES = 16


class TcpService:
    """Serves the TCP connections of every listener of a DNS server, sharing one slow lane."""

    def __init__(
        self,
        responder: Responder,
        *,
        idle_s: float,
        max_connections: int,
        fair: bool,
        slow_batch: int = 32,
    ) -> None:
        self.responder = responder
        self.slow_batch = slow_batch  # messages per loop turn at most, as over UDP
        self.idle_s = idle_s
        self.max_connections = max_connections
        self.fair = fair
        self.connections: set[asyncio.Task[None]] = set()
        # Each network's open connections, oldest first.
        self._by_network: dict[Hashable, dict[asyncio.Task[None], None]] = {}
        # Each connection waits for one message at most: the lane never holds more than the
        # connection cap, so it drops nothing (per-network and total bounds are that cap).
        self.lane: SlowLane[_Waiting] = SlowLane(
            max_connections, max_connections, responder.stats.tcp_lane
        )
        self._scheduled = False

    async def close(self) -> None:
        """Cancel every connection and wait for them."""
        for task in list(self.connections):
            task.cancel()
        for task in list(self.connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.lane.clear()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats = self.responder.stats
        peer_host = str(writer.get_extra_info("peername")[0])
        network = sender_network(peer_host)
        if len(self.connections) >= self.max_connections and not self._make_room(network):
            stats.tcp_refused += 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        self._by_network.setdefault(network, {})[task] = None
        stats.tcp_connections += 1
        peer = peer_address(peer_host)
        proven = False
        in_a_row = 0  # messages answered since the connection last let the loop turn
        try:
            # RFC 7766 §6.2.1: several queries per connection, answered in order; an idle
            # connection is closed after a timeout.
            while True:
                try:
                    # A deadline over the read, not a task per read (asyncio.wait_for's): a
                    # read from a full buffer then costs no loop turn (TURN_MESSAGES below).
                    async with asyncio.timeout(self.idle_s):
                        header = await reader.readexactly(2)
                        (length,) = struct.unpack("!H", header)
                        message = await reader.readexactly(length)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                stats.tcp_messages += 1
                if not proven:
                    # The peer answered our SYN-ACK: its address receives what is sent to
                    # it, as a DNS cookie shows (established networks, gtm.geodns.guards).
                    proven = True
                    self.responder.prove(network, self.responder.clock())
                try:
                    out = await self._answer(message, peer, network)
                except Exception as exc:  # as over UDP; the connection is closed
                    stats.failed += 1
                    self.responder.runtime.failures.record("dns.tcp", exc, peer=peer_host)
                    return
                if out is None:
                    return  # unreadable: close, as there is no sane way to resynchronise
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
                in_a_row += 1
                if in_a_row >= TURN_MESSAGES:
                    in_a_row = 0
                    await asyncio.sleep(0)
        except ConnectionError:
            return
        finally:
            self.connections.discard(task)
            mine = self._by_network.get(network)
            if mine is not None and mine.pop(task, 0) is None and not mine:
                del self._by_network[network]  # (a connection pushed out is gone already)
            stats.tcp_connections -= 1
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    def _make_room(self, network: Hashable) -> bool:
        """At the cap: close the oldest connection of the network holding the most, if it
        holds more than ``network`` would with this one (counted as refused); whether it did."""
        held = self._by_network.get(network)
        mine = len(held) if held is not None else 0
        biggest = max(self._by_network.values(), key=len)
        if len(biggest) <= mine + 1:
            return False
        oldest = next(iter(biggest))
        # Closed now, not when its task next runs: the newcomer's place is taken at once.
        del biggest[oldest]
        self.connections.discard(oldest)
        oldest.cancel()
        self.responder.stats.tcp_refused += 1
        return True

    async def _answer(self, message: bytes, peer: IPAddress, network: Hashable) -> bytes | None:
        """The response to one message: at once from the first level, else on the slow
        lane's turn (fair admission), or at once the long way (admission off)."""
        r = self.responder
        if not self.fair:
            return r.answer_tcp(message, peer)
        out = r.answer_tcp_cached(message, peer)
        if out is not SLOW:
            return out
        future: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self.lane.offer(network, (message, peer, future))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)
        return await future

    def _drain(self) -> None:
        """One turn's slice of the TCP slow path, one message per network in turn, until
        ``slow_batch`` were answered or :data:`SLOW_TURN_S` has passed; scheduled again while
        any wait."""
        self._scheduled = False
        r = self.responder
        lane = self.lane
        until = time.perf_counter() + SLOW_TURN_S
        for _ in range(self.slow_batch):
            if not lane.size:
                break
            message, peer, future = lane.take(1)[0]
            if future.done():  # its connection was closed meanwhile
                lane.counts.dropped[SHUTDOWN] += 1
                continue
            lane.counts.admitted += 1
            try:
                future.set_result(r.answer_tcp(message, peer))
            except Exception as exc:  # raised in the connection's task, which counts it
                future.set_exception(exc)
            if time.perf_counter() >= until:
                break
        if lane.size:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)
