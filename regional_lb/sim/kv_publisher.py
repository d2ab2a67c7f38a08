"""The simulated server's KV-cache event stream, on vLLM's transport.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
sends each batch of KV events as a three-frame ZMQ message on a PUB socket: the topic, the
sequence number (8 bytes, big-endian, from 0) and the msgpack batch
(:mod:`regional_lb.balancing.kv_events`). This publisher does the same from the engine's event
hook (:attr:`regional_lb.sim.engine.Engine.on_kv_events`).

It binds an XPUB socket, which speaks to SUB peers exactly as PUB does but also hears their
subscriptions: :meth:`KvEventPublisher.subscribers` lets a test wait until a subscriber is
really connected instead of sleeping (PUB drops what is sent before a subscription arrives).
Sends never block: at the high-water mark a batch is dropped and counted, as a PUB socket
would, and a subscriber sees the gap in the sequence numbers.
"""

from __future__ import annotations

import itertools
import time

import zmq

from regional_lb.balancing.kv_events import KvEvent, KvEventBatch, encode_batch, encode_sequence

DEFAULT_HWM = 100_000  # vLLM's default for its PUB socket


class KvEventPublisher:
    def __init__(
        self, endpoint: str = "tcp://127.0.0.1:*", topic: str = "", hwm: int = DEFAULT_HWM
    ) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        # With a wildcard port, the one the system gave (what subscribers connect to).
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self._seq = itertools.count()
        self._subscriptions = 0
        self.published = 0
        self.dropped = 0
        self.closed = False

    def publish(self, events: list[KvEvent]) -> None:
        # A closed publisher (a test stopping the stream under a running engine) sends nothing.
        if not events or self.closed:
            return
        payload = encode_batch(KvEventBatch(time.time(), tuple(events)))
        frames = [self.topic, encode_sequence(next(self._seq)), payload]
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1

    def subscribers(self) -> int:
        """Subscriptions heard so far, net of unsubscriptions (reads them off the socket)."""
        while True:
            try:
                msg = self._sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return self._subscriptions
            if msg[:1] == b"\x01":
                self._subscriptions += 1
            elif msg[:1] == b"\x00":
                self._subscriptions -= 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._sock.close(linger=0)
        self._ctx.term()
