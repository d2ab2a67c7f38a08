"""Who is calling: a tenant proven by its API key, or an unknown caller (rule 6).

Tenant and priority come only from a verified credential. A key presented as a bearer token
is hashed (SHA-256) and looked up among the digests the configuration holds; the digest found
is compared again in constant time. A bearer JWT (``clients.jwt``) is verified against the
identity provider's JWKS (signature, expiry, issuer, audience) and names its tenant in a
claim. Headers such as ``X-Tenant`` are not read at all, and
``X-Priority`` may only lower the tier the tenant is granted (``Pool.tier_for``). A caller
without a valid key gets the default tenant's limits, in a bucket of its own address, or a 401
when keys are required.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from regional_lb.config import BalancerConfig, JwtConfig, TenantConfig
from regional_lb.credentials import key_digest
from regional_lb.errors import RequestError
from regional_lb.protocol.asgi import Scope, header


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None  # None: not identified
    spec: TenantConfig
    bucket: str  # the rate limit's key
    key_used: bool  # its credential was the balancer's key (not to be passed upstream)

    @property
    def label(self) -> str:
        return f"tenant {self.tenant!r}" if self.tenant else "this client (no API key)"


class JwtVerifier:
    """Verifies bearer JWTs against a JWKS; :meth:`load` swaps in a new key set (the
    balancer refreshes one fetched from a URL in the background)."""

    def __init__(self, spec: JwtConfig) -> None:
        self.spec = spec
        self.keys: dict[str, Any] = {}
        if spec.jwks_file is not None:
            self.load(json.loads(Path(spec.jwks_file).read_text(encoding="utf-8")))

    def load(self, jwks: dict[str, Any]) -> None:
        keys = jwt.PyJWKSet.from_dict(jwks).keys
        self.keys = {k.key_id or "": k for k in keys}

    def tenant(self, token: str) -> str | None:
        """The tenant the token names, or None when it does not verify."""
        try:
            kid = jwt.get_unverified_header(token).get("kid") or ""
            key = self.keys.get(kid) or (
                next(iter(self.keys.values())) if len(self.keys) == 1 and not kid else None
            )
            if key is None:
                return None
            claims = jwt.decode(
                token,
                key=key.key,
                algorithms=self.spec.algorithms,
                audience=self.spec.audience,
                issuer=self.spec.issuer,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.PyJWTError:
            return None
        value = claims.get(self.spec.tenant_claim)
        return value if isinstance(value, str) else None


class Identities:
    def __init__(self, config: BalancerConfig) -> None:
        self.by_digest: dict[str, str] = {}
        for name, spec in config.tenants.items():
            for digest in spec.key_sha256:
                self.by_digest[digest] = name
        self.tenants = config.tenants
        self.default = config.default_tenant
        self.header = config.clients.header.lower().encode("latin-1")
        self.require = config.clients.require_key
        jwt_spec = config.clients.jwt
        self.jwt = JwtVerifier(jwt_spec) if jwt_spec is not None else None

    def _presented(self, scope: Scope) -> str | None:
        raw = header(scope, self.header)
        if raw is None:
            return None
        value = raw.decode("latin-1").strip()
        if self.header == b"authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
        return value or None

    def identify(self, scope: Scope) -> Caller:
        key = self._presented(scope)
        if key is not None and self.jwt is not None and key.count(".") == 2:
            tenant = self.jwt.tenant(key)
            if tenant is not None and tenant in self.tenants:
                return Caller(tenant, self.tenants[tenant], f"tenant:{tenant}", True)
        if key is not None and self.by_digest:
            digest = key_digest(key)
            tenant = self.by_digest.get(digest)
            if tenant is not None:
                stored = next(d for d in self.tenants[tenant].key_sha256 if d == digest)
                if hmac.compare_digest(digest, stored):
                    return Caller(tenant, self.tenants[tenant], f"tenant:{tenant}", True)
        if self.require:
            raise RequestError(
                401,
                "Incorrect API key provided." if key else "You didn't provide an API key.",
                code="invalid_api_key",
            )
        client = scope.get("client")
        address = client[0] if client else "unknown"
        return Caller(None, self.default, f"addr:{address}", False)
