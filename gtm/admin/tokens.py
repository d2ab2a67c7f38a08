"""API tokens: how one looks, and what the database keeps of it.

A token is ``gtm_<id>_<secret>``: ``id`` (16 hex digits) finds its row, ``secret`` (43
characters, 256 random bits) proves it. Only SHA-256 of the secret is stored, compared in
constant time; a token is shown once, when it is made. 256 random bits need no slow hash: there
is nothing to guess from a dictionary.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

_TOKEN = re.compile(r"^gtm_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True, slots=True)
class NewToken:
    id: str
    secret_hash: str
    text: str  # shown once, never stored


def new_token() -> NewToken:
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return NewToken(token_id, hash_secret(secret), f"gtm_{token_id}_{secret}")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(text: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed token, else None."""
    match = _TOKEN.match(text)
    return (match.group(1), match.group(2)) if match else None


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


__all__ = ["NewToken", "hash_secret", "new_token", "parse_token"]
