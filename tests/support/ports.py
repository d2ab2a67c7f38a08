"""Free loopback ports for servers the tests start."""

from __future__ import annotations

import socket


def free_tcp_udp_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (a DNS listener takes both). One free for
    one protocol may be taken for the other, so candidates are tried until both bind."""
    while True:
        with socket.socket() as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
