"""Listen addresses: ``HOST:PORT`` or ``[V6]:PORT``, with a literal address."""

from __future__ import annotations

from ipaddress import ip_address


def parse_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:5353"`` or ``"[::1]:5353"`` -> ``(host, port)``; ValueError otherwise.

    Literal addresses only: a listener binds exactly where it is told, and the address family
    (UDP and TCP sockets of the right kind) follows from it.
    """
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (IPv6 as [ADDR]:PORT)")
    try:
        ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address") from None
    return host, int(port)
