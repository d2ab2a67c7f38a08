"""Seals: the admin service's signature on the rows that say who may approve what.

Four-eyes is only as strong as the records it reads. Principals, their tokens, a proposal's
author and every approval live in the shared database, so someone holding its password could
otherwise mint an approver, approve on their behalf, or rewrite an author. Each of those rows
therefore carries a *seal*: an Ed25519 signature, by the same key that signs activated versions
(a 0600 file, never the database), over the fields that matter. Writing such a row needs the key;
reading one verifies the seal with the public keys (``GTM_DOCUMENT_KEYS``), and a row whose seal
does not verify counts as absent: its token authenticates no one, its approval approves nothing.

What a seal cannot stop: putting back an older, validly sealed row (a revoked token's row from
before its revocation). That needs evidence kept outside the database (the audit anchoring
work), and is said plainly here rather than implied away.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gtm.admin.signer import Signer
from gtm.errors import GTMError


class CannotSeal(GTMError):
    """This admin service has no signing key: it can read sealed rows, not write them."""


def _body(kind: str, fields: Mapping[str, Any]) -> bytes:
    return orjson.dumps({"kind": kind, **fields}, option=orjson.OPT_SORT_KEYS)


class Sealer:
    """Seals rows with the signing key (when this service has it) and checks seals with the
    trusted public keys."""

    def __init__(self, signer: Signer | None, keys: Mapping[str, Ed25519PublicKey]) -> None:
        self.signer = signer
        self.keys = dict(keys)
        if signer is not None:  # its own seals always verify here
            public = signer.public_key()
            self.keys.setdefault(signer.key_id, public)

    def seal(self, kind: str, fields: Mapping[str, Any]) -> str:
        if self.signer is None:
            raise CannotSeal(
                "this node has no signing key (GTM_DOCUMENT_SIGNING_KEY): it cannot create "
                "principals, tokens, proposals or approvals"
            )
        return f"{self.signer.key_id}:{self.signer.sign_bytes(_body(kind, fields))}"

    def verifies(self, kind: str, fields: Mapping[str, Any], seal: str | None) -> bool:
        if not seal or ":" not in seal:
            return False
        key_id, _, signature = seal.partition(":")
        key = self.keys.get(key_id)
        if key is None:
            return False
        try:
            key.verify(bytes.fromhex(signature), _body(kind, fields))
        except (InvalidSignature, ValueError):
            return False
        return True


def principal_fields(
    id: str, name: str, roles: list[str], disabled: bool, oidc_subject: str | None = None
) -> dict[str, Any]:
    fields: dict[str, Any] = {"id": id, "name": name, "roles": sorted(roles), "disabled": disabled}
    if oidc_subject is not None:
        # Only when bound, so the seals of principals made before OIDC still verify; a subject
        # written into a sealed row afterwards makes the seal fail.
        fields["oidc_subject"] = oidc_subject
    return fields


def token_fields(
    id: str, principal_id: str, secret_hash: str, expires_at_us: int | None, revoked: bool
) -> dict[str, Any]:
    return {
        "id": id,
        "principal_id": principal_id,
        "secret_hash": secret_hash,
        "expires_at_us": expires_at_us,
        "revoked": revoked,
    }


def proposal_fields(id: int, author_id: str) -> dict[str, Any]:
    return {"id": id, "author_id": author_id}


def approval_fields(
    proposal_id: int, principal_id: str, version_id: str, at_us: int
) -> dict[str, Any]:
    return {
        "proposal_id": proposal_id,
        "principal_id": principal_id,
        "version_id": version_id,
        "at_us": at_us,
    }


__all__ = [
    "CannotSeal",
    "Sealer",
    "approval_fields",
    "principal_fields",
    "proposal_fields",
    "token_fields",
]
