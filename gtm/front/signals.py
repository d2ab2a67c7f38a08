"""Residency and tenant signals of an HTTP request.

A request's residency classes are the union of the service's own class, the classes named in
an ``X-Data-Residency`` header and the classes of its tenant. Every class constrains the allowed
regions and the policy intersects them, so the union is the strictest combination: a header can
only narrow where a request goes, never widen it.

The tenant is recognised by an API-key prefix (``Authorization: Bearer KEY`` or ``X-API-Key``)
or named in an ``X-GTM-Tenant`` header; when both are present they must agree, and a header
naming a tenant the topology does not know is an error rather than "no tenant" (a typo must not
quietly drop a tenant's restrictions).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from gtm.decision.topology import Service, Topology

RESIDENCY_HEADER = b"x-data-residency"
TENANT_HEADER = b"x-gtm-tenant"
API_KEY_HEADER = b"x-api-key"
AUTHORIZATION = b"authorization"

MAX_CLASSES = 16
_CLASS = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_CACHE_LIMIT = 10_000


class SignalError(ValueError):
    """A residency or tenant header that cannot be honoured (answered 400)."""

    def __init__(self, header: str, problem: str) -> None:
        super().__init__(f"{header}: {problem}")
        self.header = header
        self.problem = problem


class Signals(NamedTuple):
    classes: frozenset[str]
    tenant: str | None


_EMPTY: frozenset[str] = frozenset()


class TenantIndex:
    """The topology's tenants as the request path reads them; built once per topology."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.by_id = {t.id: t for t in topology.tenants}
        # Longest prefix first, so that "sk-acme-eu-" wins over "sk-acme-".
        self.prefixes: tuple[tuple[str, str], ...] = tuple(
            sorted(
                ((p, t.id) for t in topology.tenants for p in t.api_key_prefixes),
                key=lambda pair: -len(pair[0]),
            )
        )
        self.classes = {t.id: frozenset(t.residency_classes) for t in topology.tenants}
        self._header_memo: dict[bytes, frozenset[str]] = {}
        self._union_memo: dict[tuple[str | None, frozenset[str], str | None], frozenset[str]] = {}

    def tenant_of_key(self, key: str) -> str | None:
        for prefix, tenant in self.prefixes:
            if key.startswith(prefix):
                return tenant
        return None

    def header_classes(self, value: bytes) -> frozenset[str]:
        hit = self._header_memo.get(value)
        if hit is None:
            hit = parse_residency_header(value)
            if len(self._header_memo) >= _CACHE_LIMIT:
                self._header_memo.clear()
            self._header_memo[value] = hit
        return hit

    def union(
        self, service_class: str | None, header: frozenset[str], tenant: str | None
    ) -> frozenset[str]:
        key = (service_class, header, tenant)
        hit = self._union_memo.get(key)
        if hit is None:
            hit = header | (self.classes.get(tenant, _EMPTY) if tenant else _EMPTY)
            if service_class:
                hit = hit | {service_class}
            if len(self._union_memo) >= _CACHE_LIMIT:
                self._union_memo.clear()
            self._union_memo[key] = hit
        return hit


def parse_residency_header(value: bytes) -> frozenset[str]:
    """Comma-separated class names; :class:`SignalError` on anything else."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        raise SignalError("X-Data-Residency", "not ASCII") from None
    names = [part.strip().lower() for part in text.split(",")]
    names = [n for n in names if n]
    if len(names) > MAX_CLASSES:
        raise SignalError("X-Data-Residency", f"more than {MAX_CLASSES} classes")
    for name in names:
        if not _CLASS.match(name):
            raise SignalError("X-Data-Residency", f"not a residency class name: {name!r}")
    return frozenset(names)


def _api_key(authorization: bytes | None, api_key: bytes | None) -> str | None:
    if api_key is not None:
        return api_key.decode("latin-1").strip() or None
    if authorization is not None:
        scheme, _, credentials = authorization.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    return None


def credentials_tenant(
    index: TenantIndex, authorization: bytes | None, api_key: bytes | None
) -> str | None:
    """The tenant whose API-key prefix the request's credentials carry, if any. The answer
    cache keys on this rather than on the credentials, which it must not keep."""
    if index.prefixes and (authorization is not None or api_key is not None):
        key = _api_key(authorization, api_key)
        if key is not None:
            return index.tenant_of_key(key)
    return None


def signals_of(
    index: TenantIndex,
    service: Service,
    residency: list[bytes] | None,
    tenant_header: list[bytes] | None,
    authorization: bytes | None,
    api_key: bytes | None,
) -> Signals:
    """The classes and tenant of one request; :class:`SignalError` for a bad header."""
    tenant = credentials_tenant(index, authorization, api_key)
    if tenant_header is not None:
        if len(tenant_header) > 1:
            raise SignalError("X-GTM-Tenant", "given more than once")
        named = tenant_header[0].decode("latin-1").strip().lower()
        if named not in index.by_id:
            raise SignalError("X-GTM-Tenant", f"unknown tenant {named!r}")
        if tenant is not None and tenant != named:
            raise SignalError(
                "X-GTM-Tenant", f"names {named!r} but the API key belongs to another tenant"
            )
        tenant = named
    header = _EMPTY
    if residency is not None:
        header = (
            index.header_classes(residency[0])
            if len(residency) == 1
            else index.header_classes(b",".join(residency))
        )
    if not header and tenant is None:
        if service.residency_class:
            return Signals(index.union(service.residency_class, _EMPTY, None), None)
        return Signals(_EMPTY, None)
    return Signals(index.union(service.residency_class, header, tenant), tenant)
