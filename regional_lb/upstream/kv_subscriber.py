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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from regional_lb.balancing.kv_events import KvEventError, decode_batch, decode_sequence
from regional_lb.balancing.kv_index import KvIndex

# What a publisher can make this process hold (rule 8): ZMQ drops a connection that sends a
# larger message before buffering it, and queues at most RECEIVE_QUEUE messages per instance
# (then drops, and the index sees the gap). A vLLM batch is one engine step's events: a
# 100k-token prompt's BlockStored is ~0.5 MB with its token ids.
MAX_MESSAGE_BYTES = 8 << 20
RECEIVE_QUEUE = 64


class KvEventSubscriber:
    def __init__(
        self, index: KvIndex, clock: Callable[[], float] = time.monotonic, topic: bytes = b""
    ) -> None:
        self.index = index
        self.clock = clock
        self.topic = topic
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._socks: dict[str, zmq.asyncio.Socket] = {}

    def add(self, instance_id: str, endpoint: str) -> None:
        """Follow ``instance_id``'s events at ``endpoint`` (call from the running loop)."""
        self.remove(instance_id)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(endpoint)
        self.index.track(instance_id)
        self._socks[instance_id] = sock
        self._tasks[instance_id] = asyncio.create_task(
            self._follow(instance_id, sock), name=f"kv-events-{instance_id}"
        )

    def remove(self, instance_id: str) -> None:
        """Stop following an instance and drop its entries."""
        task = self._tasks.pop(instance_id, None)
        sock = self._socks.pop(instance_id, None)
        if task is not None and sock is not None:
            # The socket closes once the receive pending on it is cancelled, not under it.
            task.add_done_callback(lambda _: sock.close(linger=0))
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
        tasks = list(self._tasks.values())
        for iid in list(self._tasks):
            self.remove(iid)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()
