"""OIDC/JWT access tokens: the identity provider says who is asking, GTM says what they may do.

A bearer token that is not a GTM API token is read as a JWT access token when an issuer is
configured (``GTM_ADMIN_OIDC_ISSUER``, ``GTM_ADMIN_OIDC_AUDIENCE``, ``GTM_ADMIN_OIDC_JWKS_URL``).
It authenticates only when all of these hold:

* its ``alg`` is an asymmetric algorithm on the allow-list: ``none`` and the HMAC family are
  refused before anything else, so a token "signed" with the issuer's *public* key as an HMAC
  secret (algorithm confusion) never reaches a verifier;
* its ``kid`` names a key of the issuer's JWKS (fetched over HTTPS, or plain HTTP on loopback
  only, cached and refetched when an unknown ``kid`` appears: key rotation works without a
  restart) and the signature verifies with that key;
* ``iss`` and ``aud`` are the configured ones, and ``exp``, ``iat`` and ``sub`` are present,
  with ``exp``/``nbf`` checked against the clock (30 s leeway for clock skew).

Roles never come from the token. The subject is bound to a principal by a GTM admin
(``POST /v1/principals`` with ``oidc_subject``), and that binding is sealed like the principal's
roles: a claim the identity provider lets users edit, or a row written into the database, grants
nothing. A token for a subject no principal is bound to is refused like a bad one.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import jwt
import structlog

from gtm.errors import ConfigError, Problem

log = structlog.get_logger(__name__)

# Asymmetric only: with a public JWKS, any symmetric algorithm would let anyone sign.
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA")
LEEWAY_S = 30
_JWKS_CACHE_S = 300
# An unknown kid refetches the JWKS at most this often: a flood of made-up kids must not turn
# GTM into a load generator against the identity provider. A rotated key is therefore accepted
# at most this long after its first use.
REFETCH_COOLDOWN_S = 30.0


@dataclass(frozen=True, slots=True)
class OidcConfig:
    issuer: str
    audience: str
    jwks_url: str


def _loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_url(setting: str, url: str) -> Problem | None:
    """A problem when ``url`` is not https (plain http is allowed on loopback only, for tests
    and a provider on the same machine): an identity provider's answers must not be forgeable
    on the network path."""
    parts = urlsplit(url)
    if parts.scheme == "https" or (parts.scheme == "http" and _loopback(parts.hostname)):
        return None
    return Problem(setting, "", "must be https (http only on loopback)")


def config_from(
    issuer: str | None, audience: str | None, jwks_url: str | None
) -> OidcConfig | None:
    """The OIDC settings as one value, or None when OIDC is off; a half-configured or
    insecure setup is a start-up error, not a silently weaker check."""
    given = {"GTM_ADMIN_OIDC_ISSUER": issuer, "GTM_ADMIN_OIDC_AUDIENCE": audience}
    given["GTM_ADMIN_OIDC_JWKS_URL"] = jwks_url
    if not any(given.values()):
        return None
    problems = [
        Problem(k, "", "required when OIDC is configured") for k, v in given.items() if not v
    ]
    if jwks_url and (problem := insecure_url("GTM_ADMIN_OIDC_JWKS_URL", jwks_url)):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    assert issuer
    assert audience
    assert jwks_url
    return OidcConfig(issuer, audience, jwks_url)


class IdentityProviderUnavailable(Exception):
    """The JWKS could not be fetched: the token may be good, so this is not a 401."""


class OidcVerifier:
    def __init__(self, config: OidcConfig) -> None:
        self.config = config
        self._jwks = jwt.PyJWKClient(
            config.jwks_url,
            cache_keys=False,  # kid -> key memo: would outlive a key the issuer withdrew
            lifespan=_JWKS_CACHE_S,
            timeout=5,
            cooldown_duration=REFETCH_COOLDOWN_S,
        )

    async def subject(self, token: str, now: float) -> str | None:
        """The verified subject of ``token``, or None when it does not authenticate."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            return None
        alg = header.get("alg")
        if alg not in ALGORITHMS or not isinstance(header.get("kid"), str):
            return None
        try:
            # PyJWKClient refetches the JWKS when the kid is unknown (rotation); the fetch is
            # blocking urllib, so it runs off the loop.
            key = await asyncio.to_thread(self._jwks.get_signing_key, header["kid"])
        except jwt.PyJWKClientConnectionError as exc:
            log.warning("admin.oidc_jwks_unreachable", url=self.config.jwks_url, error=str(exc))
            raise IdentityProviderUnavailable(str(exc)) from exc
        except jwt.PyJWKClientError:
            return None  # no such kid in the issuer's keys
        if not _compatible(key, alg):
            return None
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
        except jwt.PyJWTError:
            return None
        # PyJWT checks exp against the system clock; the admin service's clock is what counts.
        if float(claims["exp"]) + LEEWAY_S <= now or float(claims["iat"]) - LEEWAY_S > now:
            return None
        sub = claims["sub"]
        return sub if isinstance(sub, str) and sub else None


def _compatible(key: jwt.PyJWK, alg: str) -> bool:
    """Whether a token may use ``alg`` with this key. A JWK with an ``alg`` member allows that
    algorithm only; one without gets a default from its key type (RS256 for RSA), and then any
    algorithm of the key's family is acceptable, none of another."""
    if alg == key.algorithm_name:
        return True
    if "alg" in getattr(key, "_jwk_data", {}):
        return False
    families = {"RS": ("RS", "PS"), "PS": ("RS", "PS"), "ES": ("ES",), "Ed": ("Ed",)}
    return alg[:2] in families.get(key.algorithm_name[:2], ())


__all__ = [
    "ALGORITHMS",
    "IdentityProviderUnavailable",
    "OidcConfig",
    "OidcVerifier",
    "config_from",
    "insecure_url",
]
