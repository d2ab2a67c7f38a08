"""Reading a request's decision inputs from its head: the headers a decision reads, the Host
and the service it names, the tenant index, each memoised per topology.

Both the answer cache and the general path read requests through here, so a header the
decision starts to read is added in one place (``WANTED`` and :func:`scan`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Service, Topology
from gtm.front.signals import (
    API_KEY_HEADER,
    AUTHORIZATION,
    RESIDENCY_HEADER,
    TENANT_HEADER,
    TenantIndex,
)

# Header kinds the front reads; everything else is passed over in one dictionary lookup.
HOST, FORWARDED, XFF, RESIDENCY, TENANT, AUTH, API_KEY = range(7)
WANTED = {
    b"host": HOST,
    b"forwarded": FORWARDED,
    b"x-forwarded-for": XFF,
    RESIDENCY_HEADER: RESIDENCY,
    TENANT_HEADER: TENANT,
    AUTHORIZATION: AUTH,
    API_KEY_HEADER: API_KEY,
}
_HOST_RE = re.compile(
    r"^(?:[a-z0-9_](?:[a-z0-9_.-]{0,251}[a-z0-9_.])?|\[[0-9a-f:.]+\])(?::\d{1,5})?$"
)
_HOSTS_LIMIT = 10_000

Scanned = tuple[
    list[bytes],
    list[bytes],
    list[bytes],
    list[bytes] | None,
    list[bytes] | None,
    bytes | None,
    bytes | None,
]


def scan(headers: Sequence[tuple[bytes, bytes]]) -> Scanned:
    """The values of the headers a decision reads: host, Forwarded, X-Forwarded-For, residency
    and tenant (each every value, in order), Authorization and X-API-Key (the last value)."""
    host_values: list[bytes] = []
    forwarded: list[bytes] = []
    xff: list[bytes] = []
    residency: list[bytes] | None = None
    tenant: list[bytes] | None = None
    auth: bytes | None = None
    api_key: bytes | None = None
    for name, value in headers:
        kind = WANTED.get(name)
        if kind is None:
            continue
        if kind == HOST:
            host_values.append(value)
        elif kind == XFF:
            xff.append(value)
        elif kind == FORWARDED:
            forwarded.append(value)
        elif kind == RESIDENCY:
            residency = [*residency, value] if residency else [value]
        elif kind == TENANT:
            tenant = [*tenant, value] if tenant else [value]
        elif kind == AUTH:
            auth = value
        else:
            api_key = value
    return host_values, forwarded, xff, residency, tenant, auth, api_key


class HostIndex:
    """Host header values to (host, service), and the tenant index, for the topology in force:
    both are rebuilt when a snapshot brings a new topology."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology
        self._hosts: dict[bytes, tuple[str | None, Service | None]] = {}
        self._tenants = TenantIndex(topology)

    def host(self, values: list[bytes], snapshot: Snapshot) -> tuple[str | None, Service | None]:
        """The host named by the Host header (port and trailing dot dropped) and its service;
        host None when the header is missing, repeated or malformed."""
        if snapshot.topology is not self._topology:
            self._topology = snapshot.topology
            self._hosts.clear()
        if len(values) != 1:
            return None, None
        raw = values[0]
        hit = self._hosts.get(raw)
        if hit is None:
            host: str | None = None
            text = raw.decode("latin-1").strip().lower()
            if _HOST_RE.match(text):
                host = text.rsplit(":", 1)[0] if not text.endswith("]") else text
                host = host.rstrip(".") if not host.startswith("[") else host
            service = snapshot.topology.service_by_host(host) if host else None
            hit = (host, service)
            if len(self._hosts) >= _HOSTS_LIMIT:
                self._hosts.clear()
            self._hosts[raw] = hit
        return hit

    def tenants(self, snapshot: Snapshot) -> TenantIndex:
        index = self._tenants
        if index.topology is not snapshot.topology:
            index = self._tenants = TenantIndex(snapshot.topology)
        return index


__all__ = ["WANTED", "HostIndex", "Scanned", "scan"]
