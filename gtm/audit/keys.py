"""A chain's signing key: Ed25519, generated on first start, in a file of mode 0600.

Each audit chain (a node, or each worker of a node) signs its checkpoints with the key in its
spool directory (``audit-signing.key``) unless ``GTM_AUDIT_SIGNING_KEY`` names one. The public
half is published to the checkpoint sink (:mod:`gtm.audit.checkpoints`) when the key is made, so
a verifier needs nothing from the database to know whose signatures to trust. The key also
derives the MAC key of the spool's lines (:mod:`gtm.audit.spool`): a spool line edited on disk,
hashes recomputed, no longer verifies.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gtm.errors import ConfigError, Problem
from gtm.secret_files import read_owner_only, write_new_owner_only

KEY_NAME = "audit-signing.key"


def key_id(key: Ed25519PublicKey) -> str:
    """The first 16 hex digits of SHA-256 over the raw public key."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class ChainKey:
    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = key.public_key()
        self.id = key_id(self.public)
        raw = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        # A separate key for MACs, derived one way: a MAC never reveals the signing key.
        self.mac_key = hashlib.sha256(b"gtm audit spool mac\0" + raw).digest()

    def sign(self, body: bytes) -> str:
        return self._key.sign(body).hex()


def load_or_create(path: Path) -> ChainKey:
    """The key in ``path``, made (0600 from the first byte) when there is none. A key file that
    others may read, or that is not an Ed25519 private key, is a start-up error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    try:
        write_new_owner_only(path, pem)
    except FileExistsError:
        return _load(path)
    return ChainKey(key)


def _load(path: Path) -> ChainKey:
    return ChainKey(load_private_key(path, "the audit signing key"))


def load_private_key(path: Path, what: str) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (PEM); :class:`ConfigError` when it is unreadable,
    not Ed25519, or readable by anyone but its owner. ``what`` names it in the error."""
    data = read_owner_only(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError([Problem(str(path), "", f"not a PEM private key: {exc}")]) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError([Problem(str(path), "", "not an Ed25519 private key")])
    return key


def load_public(data: bytes) -> Ed25519PublicKey | None:
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        return None
    return key if isinstance(key, Ed25519PublicKey) else None


__all__ = [
    "KEY_NAME",
    "ChainKey",
    "key_id",
    "load_or_create",
    "load_private_key",
    "load_public",
    "public_pem",
]
