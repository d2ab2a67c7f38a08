"""Reads the instances' KV-cache event streams into the balancer's block index.

One ZMQ SUB socket per instance, connected to the endpoint its server publishes on (vLLM's
``--kv-events-config`` endpoint, or the simulator's ``--kv-events``), so every batch is known
to come from that instance whatever its topic says. Each message is three frames (topic,
8-byte sequence number, msgpack batch: :mod:`regional_lb.balancing.kv_events`) and goes to
:meth:`regional_lb.balancing.kv_index.KvIndex.apply`; a message of the wrong shape or that does
not decode is counted in the index and dropped, never raised: a bad publisher costs hit rate,
not the balancer.

The receive loop awaits the sockets on the event loop (``zmq.asyncio``); the index is updated
there too, so the picker, which runs on the same loop, never sees half a batch.

A SUB socket reconnects on its own and says nothing when its publisher goes away, so each
socket also has a ZMQ monitor: a dropped connection is reported (``on_disconnect``) at once,
and the caller decides what the index does about it (:mod:`regional_lb.upstream.kv_streams`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from regional_lb.balancing.kv_events import KvEventError, decode_batch, decode_sequence
from regional_lb.balancing.kv_index import KvIndex

# What a publisher can make this process hold (rule 8): ZMQ drops a connection that sends a
# larger message before buffering it, and queues at most RECEIVE_QUEUE messages per instance
# (then drops, and the index sees the gap). A vLLM batch is one engine step's events: a
# 100k-token prompt's BlockStored is ~0.5 MB with its token ids.
MAX_MESSAGE_BYTES = 8 << 20
RECEIVE_QUEUE = 64


def _ignore(_: str) -> None:
    pass


class KvEventSubscriber:
    def __init__(
        self,
        index: KvIndex,
        clock: Callable[[], float] = time.monotonic,
        topic: bytes = b"",
        on_batch: Callable[[str], None] = _ignore,
        on_disconnect: Callable[[str], None] = _ignore,
    ) -> None:
        self.index = index
        self.clock = clock
        self.topic = topic
        # After each applied batch, and when a publisher's connection drops (instance id).
        self.on_batch, self.on_disconnect = on_batch, on_disconnect
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._socks: dict[str, list[zmq.asyncio.Socket]] = {}

    def add(self, instance_id: str, endpoint: str, topic: bytes | None = None) -> None:
        """Follow ``instance_id``'s events at ``endpoint`` (call from the running loop);
        ``topic``: its publisher's topic, when not the subscriber's."""
        self.remove(instance_id)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic if topic is None else topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        self.index.track(instance_id)
        self._socks[instance_id] = [sock, monitor]
        self._tasks[instance_id] = [
            asyncio.create_task(self._follow(instance_id, sock), name=f"kv-events-{instance_id}"),
            asyncio.create_task(self._watch(instance_id, monitor), name=f"kv-link-{instance_id}"),
        ]

    def remove(self, instance_id: str) -> None:
        """Stop following an instance and drop its entries."""
        tasks = self._tasks.pop(instance_id, [])
        socks = self._socks.pop(instance_id, [])
        if tasks:
            # The sockets close once the receives pending on them are cancelled, not under
            # them (close() closes them itself: it may run before these callbacks).
            left = [len(tasks)]

            def closed(_: object) -> None:
                left[0] -= 1
                if left[0] == 0:
                    _close(socks)

            for task in tasks:
                task.add_done_callback(closed)
                task.cancel()
        self.index.untrack(instance_id)

    def handle(self, instance_id: str, frames: list[bytes]) -> None:
        """One received message (public for the tests of bad input)."""
        if len(frames) != 3:
            self.index.malformed()
            return
        try:
            seq = decode_sequence(frames[1])
            batch = decode_batch(frames[2])
        except KvEventError:
            self.index.malformed()
            return
        self.index.apply(instance_id, seq, batch, self.clock())
        self.on_batch(instance_id)

    async def _watch(self, instance_id: str, monitor: zmq.asyncio.Socket) -> None:
        """The publisher's connection: each drop is reported (ZMQ reconnects by itself)."""
        while True:
            try:
                frames = await monitor.recv_multipart()
                event = parse_monitor_message(frames)
            except (zmq.ZMQError, ValueError):
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.on_disconnect(instance_id)

    async def _follow(self, instance_id: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                # The socket failed under us: what the index holds for the instance can no
                # longer be kept current, so it falls back to the routing-history estimate.
                self.index.malformed()
                self.index.lost_stream(instance_id)
                return
            self.handle(instance_id, frames)

    async def close(self) -> None:
        tasks = [t for group in self._tasks.values() for t in group]
        socks = list(self._socks.values())
        for iid in list(self._tasks):
            self.remove(iid)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pair in socks:
            _close(pair)
        self._ctx.term()


def _close(pair: list[zmq.asyncio.Socket]) -> None:
    """Close a SUB socket and its monitor, the monitor stopped first (else the context's
    term() waits for it forever)."""
    sock, monitor = pair
    if not sock.closed:
        sock.disable_monitor()
        sock.close(linger=0)
    monitor.close(linger=0)
