"""The ceiling of a Python DNS responder on this machine: one pre-rendered answer, only the ID
patched, on uvloop. No parsing, no decision, no accounting. Its UDP receive buffer is widened as
GTM's is (gtm.geodns.server.UDP_RECEIVE_BUFFER), so that both lose no queries to a full buffer
and the comparison is of the answering path alone.

    python bench/dns/bare.py PORT
"""

from __future__ import annotations

import asyncio
import socket
import sys

import dns.message
import dns.rrset
import uvloop


class Bare(asyncio.DatagramProtocol):
    def __init__(self, tail: bytes) -> None:
        self.tail = tail
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(data[:2] + self.tail, addr)


async def main(port: int) -> None:
    query = dns.message.make_query("chat.gtm.example.", "A")
    answer = dns.message.make_response(query)
    answer.answer.append(dns.rrset.from_text("chat.gtm.example.", 30, "IN", "A", "192.0.2.40"))
    tail = answer.to_wire()[2:]
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: Bare(tail), local_addr=("127.0.0.1", port)
    )
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 << 20)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
