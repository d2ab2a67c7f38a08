"""Ports for the demo's listeners: the configured ones when free, else ones the kernel picks.

The demo must run beside anything else on the machine, a second demo included, so no port it
uses is fixed: each default is tried first (the README's ``dig`` and ``curl`` lines work as
written on a quiet machine) and replaced by a free port when it is taken. The demo prints the
ports it used.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import yaml


def free_port(preferred: int) -> int:
    """``preferred`` if it is free on 127.0.0.1 for both TCP and UDP, else a port that is.

    Both protocols, because the DNS listener takes both; checked by binding, so a port some
    other process holds is never offered. Another process may still take it before the caller
    binds: callers that start servers check that they did come up (``Fleet.wait_ready``).
    """
    for port in (preferred, *([0] * 20)):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
            try:
                tcp.bind(("127.0.0.1", port))
                udp.bind(("127.0.0.1", tcp.getsockname()[1]))
            except OSError:
                continue
            return int(tcp.getsockname()[1])
    raise OSError("no free loopback port for the demo")


def on_free_ports(source: Path, target: Path) -> tuple[Path, dict[str, tuple[int, int]]]:
    """Write ``source``'s topology to ``target`` with every loopback region's port free.

    A region's ``base_url`` and ``probe_url`` name the port its balancer listens on; where that
    port is taken, both move to a free one. Returns the file and the moves (region -> (old
    port, new port)).
    """
    document = yaml.safe_load(source.read_text())
    moved: dict[str, tuple[int, int]] = {}
    for region in document.get("regions", []):
        base = urlsplit(str(region.get("base_url", "")))
        if base.hostname != "127.0.0.1" or base.port is None:
            continue
        port = free_port(base.port)
        if port == base.port:
            continue
        moved[region["id"]] = (base.port, port)
        for key in ("base_url", "probe_url"):
            if key in region:
                url = urlsplit(str(region[key]))
                region[key] = urlunsplit(url._replace(netloc=f"127.0.0.1:{port}"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(document, sort_keys=False))
    return target, moved


__all__ = ["free_port", "on_free_ports"]
